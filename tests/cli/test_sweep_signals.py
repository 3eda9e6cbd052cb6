"""A real `autotune sweep` process, stopped by SIGTERM (what Slurm and Kubernetes send) or by a
SIGINT to the main process alone (``kill -INT``), then rerun.

No traceback, the documented exit status (143 / 130), the task in hand back to pending, and
a rerun finishes it. The sweeps run without TRITON_INTERPRET in their environment: ``--interpret``
alone must do. No database password reaches a worker's argv.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flashtune.autotune._faults import fault_env

SHAPE = {"batch": 1, "heads": 2, "seqlen": 32,
         "head_dim": 32, "dtype": "fp16"}


def _sweep(db: Path, shapes: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(fault_env(({}, "slow")))  # every trial sleeps 1 s: the signal lands mid-task
    return subprocess.Popen(
        [sys.executable, "-c", "from flashtune.cli import main; main()", "sweep",
         "--interpret", "--shapes", str(shapes), "--direction", "fwd", "--trials", "2",
         "--db", str(db), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        # A background shell starts children with SIGINT ignored; restore the default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _states(db: Path) -> list[str]:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
            return [r[0] for r in c.execute("SELECT state FROM ft_sweep_claims")]
    except sqlite3.Error:
        return []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("sig, gpus, status", [
    (signal.SIGTERM, ("--gpus", "0"), 143),  # main process and a worker process
    (signal.SIGINT, (), 130),  # `kill -INT` of the main process alone, worker in-process
])
def test_signal_releases_the_task_and_a_rerun_finishes(tmp_path: Path, sig: int,
                                                       gpus: tuple[str, ...],
                                                       status: int) -> None:
    db, shapes = tmp_path / "t.db", tmp_path / "shapes.json"
    shapes.write_text(json.dumps([SHAPE]))
    p = _sweep(db, shapes, *gpus)
    deadline = time.monotonic() + 120
    while _states(db) != ["running"]:
        assert p.poll() is None, p.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, "the sweep never started its task"
        time.sleep(0.2)
    time.sleep(1.0)  # into the search
    p.send_signal(sig)
    out = p.communicate(timeout=90)[0].decode()
    assert p.returncode == status, out[-3000:]
    assert "Traceback" not in out and "Error" not in out.replace("interrupted", ""), out
    assert "run the same command again to resume" in out
    assert _states(db) == ["pending"]

    again = _sweep(db, shapes, *gpus)
    out2 = again.communicate(timeout=240)[0].decode()
    assert again.returncode == 0, out2[-3000:]
    assert _states(db) == ["done"] and "Traceback" not in out2


def test_worker_argv_carries_no_database_password(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from flashtune.autotune.sweep import Options
    from flashtune.cli import sweep as cli_sweep

    seen: list[Any] = []

    class FakePopen:
        def __init__(self, argv: list[str], **kw: Any) -> None:
            seen.append((argv, kw.get("env", {})))
            self.stdin = open(tmp_path / "stdin", "wb")  # noqa: SIM115 - closed by the caller

    monkeypatch.setattr(cli_sweep.subprocess, "Popen", FakePopen)
    opts = Options(db_url="postgresql+psycopg://flash:s3cr3t-pw@db.example/tune", trials=1)
    procs: list[Any] = []
    cli_sweep._spawn_workers(["0", "1"], "sid", opts, True, tmp_path, procs)
    assert len(seen) == 2 and len(procs) == 2
    for argv, env in seen:
        assert not any("s3cr3t-pw" in a for a in argv), argv
        assert not any("s3cr3t-pw" in v for v in env.values())
    assert "s3cr3t-pw" in (tmp_path / "stdin").read_text()  # the spec went through stdin


def test_tune_output_masks_the_database_password(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from flashtune.cli import main, tune

    class Result:
        storage_url = "postgresql+psycopg://flash:s3cr3t-pw@db.example/tune"

        def as_dict(self) -> dict[str, Any]:
            return {"storage_url": self.storage_url}

    monkeypatch.setattr("flashtune.autotune.tune", lambda *a, **kw: Result())
    r = CliRunner().invoke(main, ["tune", "--interpret", "--batch", "1", "--heads", "1",
                                  "--seqlen", "16", "--head-dim", "16", "--direction", "fwd",
                                  "--json", "--db", Result.storage_url])
    assert r.exit_code == 0, r.output
    assert "s3cr3t-pw" not in r.output and "***" in r.output
    assert tune  # the module under test


def test_a_database_deleted_under_a_running_sweep_fails_it_loudly(tmp_path: Path) -> None:
    """SQLite would write on into the unlinked file and exit 0 with every result lost."""
    db, shapes = tmp_path / "t.db", tmp_path / "shapes.json"
    shapes.write_text(json.dumps([SHAPE, {**SHAPE, "seqlen": 256}]))
    p = _sweep(db, shapes)
    deadline = time.monotonic() + 120
    while "running" not in _states(db):
        assert p.poll() is None, p.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, "the sweep never started a task"
        time.sleep(0.2)
    for f in tmp_path.glob("t.db*"):
        f.unlink()
    out = p.communicate(timeout=120)[0].decode()
    assert p.returncode == 1, out[-3000:]
    assert "deleted or replaced while in use" in out and "Traceback" not in out, out[-3000:]
    assert not db.exists()


def test_a_ctrl_c_before_a_command_handles_it_exits_130_not_aborted() -> None:
    """click reports a KeyboardInterrupt as "Aborted!" with status 1; the group makes it
    130, the status a sweep gives after its own handling (a Ctrl-C while it imports)."""
    import click
    from click.testing import CliRunner

    from flashtune.cli import main

    @click.command("interrupted-early")
    def early() -> None:
        raise KeyboardInterrupt

    main.add_command(early)
    try:
        res = CliRunner().invoke(main, ["interrupted-early"])
    finally:
        main.commands.pop("interrupted-early")
    assert res.exit_code == 130, (res.exception, res.output)
    assert "interrupted" in res.stderr and "Aborted" not in res.output
