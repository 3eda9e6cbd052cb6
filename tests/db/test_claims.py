"""The sweep claims board (flashtune.db.claims): atomic claims across processes, leases,
resume (SQLite file and PostgreSQL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from flashtune.db.claims import Board, sweep_id, tasks_for
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


def test_tasks_dedupe_by_key_and_keep_order() -> None:
    a = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=1000, seqlen_k=1000, head_dim=32)
    b = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=1024, seqlen_k=1024, head_dim=32)
    tasks = tasks_for([a, b], ["fwd", "bwd"])
    assert [k.direction for k, _ in tasks] == ["fwd", "bwd"]  # b buckets like a
    assert all(p is a for _, p in tasks)


def test_sweep_id_is_order_free_and_depends_on_trials() -> None:
    keys = [k for k, _ in tasks_for(_problems(3), ["fwd"])]
    assert sweep_id("d", "s", keys, 5) == sweep_id("d", "s", keys[::-1], 5)
    assert sweep_id("d", "s", keys, 5) != sweep_id("d", "s", keys, 6)
    assert sweep_id("d", "s", keys, 5) != sweep_id("d2", "s", keys, 5)


def test_create_is_idempotent_and_claims_in_order(db_url: str) -> None:
    tasks = tasks_for(_problems(3), ["fwd"])
    with Board(db_url) as b:
        sid = b.create(DEV, SW, tasks, 3)
        assert b.create(DEV, SW, tasks, 3) == sid
        assert len(b.tasks(sid)) == 3
        t1 = b.claim(sid, "w1")
        t2 = b.claim(sid, "w2")
        assert (t1.seq, t2.seq) == (0, 1)
        assert t1.state == "running" and t1.worker == "w1" and t1.attempts == 1
        assert not b.finish(t1.id, "w2", trials=1, best_tflops=1.0, median_ms=1.0)  # not w2's
        assert b.finish(t1.id, "w1", trials=3, best_tflops=2.5, median_ms=0.1)
        assert b.fail(t2.id, "w2", "boom")
        t3 = b.claim(sid, "w1")
        assert t3.seq == 2 and b.release(t3.id, "w1")
        assert b.claim(sid, "w9").seq == 2  # released: pending again
        assert b.claim(sid, "w9") is None  # failed tasks stay failed ...
        again = b.claim(sid, "w9", retry_failed=True)  # ... unless asked
        assert again.seq == 1 and again.attempts == 2
        states = {t.seq: (t.state, t.best_tflops) for t in b.tasks(sid)}
        assert states[0] == ("done", 2.5)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_database_file_deleted_or_replaced_under_a_sweep_stops_it(tmp_path: Path,
                                                                    how: str) -> None:
    from flashtune.db import open_storage
    from flashtune.exceptions import StorageError
    from tests.db._data import results

    path = tmp_path / "sweep.db"
    with Board(str(path)) as b, open_storage(str(path)) as st:
        sid = b.create(DEV, SW, tasks_for(_problems(2), ["fwd"]), None)
        t = b.claim(sid, "w1")
        st.put_results(results(1, 1))
        if how == "deleted":
            path.unlink()
        else:  # e.g. a copy restored over it
            other = tmp_path / "other.db"
            open_storage(str(other)).close()
            os.replace(other, path)
        for write in (lambda: b.finish(t.id, "w1", trials=1, best_tflops=1.0, median_ms=1.0),
                      lambda: b.claim(sid, "w1"), lambda: st.put_results(results(2, 1))):
            with pytest.raises(StorageError, match="deleted or replaced while in use"):
                write()
    assert path.exists() == (how == "replaced")  # nothing recreated it


@pytest.mark.parametrize("lease", [float("nan"), float("inf"), 0.0, -1.0])
def test_leases_must_be_finite_and_positive(db_url: str, lease: float) -> None:
    with Board(db_url) as b:
        sid = b.create(DEV, SW, tasks_for(_problems(1), ["fwd"]), None)
        with pytest.raises(ValueError, match="finite number of seconds > 0"):
            b.claim(sid, "w", lease_s=lease)
        t = b.claim(sid, "w")
        with pytest.raises(ValueError, match="finite number of seconds > 0"):
            b.heartbeat(t.id, "w", lease_s=lease)
        assert [x.state for x in b.tasks(sid)] == ["running"]


def test_expired_lease_is_taken_over(db_url: str) -> None:
    with Board(db_url) as b:
        sid = b.create(DEV, SW, tasks_for(_problems(1), ["fwd"]), None)
        # A lease of 1.5 s: the next claim comes well within it even on a loaded machine.
        t = b.claim(sid, "dead", lease_s=1.5)
        assert b.claim(sid, "alive") is None  # lease still valid
        time.sleep(1.6)
        t2 = b.claim(sid, "alive")
        assert t2.id == t.id and t2.worker == "alive"
        assert not b.heartbeat(t.id, "dead")  # the dead worker lost it
        assert b.heartbeat(t.id, "alive", best_tflops=3.0)


def test_recover_local_frees_tasks_of_dead_processes(db_url: str) -> None:
    with Board(db_url) as b:
        sid = b.create(DEV, SW, tasks_for(_problems(1), ["fwd"]), None)
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from flashtune.db.claims import Board
            with Board({db_url!r}) as b:
                assert b.claim({sid!r}, "gone", lease_s=3600) is not None
            """)], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert b.claim(sid, "me") is None  # a long lease, but ...
        assert b.recover_local(sid) == 1  # ... its process is gone
        assert b.claim(sid, "me") is not None


_CLAIMER = """
import json, sys, time
from flashtune.db.claims import Board
url, sid, me = sys.argv[1:4]
got = []
with Board(url) as b:
    while (t := b.claim(sid, me)) is not None:
        time.sleep(0.005)  # hold it a moment, as a tuner would
        assert b.finish(t.id, me, trials=1, best_tflops=1.0, median_ms=1.0)
        got.append(t.seq)
print(json.dumps(got))
"""


def test_concurrent_processes_claim_each_task_once(db_url: str) -> None:
    n_tasks, n_workers = 24, 3
    tasks = tasks_for(_problems(12), ["fwd", "bwd"])
    assert len(tasks) == n_tasks
    with Board(db_url) as b:
        sid = b.create(DEV, SW, tasks, 1)
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, db_url, sid, f"w{i}"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n_workers)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    claimed = [s for out, _ in outs for s in json.loads(out)]
    assert sorted(claimed) == list(range(n_tasks))  # every task once, none twice
    assert Counter(claimed).most_common(1)[0][1] == 1
    with Board(db_url) as b:
        assert {t.state for t in b.tasks(sid)} == {"done"}


def test_sweep_connections_never_make_a_deleted_database_again(tmp_path: Path) -> None:
    """A board, storage or Optuna storage that a sweep opens after its file was deleted
    (a watcher thread starting late, a worker process, the next task's study) fails; made
    again, the file would take the sweep's results and look like the database."""
    from flashtune.autotune.study import optuna_storage
    from flashtune.db import open_storage
    from flashtune.exceptions import DatabaseMissingError

    db = tmp_path / "gone.db"
    with Board(f"sqlite:///{db}") as b:  # made by the sweep command
        b.create(DEV, SW, tasks_for(_problems(1), ["fwd"]), trials=1)
    for f in tmp_path.glob("gone.db*"):
        f.unlink()
    for opener in (lambda: Board(f"sqlite:///{db}", create=False),
                   lambda: open_storage(str(db), create=False),
                   lambda: optuna_storage(f"sqlite:///{db}", create=False)):
        with pytest.raises(DatabaseMissingError, match="deleted or replaced while in use"):
            opener()
        assert not db.exists()
    open_storage(str(db)).close()  # anything else still makes a new database
    assert db.is_file()
