"""`autotune bench` under Triton's interpreter: tuned vs default rows, ratios, JSON, errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from flashtune.cli import main

TINY = [{"batch": 1, "heads": 2, "seqlen": 64, "head_dim": 32, "dtype": "fp16"}]


def _shapes(tmp_path: Path) -> str:
    p = tmp_path / "shapes.json"
    p.write_text(json.dumps(TINY))
    return str(p)


def test_bench_without_tuning_times_the_default_only(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--shapes",
                                    _shapes(tmp_path), "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["interpreter"] is True and doc["device"]["name"] == "cpu-interpreter"
    assert [r["timing"] for r in doc["rows"]] == ["fwd", "bwd", "infer"]
    for r in doc["rows"]:
        assert set(r["tflops"]) == {"default"} and r["tflops"]["default"] > 0
        assert r["ratios"] == {}


def test_bench_compares_tuned_with_default(tmp_path: Path) -> None:
    db, shapes = str(tmp_path / "t.db"), _shapes(tmp_path)
    tuned = CliRunner().invoke(main, ["sweep", "--interpret", "--shapes", shapes, "--direction",
                                      "fwd", "--trials", "2", "--db", db])
    assert tuned.exit_code == 0, tuned.output
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--shapes", shapes,
                                    "--db", db])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    for r in doc["rows"]:
        assert set(r["tflops"]) == {"tuned", "default"}
        assert r["tuned_directions"] == ["fwd"]
        ratio = r["ratios"]["tuned/default"]
        assert ratio == r["tflops"]["tuned"] / r["tflops"]["default"] > 0
    assert set(doc["geomean_ratios"]) == {"fwd", "bwd", "infer"}

    human = CliRunner().invoke(main, ["bench", "--interpret", "--shapes", shapes, "--db", db])
    assert human.exit_code == 0, human.output
    assert "TFLOP/s, interpreter" in human.stdout and "tuned/default" in human.stdout
    assert "geomean fwd: tuned/default" in human.stdout
    assert {r["tuned_layers"]["fwd"] for r in doc["rows"]} == {"user"}


def test_bench_times_what_a_fresh_install_serves_from_the_shipped_layer(
        tmp_path: Path, monkeypatch) -> None:
    """No user database: "tuned" is the shipped layer's entry, as the dispatcher serves it."""
    from flashtune.db import exchange, open_storage

    team, shapes = str(tmp_path / "team.db"), _shapes(tmp_path)
    swept = CliRunner().invoke(main, ["sweep", "--interpret", "--shapes", shapes, "--direction",
                                      "bwd", "--trials", "1", "--db", team])
    assert swept.exit_code == 0, swept.output
    with open_storage(team) as st:
        shipped = tuple(exchange.validate_export(exchange.export_json(st)))
    assert [r.key.direction for r in shipped] == ["bwd"]
    monkeypatch.setattr(exchange, "_shipped", lambda: shipped)
    none = tmp_path / "none.db"
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                    "--shapes", shapes, "--db", str(none)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    for r in doc["rows"]:
        assert set(r["tflops"]) == {"tuned", "default"}
        assert r["tuned_directions"] == ["bwd"] and r["tuned_layers"] == {"bwd": "shipped"}
    assert not none.exists()  # reading the layers made no database
    monkeypatch.setenv("FLASHTUNE_DB", str(none))  # the same database named by the variable
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                    "--shapes", shapes])
    assert res.exit_code == 0, res.output
    assert [r["tuned_layers"] for r in json.loads(res.stdout)["rows"]] == [{"bwd": "shipped"}] * 3
    assert not none.exists()


def test_bench_on_a_garbage_database_says_so_and_leaves_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not a database" * 100)
    res = CliRunner().invoke(main, ["bench", "--interpret", "--rep-ms", "1", "--shapes",
                                    _shapes(tmp_path), "--db", str(bad)])
    assert res.exit_code == 1 and "cannot use the tuning database" in res.stderr
    assert "Traceback" not in res.output
    assert bad.read_bytes() == b"this is not a database" * 100


def test_bench_unknown_preset_is_a_usage_error() -> None:
    res = CliRunner().invoke(main, ["bench", "--interpret", "--preset", "llama5"])
    assert res.exit_code == 2 and "llama5" in res.stderr and "Traceback" not in res.output


def test_bench_interpret_without_triton_interpret_in_the_environment(tmp_path: Path) -> None:
    """--interpret alone must do: CI exports TRITON_INTERPRET for the whole run, users don't."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "flashtune.cli", "bench", "--interpret", "--json",
                        "--rep-ms", "1", "--shapes", _shapes(tmp_path),
                        "--db", str(tmp_path / "none.db")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["errors"] == [] and all(row["tflops"]["default"] > 0 for row in doc["rows"])


def test_bench_fails_when_nothing_could_be_measured(tmp_path: Path, monkeypatch) -> None:
    import flashtune.timing

    def broken(*a, **kw):
        raise RuntimeError("cannot run")

    monkeypatch.setattr(flashtune.timing, "three_timings", broken)
    monkeypatch.setattr(flashtune.timing, "three_timings_interleaved", broken)
    for order in ("--interleave", "--in-turn"):
        res = CliRunner().invoke(main, ["bench", "--interpret", "--shapes", _shapes(tmp_path),
                                        order, "--db", str(tmp_path / "none.db")])
        assert res.exit_code == 1 and "every implementation failed" in res.stderr
        assert "cannot run" in res.stderr and "Traceback" not in res.output


@pytest.mark.parametrize("order,timer", [("--interleave", "three_timings_interleaved"),
                                         ("--in-turn", "three_timings")])
def test_bench_sigterm_keeps_the_shapes_measured_whole(tmp_path: Path, monkeypatch,
                                                       order: str, timer: str) -> None:
    """A SIGTERM (a job scheduler's, ``timeout``'s) during the second shape's timings: the
    first shape's rows come out as JSON, marked as interrupted, the shape in hand is
    dropped, and the exit status is 143, without a traceback."""
    import os
    import signal

    import flashtune.timing

    real = getattr(flashtune.timing, timer)
    seen: list[int] = []

    def timed(fns, p, dev, **kw):
        seen.append(p.seqlen_q)
        if p.seqlen_q == 48:  # the second shape: a real signal, through the real handler
            os.kill(os.getpid(), signal.SIGTERM)
        return real(fns, p, dev, **kw)

    monkeypatch.setattr(flashtune.timing, timer, timed)
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(TINY + [dict(TINY[0], seqlen=48), dict(TINY[0], seqlen=80)]))
    def unhandled(signum, frame):  # what runs if the bench installed no handler of its own
        raise RuntimeError("the bench did not handle SIGTERM")

    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        res = CliRunner().invoke(main, ["bench", "--interpret", "--json", order, "--shapes",
                                        str(shapes), "--db", str(tmp_path / "none.db")])
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert res.exit_code == 143, res.output
    assert "Traceback" not in res.output
    assert "interrupted: 1 of 3 shapes measured" in res.stderr
    doc = json.loads(res.stdout)
    assert doc["interrupted"] is True and doc["shapes"] == {"measured": 1, "total": 3}
    assert {r["problem"]["seqlen_q"] for r in doc["rows"]} == {64}
    assert [r["timing"] for r in doc["rows"]] == ["fwd", "bwd", "infer"]
    assert all(r["tflops"]["default"] > 0 for r in doc["rows"])
    assert 80 not in seen  # nothing ran after the signal
    assert after is unhandled  # the bench put the previous handler back


def test_bench_sigterm_before_any_shape_measured_exits_143(tmp_path: Path, monkeypatch) -> None:
    import os
    import signal

    import flashtune.timing

    def timed(fns, p, dev, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal did not stop the bench")

    monkeypatch.setattr(flashtune.timing, "three_timings_interleaved", timed)
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # never the default: it kills
    try:
        res = CliRunner().invoke(main, ["bench", "--interpret", "--shapes", _shapes(tmp_path),
                                        "--db", str(tmp_path / "none.db")])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert res.exit_code == 143, res.output
    assert "interrupted: 0 of 1 shapes measured" in res.stderr
    assert "Traceback" not in res.output


def test_bench_times_side_by_side_unless_in_turn_and_says_which(tmp_path: Path,
                                                                 monkeypatch) -> None:
    import flashtune.timing

    used: list[tuple[str, float, float]] = []
    for name in ("three_timings", "three_timings_interleaved"):
        real = getattr(flashtune.timing, name)
        monkeypatch.setattr(flashtune.timing, name,
                            lambda *a, _real=real, _name=name, **kw: (
                                used.append((_name, kw["warmup_ms"], kw["rep_ms"])),
                                _real(*a, **kw))[1])
    for flag, order in (([], "interleaved"), (["--in-turn"], "in turn")):
        used.clear()
        res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                        "--warmup-ms", "7", *flag, "--shapes",
                                        _shapes(tmp_path), "--db", str(tmp_path / "none.db")])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert doc["order"] == order and doc["shapes"] == {"measured": 1, "total": 1}
        assert (doc["warmup_ms"], doc["rep_ms"]) == (7.0, 1.0)
        assert [r["timing"] for r in doc["rows"]] == ["fwd", "bwd", "infer"]
        assert all(r["tflops"]["default"] > 0 for r in doc["rows"])
        assert used == ([("three_timings", 7.0, 1.0)] if flag
                        else [("three_timings_interleaved", 7.0, 1.0)])
        # Where the shape's time went: its wall time, and side by side the first calls;
        # the host's load at the shape's start and end, and its CPUs.
        assert doc["host_cpus"] >= 1
        for r in doc["rows"]:
            assert r["shape_wall_s"] > 0
            assert len(r["host_load"]) == 2 and min(r["host_load"]) >= 0
            if flag:
                assert "first_calls_s" not in r
            else:
                assert set(r["first_calls_s"]) == {"default"}
                assert 0 < r["first_calls_s"]["default"] <= r["shape_wall_s"]


def test_bench_lead_ms_reaches_the_side_by_side_timing_and_is_checked(tmp_path: Path,
                                                                       monkeypatch) -> None:
    """--lead-ms goes to the side-by-side timing and into the document; a value that is
    neither 'auto' nor 0-1000 ms, or one with --in-turn, is a usage error that says what
    is allowed. Under the interpreter no host issue times are read (rows have no "host")."""
    import flashtune.timing

    leads: list[Any] = []
    real = flashtune.timing.three_timings_interleaved
    monkeypatch.setattr(flashtune.timing, "three_timings_interleaved",
                        lambda *a, **kw: (leads.append((kw["lead_ms"], kw["host_log"])),
                                          real(*a, **kw))[1])
    base = ["bench", "--interpret", "--json", "--rep-ms", "1", "--shapes", _shapes(tmp_path),
            "--db", str(tmp_path / "none.db")]
    for value, want in (("auto", "auto"), ("0.5", 0.5)):
        leads.clear()
        res = CliRunner().invoke(main, [*base, "--lead-ms", value])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert doc["lead_ms"] == want and leads == [(want, None)]
        assert all("host" not in r for r in doc["rows"])
    for bad in ("soon", "-1", "2000", "nan"):
        res = CliRunner().invoke(main, [*base, "--lead-ms", bad])
        assert res.exit_code == 2 and "neither 'auto' nor" in res.stderr, (bad, res.output)
    res = CliRunner().invoke(main, [*base, "--lead-ms", "auto", "--in-turn"])
    assert res.exit_code == 2 and "side by side only" in res.stderr, res.output


def test_bench_json_reports_progress_on_stderr(tmp_path: Path) -> None:
    """--json keeps stdout one JSON document and still says on stderr which shape it is
    timing, so a run cut by a time limit tells where it was."""
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                    "--shapes", _shapes(tmp_path),
                                    "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 0, res.output
    json.loads(res.stdout)
    assert "[1/1] " in res.stderr and "[1/1]" not in res.stdout


# A bench during whose timings the process itself and a process it starts write to stdout,
# as Triton does when ptxas fails (it prints the whole PTX listing there).
_NOISY_BENCH = """
import subprocess, sys
import flashtune.timing
real = flashtune.timing.three_timings_interleaved
def timed(fns, p, dev, **kw):
    print("noise from the bench itself", flush=True)
    subprocess.run([sys.executable, "-c", "print('noise from a child process')"], check=True)
    return real(fns, p, dev, **kw)
flashtune.timing.three_timings_interleaved = timed
from flashtune.cli import main
main(sys.argv[1:])
"""


def test_bench_json_stdout_is_the_document_alone_whatever_else_prints(tmp_path: Path) -> None:
    """With --json, stdout carries the JSON document and nothing else, even where the bench
    or a process it starts prints to stdout meanwhile; that output goes to stderr. (A
    bench cut by a time limit mid-compile had Triton's PTX dump before its document.)"""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _NOISY_BENCH, "bench", "--interpret", "--json",
                        "--rep-ms", "1", "--shapes", _shapes(tmp_path),
                        "--db", str(tmp_path / "none.db")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert [row["timing"] for row in doc["rows"]] == ["fwd", "bwd", "infer"]
    assert "noise from the bench itself" in r.stderr
    assert "noise from a child process" in r.stderr


# A bench whose second shape never returns from its timings, with SIGTERM and SIGINT
# blocked in the main thread: as a main thread waiting on the GPU for a hung kernel, it
# never gets back to Python. (A signal that lands between "stuck" and the sleep still runs
# the handler there, at the next bytecode: the loop swallows that, as the hung kernel
# would never return to let it act.)
_STUCK_BENCH = """
import signal, sys, time
import flashtune.timing
real = flashtune.timing.three_timings_interleaved
def timed(fns, p, dev, **kw):
    if p.seqlen_q == 48:
        while True:
            try:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
                print("stuck", file=sys.stderr, flush=True)
                time.sleep(600)
            except KeyboardInterrupt:
                pass
    return real(fns, p, dev, **kw)
flashtune.timing.three_timings_interleaved = timed
from flashtune.cli import main
main(sys.argv[1:])
"""


def test_bench_sigterm_while_the_main_thread_is_stuck_reports_and_exits(
        tmp_path: Path) -> None:
    """A SIGTERM that finds the main thread blocked (a hung GPU kernel) ends the bench
    after $FLASHTUNE_SIGNAL_GRACE seconds, with the shapes measured whole as JSON and exit
    status 143, instead of never ending."""
    import os
    import signal
    import subprocess
    import sys
    import time

    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(TINY + [dict(TINY[0], seqlen=48)]))
    env = dict(os.environ, TRITON_INTERPRET="1", FLASHTUNE_SIGNAL_GRACE="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_BENCH, "bench", "--interpret", "--json", "--rep-ms",
         "1", "--shapes", str(shapes), "--db", str(tmp_path / "none.db")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the first shape is measured, then the second sticks
            seen.append(line)
            if line.strip() == "stuck":
                break
        assert seen and seen[-1].strip() == "stuck", "".join(seen)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        waited = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert 1 <= waited < 100  # the grace, then the exit (not the 600 s sleep)
    assert "no answer to SIGTERM within 1 s" in err
    assert "interrupted: 1 of 2 shapes measured" in err
    doc = json.loads(out)
    assert doc["interrupted"] is True and doc["shapes"] == {"measured": 1, "total": 2}
    assert [r["timing"] for r in doc["rows"]] == ["fwd", "bwd", "infer"]
    assert all(r["problem"]["seqlen_q"] == 64 and r["tflops"]["default"] > 0
               for r in doc["rows"])


def test_the_compile_jobs_are_each_shapes_tuned_and_default_configs_once(
        tmp_path: Path) -> None:
    """What the bench builds ahead of its timings on a GPU (--precompile): per shape, the
    tuned config of each tuned direction and the default of both, in the order the timed
    calls will ask for them, each (shape, direction, config) once."""
    from flashtune.autotune.presets import load_shapes
    from flashtune.cli.bench import compile_jobs
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info, software_info
    from flashtune.dispatch._table import load_table
    from flashtune.kernels.config import config_to_dict, default_bwd, default_fwd

    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(TINY + [dict(TINY[0], causal=True), TINY[0]]))
    problems = load_shapes(str(shapes))
    p0, p1 = problems[0], problems[1]
    tuned = dict(config_to_dict(default_fwd(p0)), block_n=16)
    assert tuned != config_to_dict(default_fwd(p0))
    db = tmp_path / "t.db"
    timing = dict(median_ms=1.0, p20_ms=0.9, p80_ms=1.1, tflops=1.0, max_error=0.0,
                  trials=1, search_seconds=1.0)
    with open_storage(db) as st:
        st.put_result(device_info(), software_info(), p0.key("fwd"), tuned, problem=p0,
                      **timing)
        # p1's tuned backward is its default: one build
        st.put_result(device_info(), software_info(), p1.key("bwd"),
                      config_to_dict(default_bwd(p1)), problem=p1, **timing)
    table = load_table(device_info(), str(db))
    jobs = [(p, d, cfg) for p, d, cfg in compile_jobs(problems, table)]
    assert jobs == [
        (p0, "fwd", tuned), (p0, "fwd", config_to_dict(default_fwd(p0))),
        (p0, "bwd", config_to_dict(default_bwd(p0))),
        (p1, "fwd", config_to_dict(default_fwd(p1))),
        (p1, "bwd", config_to_dict(default_bwd(p1))),
    ]  # the third shape repeats the first: nothing more to build


@pytest.mark.gpu
def test_bench_on_a_gpu_builds_the_kernels_ahead_then_times(tmp_path: Path,
                                                            monkeypatch) -> None:
    """--precompile (the default) on a cold Triton cache: a pool builds the shapes' kernels,
    then the timings run, side by side with the anchors, with the GPU clocks sampled."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([
        {"batch": 2, "heads": 4, "seqlen": 256, "head_dim": 64, "causal": True},
        {"batch": 1, "heads": 4, "seqlen": 384, "head_dim": 128}]))
    # 25 ms per implementation and timing: loops long enough for several 20 ms samples
    res = CliRunner().invoke(main, ["bench", "--json", "--rep-ms", "25", "--shapes",
                                    str(shapes), "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 0, res.output
    import re

    built = re.search(r"compiling (\d+) kernel configs on \d+ processes", res.stderr)
    assert built and int(built.group(1)) >= 4, res.stderr  # the defaults (and any tuned)
    doc = json.loads(res.stdout)
    assert doc["order"] == "interleaved" and doc["shapes"] == {"measured": 2, "total": 2}
    assert all(r["tflops"]["default"] > 0 and r["tflops"].get("cudnn", 1) > 0
               for r in doc["rows"])
    assert any(f.is_file() for f in (tmp_path / "triton").rglob("*"))
    # The clocks each timing ran at, from NVML (the driver's library).
    assert doc["clocks"].startswith("sampled"), doc["clocks"]
    for r in doc["rows"]:
        s = r["clocks"]["all"]
        assert s["samples"] >= 1 and 100 <= s["sm_mhz"]["median"] <= 5000, s


def test_part_slices_cover_the_shape_set_once_in_order() -> None:
    from flashtune.cli.bench import Part

    for total in range(0, 12):
        items = list(range(total))
        for n in range(1, 6):
            slices = [Part.select(items, k, n) for k in range(1, n + 1)]
            assert [x for s in slices for x in s] == items
            assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_bench_parts_merge_into_the_whole_bench(tmp_path: Path) -> None:
    """Three shapes benched as --part 1/2 and 2/2 (two shapes, then one) merge into one
    document of the three, whose geomeans are recomputed over all rows; parts of another
    order, or a shape benched twice, are refused."""
    from flashtune.cli.bench import geomean_ratios, merge_parts

    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(TINY + [dict(TINY[0], seqlen=48), dict(TINY[0], seqlen=80)]))
    db = str(tmp_path / "t.db")
    sweep = CliRunner().invoke(main, ["sweep", "--interpret", "--shapes", str(shapes),
                                      "--direction", "fwd", "--trials", "1", "--db", db])
    assert sweep.exit_code == 0, sweep.output
    docs = []
    for part in ("1/2", "2/2"):
        res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                        "--part", part, "--shapes", str(shapes), "--db", db])
        assert res.exit_code == 0, res.output
        docs.append(json.loads(res.stdout))
    assert [d["part"] for d in docs] == ["1/2", "2/2"]
    assert [d["shapes"] for d in docs] == [{"measured": 2, "total": 2},
                                           {"measured": 1, "total": 1}]
    merged = merge_parts(docs)
    assert [r["problem"]["seqlen_q"] for r in merged["rows"] if r["timing"] == "fwd"] == \
        [64, 48, 80]
    assert merged["shapes"] == {"measured": 3, "total": 3}
    assert merged["host_cpus"] == docs[0]["host_cpus"]
    assert all(len(r["host_load"]) == 2 for r in merged["rows"])
    assert merged["geomean_ratios"] == geomean_ratios(merged["rows"])
    assert merged["geomean_ratios"]["fwd"]["tuned/default"] > 0
    with pytest.raises(ValueError, match="differ in order"):
        merge_parts([docs[0], dict(docs[1], order="in turn")])
    with pytest.raises(ValueError, match="differ in warmup_ms"):
        merge_parts([docs[0], dict(docs[1], warmup_ms=1000.0)])
    with pytest.raises(ValueError, match="differ in impls"):
        merge_parts([docs[0], dict(docs[1], impls=["tuned", "cudnn"])])
    with pytest.raises(ValueError, match="differ in lead_ms"):
        merge_parts([docs[0], dict(docs[1], lead_ms="auto")])
    # A part from before --lead-ms had none: it merges with one timed at lead 0.
    old_part = {k: v for k, v in docs[1].items() if k != "lead_ms"}
    assert docs[0]["lead_ms"] == 0.0 and merge_parts([docs[0], old_part])["lead_ms"] == 0.0
    with pytest.raises(ValueError, match="more than one part"):
        merge_parts([docs[0], docs[0]])
    bad = CliRunner().invoke(main, ["bench", "--interpret", "--part", "4/4", "--shapes",
                                    str(shapes), "--db", db])
    assert bad.exit_code == 2 and "only 3 shapes" in bad.output
    bad = CliRunner().invoke(main, ["bench", "--interpret", "--part", "3/2", "--shapes",
                                    str(shapes), "--db", db])
    assert bad.exit_code == 2 and "1 <= K <= N" in bad.output


class _Clock:
    """A clock reader of known values for the sampler (the n-th read says n MHz)."""

    def __init__(self) -> None:
        self.n = 0

    def read(self):
        import time

        from flashtune.gpu_clocks import Sample

        self.n += 1
        return Sample(time.perf_counter(), self.n, 250.0, 50, 0x4)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("interleave", [True, False])
def test_bench_rows_carry_the_clocks_of_their_own_timing(tmp_path: Path,
                                                         interleave: bool) -> None:
    """Each row says at what clocks it was timed: side by side one summary ("all") per
    timing, in turn one per implementation (here only the default: nothing is tuned); the
    backward row has the forward+backward's. The sampler reads a counter here (NVML
    itself is tested on a GPU, tests/test_gpu_clocks.py), so the timings' windows must not
    overlap: each later timing reads higher values."""
    from flashtune.cli.bench import _bench_rows
    from flashtune.db.fingerprint import device_info
    from flashtune.dispatch._table import load_table
    from flashtune.gpu_clocks import ClockSampler
    from flashtune.problem import Problem

    p = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32,
                dtype="fp16")
    table = load_table(device_info(), str(tmp_path / "none.db"))
    rows: list[dict] = []
    errors: list[str] = []
    with ClockSampler(_Clock(), period_s=0.0005) as sampler:  # type: ignore[arg-type]
        stopped = _bench_rows([p], table, True, 1.0, lambda m: None, rows, errors,
                              interleave, sampler)
    assert not stopped and not errors
    assert [r["timing"] for r in rows] == ["fwd", "bwd", "infer"]
    names = ["all"] if interleave else sorted(rows[0]["tflops"])
    for r in rows:
        assert sorted(r["clocks"]) == names
        for s in r["clocks"].values():
            assert s is not None and s["samples"] >= 1 and s["reasons"] == ["sw_power_cap"]
    # Each implementation's (or the shared loop's) timings ran fwd, fwd+bwd, infer, so
    # their windows' counter values follow one another without overlap.
    for name in names:
        spans = [(r["clocks"][name]["sm_mhz"]["min"], r["clocks"][name]["sm_mhz"]["max"])
                 for r in rows]
        assert all(a[1] < b[0] for a, b in itertools.pairwise(spans)), spans


def test_bench_on_the_interpreter_records_no_clocks(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                    "--shapes", _shapes(tmp_path),
                                    "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert "clocks" not in doc and all("clocks" not in r for r in doc["rows"])


def _bench_nondet_with_entry(tmp_path: Path, entry: Any) -> tuple[Any, dict[str, Any]]:
    """Bench TINY as a `deterministic: false` shape over a database holding one backward
    entry, made by ``entry(p)`` from the shape's problem: (the problem, the bwd row)."""
    from flashtune.autotune.presets import load_shapes
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info, software_info

    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([dict(TINY[0], deterministic=False)]))
    (p,) = load_shapes(str(shapes))
    assert not p.deterministic
    stored, cfg = entry(p)
    with open_storage(tmp_path / "t.db") as st:
        st.put_result(device_info(), software_info(), stored.key("bwd"), cfg, problem=stored,
                      median_ms=1.0, p20_ms=0.9, p80_ms=1.1, tflops=1.0, max_error=0.0,
                      trials=1, search_seconds=1.0)
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                    "--shapes", str(shapes), "--db", str(tmp_path / "t.db")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["errors"] == []
    bwd = next(r for r in doc["rows"] if r["timing"] == "bwd")
    assert bwd["tuned_directions"] == ["bwd"] and bwd["tflops"]["tuned"] > 0
    return p, bwd


def test_bench_calls_a_nondeterministic_shape_as_such(tmp_path: Path) -> None:
    """A shape with `deterministic: false` is benched as `deterministic=False` calls, so that
    a config tuned for that key (here the atomic-dQ backward, which only such calls may
    run) is timed, not refused."""
    from flashtune.kernels.config import BWD_ATOMIC, config_to_dict, default_bwd

    _, bwd = _bench_nondet_with_entry(
        tmp_path, lambda p: (p, dict(config_to_dict(default_bwd(p)), variant=BWD_ATOMIC)))
    assert bwd["tuned_layers"] == {"bwd": "user"}


def test_bench_times_the_deterministic_twin_a_nondeterministic_shape_is_served(
        tmp_path: Path) -> None:
    """With no entry for a `deterministic: false` key, the dispatcher serves its
    deterministic twin's entry as nearest; the bench's "tuned" times that config, not the
    heuristic default, and names where it came from."""
    import dataclasses

    from flashtune.kernels.config import config_to_dict, default_bwd

    def twin_entry(p: Any) -> tuple[Any, dict[str, Any]]:
        twin = dataclasses.replace(p, deterministic=True)
        return twin, dict(config_to_dict(default_bwd(twin)), dq_block_m=32)

    p, bwd = _bench_nondet_with_entry(tmp_path, twin_entry)
    twin_key = dataclasses.replace(p, deterministic=True).key("bwd")
    assert bwd["tuned_layers"] == {"bwd": f"user nearest {twin_key.short()}"}
    assert "nondet" not in bwd["tuned_layers"]["bwd"]


def test_the_nondeterministic_standard_shapes_are_the_standard_preset() -> None:
    """benchmarks/data/standard_nondet.yaml (issue 13's deterministic=False bench) is the
    standard preset, shape for shape, with deterministic: false."""
    import dataclasses

    from flashtune.autotune.presets import PRESETS, load_shapes

    path = Path(__file__).parents[2] / "benchmarks" / "data" / "standard_nondet.yaml"
    shapes = load_shapes(str(path))
    assert shapes and all(not p.deterministic for p in shapes)
    assert [dataclasses.replace(p, deterministic=True) for p in shapes] == \
        list(PRESETS["standard"]())


def test_bench_impls_times_only_those_named(tmp_path: Path) -> None:
    """--impls keeps the named implementations; tuned stands down to the default on a shape
    with nothing tuned (the ratios are ours over the others); names that are not
    implementations, or a list without ours, are usage errors that say what is allowed."""
    db, shapes = str(tmp_path / "t.db"), _shapes(tmp_path)
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                    "--impls", "tuned", "--shapes", shapes, "--db", db])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["impls"] == ["tuned"]
    assert all(set(r["tflops"]) == {"default"} for r in doc["rows"])  # nothing tuned yet
    swept = CliRunner().invoke(main, ["sweep", "--interpret", "--shapes", shapes, "--direction",
                                      "fwd", "--trials", "2", "--db", db])
    assert swept.exit_code == 0, swept.output
    for names, want in (("tuned", {"tuned"}), ("default,tuned", {"tuned", "default"}),
                        ("default", {"default"})):
        res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                        "--impls", names, "--shapes", shapes, "--db", db])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert all(set(r["tflops"]) == want for r in doc["rows"]), (names, doc["rows"])
        assert ("tuned/default" in doc["rows"][0]["ratios"]) == (want == {"tuned", "default"})
    for bad, says in (("tuned,sdpa", "sdpa: not an implementation"),
                      ("cudnn,flex", "name tuned or default too")):
        res = CliRunner().invoke(main, ["bench", "--interpret", "--impls", bad, "--shapes",
                                        shapes, "--db", db])
        assert res.exit_code == 2 and says in res.output, res.output


def test_compile_jobs_follow_impls(tmp_path: Path) -> None:
    """The precompile builds only what the kept implementations run: tuned alone needs the
    default too in a direction that is not tuned."""
    from flashtune.autotune.presets import load_shapes
    from flashtune.cli.bench import compile_jobs
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info, software_info
    from flashtune.dispatch._table import load_table
    from flashtune.kernels.config import config_to_dict, default_bwd, default_fwd

    (p,) = load_shapes(_shapes(tmp_path))
    tuned = dict(config_to_dict(default_fwd(p)), block_n=16)
    with open_storage(tmp_path / "t.db") as st:
        st.put_result(device_info(), software_info(), p.key("fwd"), tuned, problem=p,
                      median_ms=1.0, p20_ms=0.9, p80_ms=1.1, tflops=1.0, max_error=0.0,
                      trials=1, search_seconds=1.0)
    table = load_table(device_info(), str(tmp_path / "t.db"))
    dfwd, dbwd = config_to_dict(default_fwd(p)), config_to_dict(default_bwd(p))
    assert compile_jobs([p], table, frozenset({"tuned"})) == \
        [(p, "fwd", tuned), (p, "bwd", dbwd)]
    assert compile_jobs([p], table, frozenset({"default", "cudnn"})) == \
        [(p, "fwd", dfwd), (p, "bwd", dbwd)]
    assert compile_jobs([p], table) == [(p, "fwd", tuned), (p, "fwd", dfwd), (p, "bwd", dbwd)]


def test_flex_warmup_covers_each_shape_flex_runs_once(tmp_path: Path) -> None:
    from flashtune.cli.bench import flex_jobs
    from flashtune.problem import Problem

    dense = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32)
    causal = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32,
                     causal=True)
    windowed = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64,
                       head_dim=32, window=(16, 0))
    ragged_causal = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=32, seqlen_k=64,
                            head_dim=32, causal=True)
    shapes = [dense, windowed, causal, dense, ragged_causal]
    assert flex_jobs(shapes) == [dense, causal]  # the anchors' own rules, each shape once
    assert flex_jobs(shapes, frozenset({"tuned", "flex"})) == [dense, causal]
    assert flex_jobs(shapes, frozenset({"tuned", "cudnn"})) == []


def test_anchors_builds_only_those_named() -> None:
    from flashtune.problem import Problem
    from flashtune.timing import ANCHOR_NAMES, anchors

    p = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32)
    assert list(anchors(p)) == list(ANCHOR_NAMES)
    assert list(anchors(p, ("flex", "cudnn"))) == ["cudnn", "flex"]
    assert anchors(p, ()) == {}
    assert anchors(Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64,
                           head_dim=32, softcap=10.0)) == {}


def test_flex_warmup_pool_reports_what_it_could_not_compile_and_ends() -> None:
    """The warm-up pool on a machine where Flex cannot run (no CUDA here): every shape
    comes back failed with its reason, nothing raises, and the pool is gone after."""
    import dataclasses
    import multiprocessing

    from flashtune.cli.bench import _warm_flex
    from flashtune.problem import Problem
    from flashtune.timing import warm_flex

    p = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32)
    seconds, error = warm_flex(p.as_dict())
    if not error:
        pytest.skip("FlexAttention compiled here: this machine has a GPU")
    assert seconds >= 0
    said: list[str] = []
    _warm_flex([p, dataclasses.replace(p, causal=True)], None, said.append)
    assert said[0].startswith("compiling FlexAttention for 2 shapes on "), said
    assert "2 shapes failed" in said[-1] and error.split(":")[0] in said[-1], said
    assert not multiprocessing.active_children()


@pytest.mark.gpu
def test_on_a_gpu_warm_flex_compiles_a_shape_and_the_bench_warms_ahead(tmp_path: Path,
                                                                       monkeypatch) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from flashtune.problem import Problem
    from flashtune.timing import warm_flex

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    p = Problem(batch=1, heads_q=4, heads_kv=4, seqlen_q=256, seqlen_k=256, head_dim=64,
                causal=True)
    seconds, error = warm_flex(p.as_dict())
    assert error == "" and seconds > 0
    res = _bench_on_a_gpu(tmp_path, {"batch": 1, "heads": 4, "seqlen": 384, "head_dim": 64},
                          "--warm-flex", "--impls", "default,flex")
    assert "FlexAttention compiled in" in res.stderr and "failed" not in res.stderr, res.stderr
    doc = json.loads(res.stdout)
    assert all(r["tflops"]["flex"] > 0 for r in doc["rows"])


@pytest.mark.gpu
def test_on_a_gpu_bench_no_clocks_records_none(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    res = _bench_on_a_gpu(tmp_path, {"batch": 1, "heads": 2, "seqlen": 256, "head_dim": 64},
                          "--no-clocks", "--impls", "default,cudnn")
    doc = json.loads(res.stdout)
    assert doc["clocks"] == "not sampled: --no-clocks"
    assert doc["rows"] and all("clocks" not in r for r in doc["rows"])


def _bench_on_a_gpu(tmp_path: Path, shape: dict, *args: str):  # type: ignore[no-untyped-def]
    """`autotune bench --json --rep-ms 5 ARGS` of one shape, with no database; the result."""
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([shape]))
    res = CliRunner().invoke(main, ["bench", "--json", "--rep-ms", "5", *args, "--shapes",
                                    str(shapes), "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 0, res.output
    return res


def test_skip_measured_finishes_a_cut_bench_and_merges_into_one(tmp_path: Path) -> None:
    """--skip-measured leaves out the shapes a document of this device measured; merged
    with it, the result is one bench of the whole set, each shape once."""
    from flashtune.cli.bench import merge_parts

    first = tmp_path / "first.json"
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                    "--shapes", _shapes(tmp_path),
                                    "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 0, res.output
    # As a part a time limit cut after its first shape of two.
    first.write_text(json.dumps({**json.loads(res.stdout), "interrupted": True,
                                 "shapes": {"measured": 1, "total": 2}}))
    both = tmp_path / "both.json"
    both.write_text(json.dumps(TINY + [dict(TINY[0], seqlen=48)]))
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                    "--shapes", str(both), "--skip-measured", str(first),
                                    "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 0, res.output
    rest = json.loads(res.stdout)
    assert {r["problem"]["seqlen_q"] for r in rest["rows"]} == {48}
    assert rest["shapes"] == {"measured": 1, "total": 1, "skipped": 1}
    merged = merge_parts([json.loads(first.read_text()), rest])
    assert [r["problem"]["seqlen_q"] for r in merged["rows"] if r["timing"] == "fwd"] == [64, 48]
    assert merged["shapes"] == {"measured": 2, "total": 2} and merged["interrupted"] is False
    cut = merge_parts([json.loads(first.read_text())])
    assert cut["shapes"] == {"measured": 1, "total": 2} and cut["interrupted"] is True


def test_skip_measured_refuses_another_device_garbage_and_an_empty_rest(
        tmp_path: Path) -> None:
    doc = tmp_path / "doc.json"
    res = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--rep-ms", "1",
                                    "--shapes", _shapes(tmp_path),
                                    "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 0, res.output
    doc.write_text(res.stdout)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(res.stdout), "device": {"name": "NVIDIA H200"}}))
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"rows": [{"shape": 1}]}')
    base = ["bench", "--interpret", "--json", "--rep-ms", "1", "--shapes", _shapes(tmp_path),
            "--db", str(tmp_path / "none.db"), "--skip-measured"]
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({**json.loads(res.stdout), "interpreter": False}))
    for path, says in ((other, "was measured on NVIDIA H200, this bench runs on cpu"),
                       (gpu, "measured without Triton's interpreter, this bench runs under"),
                       (garbage, "not an `autotune bench --json` document (rows[0].shape"),
                       (doc, "the documents measured all 1 shapes of the set")):
        res = CliRunner().invoke(main, [*base, str(path)])
        assert res.exit_code == 2 and says in res.stderr, res.output
        assert "Traceback" not in res.output and res.stdout == ""
