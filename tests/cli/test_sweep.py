"""`autotune sweep`: shape sets, presets, resume, --from-misses, --gpus workers, errors.

Kernels run under Triton's CPU interpreter on tiny problems with the real tuner and a
real database (SQLite files; PostgreSQL where FLASHTUNE_TEST_PG_URL is set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashtune.autotune.presets import MODELS, PRESETS, load_shapes, preset
from flashtune.cli import main
from flashtune.db.claims import Board
from flashtune.problem import Problem

ROOT = Path(__file__).resolve().parents[1]
TINY = {"batch": 1, "heads": 2, "seqlen": 64, "head_dim": 32, "dtype": "fp16"}


def _shapes(tmp_path: Path, shapes: list[dict], name: str = "shapes.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(shapes))
    return str(path)


def _sweep(*args: str) -> tuple[int, dict, str]:
    res = CliRunner().invoke(main, ["sweep", "--interpret", "--json", *args])
    out = json.loads(res.stdout) if res.stdout.strip().startswith("{") else {}
    return res.exit_code, out, res.stderr


# ------------------------------------------------------------------------ shape sets


def test_presets_expand_from_model_configs() -> None:
    assert set(PRESETS) >= {"standard", "llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b",
                            "gpt2"}
    from flashtune.timing import standard_matrix

    assert preset("standard") == standard_matrix()
    l70 = preset("llama3-70b")
    assert {(p.heads_q, p.heads_kv, p.head_dim) for p in l70} == {(64, 8, 128)}
    assert all(p.causal and p.dtype == "bf16" and p.batch * p.seqlen_q == 16384 for p in l70)
    qwen = preset("qwen2.5-7b")[0]
    assert (qwen.heads_q, qwen.heads_kv, qwen.gqa_ratio) == (28, 4, 7)
    gpt2 = preset("gpt2")
    assert [p.seqlen_q for p in gpt2] == [256, 512, 1024] and gpt2[0].head_dim == 64
    # Mistral's 4096-token sliding window applies only where the sequence is longer.
    mis = {p.seqlen_q: p.window for p in preset("mistral-7b")}
    assert mis[4096] == (-1, -1) and mis[8192] == (4095, 0)
    assert MODELS["llama3-8b"].kv_heads == 8


def test_packed_preset_and_shape() -> None:
    first = preset("llama3-8b-packed")[0]
    assert first.packed and (first.batch, first.seqlen_q, first.total_q) == (64, 8192, 65536)
    lq, lk = first.packed_lengths()
    assert lq == lk and len(lq) == 64 and max(lq) == 8192 and sum(lq) == 65536
    p = load_shape_dicts([{"batch": 3, "heads": 4, "seqlen": 50, "tokens": 101}])[0]
    assert p.packed and (p.total_q, p.total_k) == (101, 101)
    assert p.packed_lengths() == ([50, 26, 25], [50, 26, 25])
    with pytest.raises(ValueError, match="tokens .* from seqlen to batch \\* seqlen, got 200"):
        load_shape_dicts([{"batch": 3, "seqlen": 50, "tokens": 200}])


def load_shape_dicts(shapes: list[dict]) -> list[Problem]:
    from flashtune.autotune.presets import shape_problem

    return [shape_problem(d) for d in shapes]


def test_shapes_file_yaml_defaults_and_window(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("- {heads: 8, kv_heads: 2, seqlen: 1000, causal: true, window: 128}\n"
                    "- {batch: 2, seqlen: 97, seqlen_k: 130, head_dim: 80, dtype: fp16,"
                    " softcap: 30, window: [16, 8]}\n")
    a, b = load_shapes(path)
    assert a == Problem(batch=1, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000,
                        head_dim=128, dtype="bf16", causal=True, window=(128, 0))
    assert (b.heads_q, b.heads_kv, b.seqlen_k, b.window, b.softcap) == (16, 16, 130, (16, 8), 30.0)


@pytest.mark.parametrize("bad, needle", [
    ([{"heads": 2, "seqlenq": 5}], "unknown key(s) seqlenq"),
    ([{"dtype": "fp32"}], "dtype must be one of fp16, bf16"),
    ([{"heads": 6, "kv_heads": 4}], "multiple of heads_kv=4"),
    ({"not": "a list"}, "non-empty list"),
])
def test_bad_shapes_file_is_one_clean_line(tmp_path: Path, bad, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    res = CliRunner().invoke(main, ["sweep", "--interpret", "--shapes", str(path),
                                    "--db", str(tmp_path / "t.db")])
    assert res.exit_code == 1
    assert needle in res.stderr and "Traceback" not in res.output
    assert len(res.stderr.strip().splitlines()) == 1


def test_several_presets_joined_by_commas() -> None:
    from flashtune.cli._common import shape_set

    title, got = shape_set("gpt2,standard,gpt2", None, False, None)
    want = preset("gpt2") + [p for p in preset("standard") if p not in preset("gpt2")]
    assert title == "preset gpt2,standard,gpt2" and got == want
    assert len(got) == len(set(got)) < len(preset("gpt2")) * 2 + len(preset("standard"))
    for bad, name in (("gpt2,llama5", "'llama5'"), ("gpt2,", "''"), (",", "''")):
        res = CliRunner().invoke(main, ["sweep", "--interpret", "--preset", bad])
        assert res.exit_code == 2 and f"{name} is not a preset" in res.stderr, res.stderr
        assert "Traceback" not in res.output


def test_two_shape_sets_at_once_is_a_usage_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["sweep", "--interpret", "--preset", "gpt2",
                                    "--shapes", _shapes(tmp_path, [TINY])])
    assert res.exit_code == 2 and "choose one shape set" in res.stderr


def test_no_gpu_without_interpret_is_a_one_line_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for cmd in ("sweep", "bench"):
        proc = subprocess.run([sys.executable, "-m", "flashtune.cli", cmd, "--preset", "tiny",
                               "--db", str(tmp_path / "t.db")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        if "no CUDA GPU" not in proc.stderr:
            pytest.skip("this machine has a GPU")
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "--interpret" in lines[0] and "GPU" in lines[0]
        assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- sweeps


def test_sweep_tunes_then_a_rerun_skips_and_more_trials_resume(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    shapes = _shapes(tmp_path, [TINY, {**TINY, "seqlen": 60}])  # one bucket: one task
    code, out, err = _sweep("--shapes", shapes, "--direction", "fwd", "--trials", "2",
                            "--db", db)
    assert code == 0, err
    assert out["counts"] == {"done": 1, "failed": 0, "pending": 0, "running": 0}
    (task,) = out["tasks"]
    assert task["trials"] == 2 and task["tflops"] > 0 and task["attempts"] == 1
    assert out["interpreter"] is True

    # Rerun: same sweep, nothing claimed or tuned again.
    code, again, err = _sweep("--shapes", shapes, "--direction", "fwd", "--trials", "2",
                              "--db", db)
    assert code == 0 and again["sweep_id"] == out["sweep_id"]
    assert again["tasks"][0]["attempts"] == 1

    # More trials: a new sweep whose task continues the stored study (2 -> 3 trials).
    code, more, err = _sweep("--shapes", shapes, "--direction", "fwd", "--trials", "3",
                             "--db", db)
    assert code == 0, err
    assert more["sweep_id"] != out["sweep_id"] and more["tasks"][0]["trials"] == 3

    import optuna

    # One study, continued: 3 measured trials in all, not 2 + 3.
    (study,) = optuna.get_all_study_summaries(f"sqlite:///{db}")
    trials = optuna.load_study(study_name=study.study_name,
                               storage=f"sqlite:///{db}").get_trials(deepcopy=False)
    assert sum(bool(t.user_attrs.get("measured")) for t in trials) == 3


def test_sweep_human_output_lines_and_summary(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["sweep", "--interpret", "--shapes",
                                    _shapes(tmp_path, [TINY]), "--direction", "bwd",
                                    "--trials", "2", "--db", str(tmp_path / "t.db")])
    assert res.exit_code == 0, res.output
    assert "[1/1] done bwd fp16 d32 full g1 bh2 sq64 sk64" in res.stderr
    assert "sweep summary" in res.stdout and "TFLOP/s (interpreter)" in res.stdout
    assert "1 done, 0 failed" in res.stderr


def test_sweep_resumes_a_task_left_running_by_a_dead_worker(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    shapes = _shapes(tmp_path, [TINY])
    args = ["--shapes", shapes, "--direction", "fwd", "--trials", "2", "--db", db]
    # A worker process claims the task and dies without settling it.
    code = ("import sys\nfrom click.testing import CliRunner\n"
            "from flashtune.db.claims import Board\n"
            "from flashtune.db import resolve_url\n"
            "b = Board(resolve_url(sys.argv[1]))\n"
            "sid = b.sweep_ids()[0]\n"
            "assert b.claim(sid, 'doomed', lease_s=3600) is not None\n")
    with Board(f"sqlite:///{db}") as b:  # register the sweep without running it
        from flashtune.db.claims import tasks_for
        from flashtune.db.fingerprint import device_info, software_info

        b.create(device_info(), software_info(),
                 tasks_for(load_shapes(shapes), ["fwd"]), 2)
    proc = subprocess.run([sys.executable, "-c", code, db], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    res = CliRunner().invoke(main, ["sweep", "--interpret", *args])
    assert res.exit_code == 0, res.output
    assert "freed 1 task(s) of dead local workers" in res.stderr
    with Board(f"sqlite:///{db}") as b:
        (t,) = b.tasks(b.sweep_ids()[0])
    assert t.state == "done" and t.attempts == 2 and t.worker != "doomed"


def test_sweep_from_misses(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    res = CliRunner().invoke(main, ["sweep", "--interpret", "--from-misses", "--db", db])
    assert res.exit_code == 1 and "no recorded dispatcher misses" in res.stderr
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info, software_info

    p = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=50, seqlen_k=50, head_dim=32,
                dtype="fp16", causal=True)
    with open_storage(db) as st:
        st.record_misses(device_info(), software_info(), {p.key("fwd"): (3, p)})
    code, out, err = _sweep("--from-misses", "--direction", "fwd", "--trials", "2", "--db", db)
    assert code == 0, err
    (task,) = out["tasks"]
    assert task["problem"]["seqlen_q"] == 50 and task["state"] == "done"


def test_gpus_runs_one_worker_process_per_gpu(tmp_path: Path) -> None:
    """--gpus 0,1 (under the interpreter: two CPU worker processes) on one SQLite file."""
    db = str(tmp_path / "t.db")
    shapes = _shapes(tmp_path, [TINY, {**TINY, "causal": True}])
    code, out, err = _sweep("--shapes", shapes, "--direction", "fwd", "--trials", "2",
                            "--gpus", "0,1", "--db", db)
    assert code == 0, err
    assert out["counts"]["done"] == 2
    labels = {t["worker"].rsplit(":", 1)[-1] for t in out["tasks"]}
    assert labels <= {"gpu0", "gpu1"} and labels
    assert all(t["attempts"] == 1 for t in out["tasks"])


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_sigterm_while_the_gpu_workers_start_stops_every_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM sent the moment the first worker process exists (as Kubernetes sends it, to
    the main process alone): it is handled once both are started and listed, both are
    stopped, and no task is left running; none tunes on unseen."""
    import signal

    from flashtune.cli import sweep as cli_sweep

    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(cmd, *args, **kw):  # type: ignore[no-untyped-def]
        p = real_popen(cmd, *args, **kw)
        if "flashtune.autotune.sweep" in cmd:  # (the fingerprint runs ptxas through Popen)
            started.append(p)
            if len(started) == 1:
                os.kill(os.getpid(), signal.SIGTERM)
        return p

    class Stray(Exception):
        pass

    def stray(signum, frame):  # type: ignore[no-untyped-def]
        raise Stray  # only if the sweep's own handler was not in place

    monkeypatch.setattr(cli_sweep.subprocess, "Popen", popen)
    old = signal.signal(signal.SIGTERM, stray)
    db = str(tmp_path / "t.db")
    try:
        res = CliRunner().invoke(main, [
            "sweep", "--interpret", "--shapes", _shapes(tmp_path, [TINY, {**TINY, "causal": True}]),
            "--direction", "fwd", "--trials", "200", "--gpus", "0,1", "--db", db])
        alive = [p for p in started if p.poll() is None]
    finally:
        signal.signal(signal.SIGTERM, old)
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert res.exit_code == 143, (res.exception, res.stderr[-2000:])
    assert len(started) == 2 and not alive, "a worker went on after the sweep exited"
    # Each got the SIGINT passed on, held while it started until its handlers were in
    # (not a fatal error in Python's start-up): 130, no task kept.
    assert [p.returncode for p in started] == [130, 130], [p.returncode for p in started]
    with Board(f"sqlite:///{db}") as b:
        (sid,) = b.sweep_ids()
        assert {t.state for t in b.tasks(sid)} == {"pending"}


def test_bad_gpus_option(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["sweep", "--interpret", "--gpus", "0,x",
                                    "--db", str(tmp_path / "t.db")])
    assert res.exit_code == 2 and "--gpus" in res.stderr


@pytest.fixture
def pg_url():
    import sqlalchemy as sa

    base = os.environ["FLASHTUNE_TEST_PG_URL"]
    name = f"ft_cli_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    yield sa.engine.make_url(base).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as c:
        c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.mark.postgres
def test_two_hosts_share_one_postgres_sweep(pg_url: str, tmp_path: Path) -> None:
    """Two independent `autotune sweep` processes (as on two hosts) given the same shape set
    and PostgreSQL --db fill one sweep: every task tuned exactly once."""
    shapes = _shapes(tmp_path, [TINY, {**TINY, "causal": True}])
    cmd = [sys.executable, "-m", "flashtune.cli", "sweep", "--interpret", "--json",
           "--shapes", shapes, "--direction", "fwd", "--trials", "2", "--db", pg_url]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-1500:] for _, e in outs]
    a, b = (json.loads(o) for o, _ in outs)
    assert a["sweep_id"] == b["sweep_id"] and a["counts"]["done"] == 2
    assert all(t["attempts"] == 1 for t in a["tasks"])
    from flashtune.db import open_storage

    with open_storage(pg_url, read_only=True) as st:
        assert len(st.results()) == 2


def test_ctrl_c_gives_the_task_back_and_exits_130(tmp_path: Path) -> None:
    import signal
    import time

    db = str(tmp_path / "t.db")
    cmd = [sys.executable, "-m", "flashtune.cli", "sweep", "--interpret", "--shapes",
           _shapes(tmp_path, [TINY]), "--direction", "fwd", "--trials", "200", "--db", db]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 90
        running = False
        while not running and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            if Path(db).exists():
                with Board(f"sqlite:///{db}") as b:
                    ids = b.sweep_ids()
                    running = bool(ids) and b.tasks(ids[0])[0].state == "running"
        assert running, "the sweep never started its task"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-1500:]
    assert "run the same command again to resume" in err and "Traceback" not in err
    with Board(f"sqlite:///{db}") as b:
        (t,) = b.tasks(b.sweep_ids()[0])
    assert t.state == "pending" and t.worker is None


# ------------------------------------------------------------------------ --from-stale


def test_from_stale_retunes_what_an_upgrade_made_stale_from_the_stale_winners(
        tmp_path: Path) -> None:
    import optuna

    from flashtune.db import open_storage
    from flashtune.db.fingerprint import SoftwareInfo, device_info, software_info

    db = str(tmp_path / "tuning.db")
    here, now = device_info(), software_info()
    before = SoftwareInfo(torch=now.torch, triton="3.8.0", cuda=now.cuda,  # an older Triton
                          kernels_hash=now.kernels_hash, ptxas=now.ptxas)
    stale_p = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32,
                      dtype="fp16")
    both_p = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=32, seqlen_k=32, head_dim=32,
                     dtype="fp16")
    winner = {"block_m": 16, "block_n": 32, "num_warps": 2, "num_stages": 1}
    timing = dict(median_ms=2.0, p20_ms=2.0, p80_ms=2.0, max_error=0.0, trials=9,
                  search_seconds=1.0)
    with open_storage(db) as st:
        for p, sw in ((stale_p, before), (both_p, before), (both_p, now)):
            st.put_result(here, sw, p.key("fwd"), winner, problem=p,
                          tflops=p.flops("fwd") / 2e9, **timing)
        # Stale too, but of another device: not this machine's to re-tune.
        from tests.db._data import H200

        st.put_result(H200, before, stale_p.key("bwd"), {}, problem=stale_p,
                      tflops=stale_p.flops("bwd") / 2e9, **timing)
    code, out, err = _sweep("--from-stale", "--direction", "fwd", "--trials", "1", "--db", db)
    assert code == 0, err
    assert [(t["key"]["sq_bucket"], t["state"]) for t in out["tasks"]] == [(64, "done")]
    with open_storage(db) as st:
        got = st.get_result(here, now, stale_p.key("fwd"))
        assert got is not None and got.origin == "local"
        assert {k: got.config[k] for k in winner} == winner  # the one trial: the stale winner
    study = [s for s in optuna.get_all_study_summaries(f"sqlite:///{db}")
             if "fwd" in s.study_name]
    trials = optuna.load_study(study_name=study[0].study_name,
                               storage=f"sqlite:///{db}").trials
    assert trials[0].user_attrs["seed_source"] == "stale"
    # Nothing stale is left: a second run says so and fails.
    code, out, err = _sweep("--from-stale", "--direction", "fwd", "--db", db)
    assert code == 1 and "nothing is stale" in err
    code, _, err = _sweep("--from-stale", "--preset", "tiny", "--db", db)
    assert code == 2 and "--from-stale and --preset" in err


def test_from_stale_takes_the_shipped_layer_an_upgrade_made_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an upgrade the shipped winners of this device are stale too: --from-stale
    re-tunes them into an empty database, each from its shipped winner; keys the shipped
    layer still serves fresh, and other devices' entries, are left alone."""
    from dataclasses import replace

    import optuna

    import flashtune.db.exchange as exchange
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import SoftwareInfo, device_info, software_info
    from tests.db._data import H200

    here, now = device_info(), software_info()
    before = SoftwareInfo(torch=now.torch, triton="3.8.0", cuda=now.cuda,
                          kernels_hash=now.kernels_hash, ptxas=now.ptxas)
    stale_p = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32,
                      dtype="fp16")
    fresh_p = replace(stale_p, seqlen_q=32, seqlen_k=32)
    winner = {"block_m": 16, "block_n": 32, "num_warps": 2, "num_stages": 1}
    timing = dict(median_ms=2.0, p20_ms=2.0, p80_ms=2.0, max_error=0.0, trials=9,
                  search_seconds=1.0)
    with open_storage(tmp_path / "made.db") as st:  # what the package would ship
        for dev, sw, p in ((here, before, stale_p), (here, now, fresh_p), (H200, before, fresh_p)):
            st.put_result(dev, sw, p.key("fwd"), winner, problem=p,
                          tflops=p.flops("fwd") / 2e9, **timing)
        layer = [replace(r, origin="shipped") for r in st.results(software=now)]
    assert sorted(r.stale for r in layer) == [False, True, True]
    monkeypatch.setattr(exchange, "shipped_results", lambda software=None: layer)
    db = str(tmp_path / "empty.db")
    code, out, err = _sweep("--from-stale", "--direction", "fwd", "--trials", "1", "--db", db)
    assert code == 0, err
    assert [(t["key"]["sq_bucket"], t["state"]) for t in out["tasks"]] == [(64, "done")]
    with open_storage(db) as st:
        got = st.get_result(here, now, stale_p.key("fwd"))
        assert got is not None and {k: got.config[k] for k in winner} == winner
    (summary,) = optuna.get_all_study_summaries(f"sqlite:///{db}")
    (trial,) = optuna.load_study(study_name=summary.study_name,
                                 storage=f"sqlite:///{db}").trials
    assert trial.user_attrs["seed_source"] == "stale"
    code, _, err = _sweep("--from-stale", "--direction", "fwd", "--db", db)
    assert code == 1 and "nothing is stale" in err


def test_shapes_and_tune_take_the_backward_kind(tmp_path: Path) -> None:
    from flashtune.db import open_storage

    free = load_shape_dicts([{"deterministic": False, **TINY}])[0]
    assert not free.deterministic and load_shape_dicts([TINY])[0].deterministic
    with pytest.raises(ValueError, match="deterministic must be true or false, got 'no'"):
        load_shape_dicts([{"deterministic": "no"}])
    db = str(tmp_path / "t.db")
    res = CliRunner().invoke(main, [
        "tune", "--interpret", "--db", db, "--batch", "2", "--heads", "2", "--seqlen", "32",
        "--head-dim", "32", "--dtype", "fp16", "--direction", "bwd", "--trials", "1",
        "--no-deterministic", "--tokens", "40", "--quiet", "--json"])
    assert res.exit_code == 0, res.output
    key = json.loads(res.stdout)["bwd"]["key"]
    assert (key["deterministic"], key["packed"], key["tokens_bucket"]) == (False, True, 64)
    with open_storage(db) as st:
        assert [(r.key.deterministic, r.key.packed) for r in st.results()] == [(False, True)]
    bad = CliRunner().invoke(main, ["tune", "--interpret", "--db", db, "--batch", "1",
                                    "--heads", "2", "--seqlen", "32", "--head-dim", "32",
                                    "--tokens", "33"])
    assert bad.exit_code == 2 and "'--tokens'" in bad.output
