"""Many writers at once, and writers killed with SIGKILL mid-transaction."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import random
import signal
import sqlite3
import time
from typing import Any

import pytest

from flashtune.db import DeviceInfo, open_storage
from tests.db import _data
from tests.db._data import SW, key
from tests.db.conftest import FILE_BACKENDS

WRITERS = 8
PER_WRITER = 200
_fork = mp.get_context("fork")  # children inherit the imports: no second torch import


def writer_device(w: int) -> DeviceInfo:
    return DeviceInfo(name=f"GPU {w}", capability="9.0", sm_count=132, memory_gb=140)


def keys(n: int) -> list[_data.ProblemKey]:
    # Distinct keys, the same for every writer: the problem rows are created racing.
    return [key("fwd" if i % 2 else "bwd", sq_bucket=2 ** (i // 2 % 20),
                sk_bucket=2 ** (i // 40 % 20), bh_bucket=2 ** (i // 800)) for i in range(n)]


def _write(url: str, w: int, start: Any) -> None:
    storage = open_storage(url)  # every writer may also be the one that creates the schema
    start.wait(60)
    for i, k in enumerate(keys(PER_WRITER)):
        storage.put_result(writer_device(w), SW, k, {"maxnreg": 128}, median_ms=1.0 + i,
                           p20_ms=1.0 + i, p80_ms=2.0 + i, tflops=float(w), max_error=0.0,
                           trials=w, search_seconds=0.0)
    storage.close()


@pytest.mark.parametrize("db_url", FILE_BACKENDS, indirect=True)
def test_concurrent_writers_lose_nothing(db_url: str) -> None:
    start = _fork.Barrier(WRITERS)
    procs = [_fork.Process(target=_write, args=(db_url, w, start)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    with open_storage(db_url, read_only=True) as s:
        rows = s.results(software=SW)
        assert len(rows) == WRITERS * PER_WRITER
        for w in range(WRITERS):
            mine = s.load_table(writer_device(w), SW)
            assert set(mine) == set(keys(PER_WRITER))
            assert all(r.trials == w and r.tflops == w for r in mine.values())
        assert s.counts()["entries"] == WRITERS * PER_WRITER


def _die_mid_transaction(url: str, committed: Any, ready: Any) -> None:
    storage = open_storage(url)
    rs = _data.results(31, 340)
    for r in rs[:40]:
        storage.put_results([r])
        committed.value += 1
    with storage._session(write=True) as session:  # the storage's own write scope
        for r in rs[40:]:
            storage._put(session, r, "faster")  # type: ignore[attr-defined]
        session.flush()
        ready.set()
        time.sleep(120)  # killed here, the transaction open and its rows written


def _write_until_killed(url: str, committed: Any, ready: Any) -> None:
    storage = open_storage(url)
    template = _data.results(32, 1)[0]
    for i, k in enumerate(keys(16000)):
        cfg = _data.config(random.Random(i), k.direction)
        storage.put_results([dataclasses.replace(template, key=k, problem=None, config=cfg)])
        committed.value += 1
        if i == 30:
            ready.set()


def _check_after_kill(url: str, low: int, high: int) -> None:
    with open_storage(url) as s:  # opens read-write: the lock is gone
        n = len(s.results())
        assert low <= n <= high, (low, n, high)
        assert s.put_results(_data.results(33, 1, devices=(writer_device(99),))) == ["added"]
    if not url.startswith("postgresql"):
        with sqlite3.connect(url) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.parametrize("db_url", FILE_BACKENDS, indirect=True)
@pytest.mark.parametrize("victim", [_die_mid_transaction, _write_until_killed])
def test_killed_writer_leaves_every_committed_row(db_url: str, victim: Any) -> None:
    open_storage(db_url).close()
    # Without a lock: the writer is killed at any instant, and a Value's lock that the kill
    # caught held would hang this process's read of it for ever (seen in CI).
    committed, ready = _fork.Value("i", 0, lock=False), _fork.Event()
    p = _fork.Process(target=victim, args=(db_url, committed, ready))
    p.start()
    assert ready.wait(60), "the writer never got going"
    if victim is _write_until_killed:
        time.sleep(0.3)
    assert p.pid is not None
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL
    n = committed.value
    # A commit may land between the last counter update and the kill, never more.
    _check_after_kill(db_url, n, n + (victim is _write_until_killed))




def _backend_pid(storage: Any) -> int:
    with storage.engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())


def _use_inherited(storage: Any, parent_pid: int) -> None:
    assert _backend_pid(storage) != parent_pid, "the child reused the parent's connection"
    assert storage.put_results(_data.results(35, 3, devices=(writer_device(7),))) == ["added"] * 3


@pytest.mark.postgres
def test_forked_child_does_not_share_connections(pg_url: str) -> None:
    storage = open_storage(pg_url)
    storage.put_results(_data.results(34, 2))
    parent = _backend_pid(storage)  # that connection now waits, idle, in the pool
    p = _fork.Process(target=_use_inherited, args=(storage, parent))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert _backend_pid(storage) == parent  # the parent's own connection still works
    assert len(storage.results()) == 5
    storage.close()
