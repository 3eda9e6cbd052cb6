"""`autotune export`, `autotune import` and `autotune show`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashtune.cli import main
from flashtune.db import open_storage, software_info
from flashtune.db.exchange import export_json
from tests.db import _data
from tests.db._data import A100, H200, OLD_SW


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    """A database holding fresh results (current software) and stale ones."""
    db = tmp_path / "a.db"
    with open_storage(str(db)) as s:
        s.put_results(_data.results(51, 12, devices=(H200, A100),
                                    software=(software_info(), OLD_SW)))
    return db


def run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), \
        r.exception
    return r.exit_code, r.stdout, r.stderr


def test_export_import_round_trip(filled: Path, tmp_path: Path) -> None:
    out, copy = tmp_path / "x" / "export.json", tmp_path / "b.db"
    code, _, err = run("export", str(out), "--db", str(filled))
    assert code == 0 and "exported 12 entries" in err
    code, stdout, _ = run("import", str(out), "--db", str(copy))
    assert code == 0 and "12 added, 0 replaced, 0 kept" in stdout
    code, again, _ = run("export", "-", "--db", str(copy))
    assert code == 0 and again.encode() == out.read_bytes()
    code, stdout, _ = run("import", str(out), "--db", str(copy), "--prefer", "theirs")
    assert "0 added, 12 replaced" in stdout


def test_export_filters_by_device(filled: Path) -> None:
    code, stdout, _ = run("export", "-", "--db", str(filled), "--device", "a100")
    names = {e["device"]["name"] for e in json.loads(stdout)["entries"]}
    assert code == 0 and names == {A100.name}


def test_export_fresh_leaves_out_stale_results(filled: Path) -> None:
    with open_storage(str(filled)) as s:
        rs = s.results()
    code, stdout, _ = run("export", "-", "--db", str(filled), "--fresh")
    entries = json.loads(stdout)["entries"]
    assert code == 0 and len(entries) == sum(not r.stale for r in rs) < len(rs)
    sw = software_info()
    # each under its direction's hash (the forward's own sources, or all of them)
    assert {(e["direction"], e["software"]["kernels_hash"], e["software"]["triton"])
            for e in entries} == {(d, sw.for_direction(d).kernels_hash, sw.triton)
                                  for d in {e["direction"] for e in entries}}
    assert sw.for_direction("fwd").kernels_hash != sw.kernels_hash


def test_show_json_lists_fresh_entries_unless_stale(filled: Path) -> None:
    with open_storage(str(filled)) as s:
        rs = s.results()
    code, stdout, _ = run("show", "--db", str(filled), "--json")
    fresh = json.loads(stdout)
    assert code == 0 and len(fresh) == sum(not r.stale for r in rs) > 0
    for e in fresh:
        assert e["direction"] in ("fwd", "bwd") and e["stale"] is False
        assert {"problem", "config", "device", "median_ms"} <= set(e)
    code, stdout, _ = run("show", "--db", str(filled), "--json", "--stale")
    everything = json.loads(stdout)
    assert len(everything) == 12 and sum(e["stale"] for e in everything) == 12 - len(fresh)


def test_show_table(filled: Path) -> None:
    code, stdout, stderr = run("show", "--db", str(filled))
    assert code == 0 and "NVIDIA" in stdout and "STALE" not in stdout
    assert "12 entries" in stderr and "hidden" in stderr
    assert "STALE" in run("show", "--db", str(filled), "--stale")[1]


def test_flashtune_db_environment_variable(filled: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHTUNE_DB", str(filled))
    code, stdout, _ = run("show", "--json", "--stale")
    assert code == 0 and len(json.loads(stdout)) == 12


def test_bad_import_is_one_line_and_changes_nothing(filled: Path, tmp_path: Path) -> None:
    with open_storage(str(filled)) as s:
        doc = json.loads(export_json(s))
    doc["entries"][2]["num_stages"] = 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    before = filled.read_bytes()
    code, stdout, stderr = run("import", str(bad), "--db", str(filled))
    assert code == 1 and stdout == ""
    assert stderr == f"Error: {bad}: entry 2: field num_stages: unknown field; allowed: " \
                     "config, created_at, device, direction, example, flashtune_version, " \
                     "host, max_error, median_ms, p20_ms, p80_ms, problem, search_seconds, " \
                     "software, tflops, trials\n"
    assert filled.read_bytes() == before


@pytest.mark.parametrize("args, message", [
    (["show", "--db", "{tmp}/missing.db"], "no such database"),
    (["show", "--db", "{tmp}/garbage.db"], "not a flashtune database"),
    (["import", "{tmp}/missing.json", "--db", "{tmp}/n.db"], "No such file"),
    (["export", "-", "--db", "nosuchdialect://x"], "cannot use this URL"),
])
def test_errors_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "garbage.db").write_bytes(b"garbage" * 1000)
    code, _, stderr = run(*(a.format(tmp=tmp_path) for a in args))
    assert code == 1 and message in stderr and stderr.count("\n") == 1


def test_real_process_prints_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"format": "flashtune-tuning-db", "format_version": 7, "entries": []}')
    p = subprocess.run([sys.executable, "-c", "from flashtune.cli import main; main()",
                        "import", str(bad), "--db", str(tmp_path / "t.db")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr == f"Error: {bad}: field format_version: 7 is not supported; allowed: 1\n"
    assert not (tmp_path / "t.db").exists()  # rejected before the database was touched
