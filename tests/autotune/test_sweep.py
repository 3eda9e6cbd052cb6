"""Sweep workers: whole sweeps through the real tuner (SQLite file and PostgreSQL).
The board itself is tested in tests/db/test_claims.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flashtune.db.claims import Board, tasks_for
from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo
from flashtune.problem import Problem

DEV = DeviceInfo(name="test-gpu", capability="9.0", sm_count=132, memory_gb=141)
SW = SoftwareInfo(torch="t", triton="tr", cuda="c", kernels_hash="h")
ROOT = Path(__file__).resolve().parents[2]


def _problems(n: int) -> list[Problem]:
    # Distinct buckets: seqlen_q and seqlen_k step through powers of two.
    return [Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64 << (i % 10),
                    seqlen_k=64 << (i // 10), head_dim=32, dtype="fp16") for i in range(n)]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'sweep.db'}"
        return
    import sqlalchemy as sa

    base = os.environ["FLASHTUNE_TEST_PG_URL"]
    name = f"ft_sweep_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(base).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as c:
        c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def _tiny(n: int) -> list[Problem]:
    return [Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=32 << i, seqlen_k=32 << i,
                    head_dim=32, dtype="fp16", causal=bool(i % 2)) for i in range(n)]


def test_worker_processes_fill_one_sweep_with_the_tuner(db_url: str) -> None:
    """Two worker processes tune a sweep together through the real tuner: every task is
    tuned once, its result is in the results table, and a rerun finds nothing to do."""
    from flashtune.autotune.sweep import Options, run_worker
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info, software_info

    dev, sw = device_info(), software_info()
    tasks = tasks_for(_tiny(1), ["fwd", "bwd"])
    with Board(db_url) as b:
        sid = b.create(dev, sw, tasks, 2)
    spec = json.dumps({"sweep_id": sid, "label": "t",
                       "options": {"db_url": db_url, "trials": 2, "poll_s": 0.2}})
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "flashtune.autotune.sweep", spec], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    did = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    with Board(db_url) as b:
        notes = [(t.state, (t.note or "")[:300]) for t in b.tasks(sid)]
    assert sum(d["done"] for d in did) == len(tasks), (did, notes)
    assert sum(d["failed"] for d in did) == 0, (did, notes)
    with Board(db_url) as b:
        rows = b.tasks(sid)
        assert {t.state for t in rows} == {"done"}
        assert all(t.attempts == 1 and t.trials == 2 and t.best_tflops > 0 for t in rows)
        assert len({t.worker for t in rows}) >= 1
        # Rerun: nothing left to claim, nothing tuned again.
        assert run_worker(b, sid, Options(db_url=db_url, trials=2)) == \
            {"done": 0, "failed": 0, "cached": 0}
    with open_storage(db_url, read_only=True) as st:
        stored = {r.key for r in st.results(include_stale=False)}
    assert {k for k, _ in tasks} <= stored


def test_the_first_task_finds_the_processes_started(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep starts its measurement worker before the first task's tune (whose time
    budget would otherwise pay the start-up), once, and not for a task already tuned."""
    import flashtune.autotune.sweep as sweep_mod
    from flashtune.autotune.sweep import Options, run_worker
    from flashtune.db.fingerprint import device_info, software_info

    db_url = f"sqlite:///{tmp_path / 'sweep.db'}"
    seen: list[tuple[bool, int]] = []
    real = sweep_mod.tune_task

    def spy(task, opts, storage, session, progress):  # type: ignore[no-untyped-def]
        seen.append((session.worker.proc is not None, session.worker.starts))
        return real(task, opts, storage, session, progress)

    monkeypatch.setattr(sweep_mod, "tune_task", spy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with Board(db_url) as b:
        sid = b.create(device_info(), software_info(), tasks_for(_tiny(2), ["fwd"]), 2)
        assert run_worker(b, sid, Options(db_url=db_url, trials=2)) == \
            {"done": 2, "failed": 0, "cached": 0}
    assert seen == [(True, 1), (True, 1)]


def _lose_a_sigterm() -> None:
    """Deliver SIGTERM to this process where its KeyboardInterrupt is lost, as Python loses
    one raised inside a weakref callback or ``__del__`` ("Exception ignored")."""
    import signal

    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the next bytecode boundary
            pass
    except KeyboardInterrupt:
        return
    raise AssertionError("the SIGTERM handler did not run")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_an_interrupt_lost_in_a_weakref_callback_prints_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Python reports an exception raised in a weakref callback to sys.unraisablehook,
    whose default prints "Exception ignored" and a traceback (a CI run of a Ctrl-C'd sweep
    showed one). The sweep's handlers keep their own interrupt from it, pass anything
    else on, and check_interrupted still raises it; restore() puts the hook back."""
    import signal
    import weakref

    from flashtune.autotune.sweep import check_interrupted, interrupt_on_sigterm

    seen: list[type] = []

    def recording(u):  # type: ignore[no-untyped-def]
        seen.append(u.exc_type)

    monkeypatch.setattr(sys, "unraisablehook", recording)

    class Obj:
        pass

    def interrupted_in(ref: object) -> None:  # the handler, run inside the callback
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # type: ignore[operator]

    def failing(ref: object) -> None:
        raise ValueError("a callback's own error")

    restore = interrupt_on_sigterm()
    try:
        for callback in (interrupted_in, failing):
            obj = Obj()
            r = weakref.ref(obj, callback)
            del obj  # the callback runs here, and its exception goes to the hook
            assert r() is None
        with pytest.raises(KeyboardInterrupt):
            check_interrupted()
    finally:
        restore()
    assert seen == [ValueError]
    assert sys.unraisablehook is recording


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("when", ["before the first task", "during a trial"])
def test_a_lost_interrupt_still_stops_the_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                when: str) -> None:
    """A SIGTERM whose KeyboardInterrupt was swallowed stops the worker at its next task or
    tuner event (the task in hand goes back to pending, no later task starts); once the
    handlers are restored, the same process sweeps normally again."""
    import flashtune.autotune.sweep as sweep_mod
    from flashtune.autotune.sweep import Options, interrupt_on_sigterm, run_worker
    from flashtune.db.fingerprint import device_info, software_info

    db_url = f"sqlite:///{tmp_path / 'sweep.db'}"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    started: list[str] = []
    events: list[str] = []
    real = sweep_mod.tune_task

    def losing(task, opts, storage, session, progress):  # type: ignore[no-untyped-def]
        started.append(task.key.short())

        def progress_losing(ev: dict) -> None:  # type: ignore[type-arg]
            events.append(ev.get("event", ""))
            if ev.get("event") == "trial" and len(events) < 50:
                _lose_a_sigterm()
            progress(ev)
        return real(task, opts, storage, session, progress_losing)

    monkeypatch.setattr(sweep_mod, "tune_task", losing)
    with Board(db_url) as b:
        sid = b.create(device_info(), software_info(), tasks_for(_tiny(2), ["fwd"]), 2)
        restore = interrupt_on_sigterm()
        try:
            if when == "before the first task":
                _lose_a_sigterm()
            with pytest.raises(KeyboardInterrupt):
                run_worker(b, sid, Options(db_url=db_url, trials=3))
        finally:
            restore()
        assert sorted(t.state for t in b.tasks(sid)) == ["pending", "pending"]
        if when == "before the first task":
            assert started == []
        else:  # stopped at the first trial's event, in the first task
            assert len(started) == 1 and events.count("trial") == 1, (started, events)
        monkeypatch.setattr(sweep_mod, "tune_task", real)
        assert run_worker(b, sid, Options(db_url=db_url, trials=2)) == \
            {"done": 2, "failed": 0, "cached": 0}
