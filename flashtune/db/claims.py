"""The sweep board: many problems tuned by many workers (processes, GPUs, hosts) through
one database.

A sweep is a list of tasks, one per (problem key, direction), stored in the claims table
``ft_sweep_claims`` of the tuning database itself (:class:`~flashtune.db.models.ClaimRow`,
made by the migrations like every other table). Workers on any number of GPUs and hosts
that share the database fill the sweep together:

- **claim**: in one short write transaction a worker takes the first task that is
  pending, or running under an expired lease (its worker died), and marks it running
  under its own id with a lease. PostgreSQL uses ``SELECT ... FOR UPDATE SKIP LOCKED``;
  SQLite serialises the transaction with ``BEGIN IMMEDIATE``. No task is ever held by two
  live workers.
- **heartbeat**: while tuning, the worker renews the lease every third of its length.
- **finish / fail / release**: the task is marked done (with its best TFLOP/s), failed
  (with the message; ``retry_failed`` claims it again) or pending again (Ctrl-C).

The sweep id is a digest of the device, the software, the trial count and the task keys:
every worker that is given the same shape set on the same kind of GPU joins the same
sweep, and a rerun resumes it. Lease times are wall-clock seconds since the epoch, so the
hosts' clocks must agree to well within a lease (NTP does). The workers themselves live
in :mod:`flashtune.autotune.sweep`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flashtune._host import pid_alive
from flashtune.db.models import ClaimRow, SweepRow
from flashtune.db.validation import check_task
from flashtune.exceptions import StorageError, SweepError
from flashtune.problem import Problem, ProblemKey

log = logging.getLogger(__name__)
STATES = ("pending", "running", "done", "failed")
DEFAULT_LEASE_S = 120.0
_OPT = type(None)
_CELL_TYPES: dict[str, tuple[type, ...]] = {
    "seq": (int,), "attempts": (int,), "pid": (int, _OPT), "trials": (int, _OPT),
    "best_tflops": (int, float, _OPT), "median_ms": (int, float, _OPT),
    "started_at": (int, float, _OPT), "finished_at": (int, float, _OPT),
    "worker": (str, _OPT), "host": (str, _OPT), "note": (str, _OPT),
    "lease_expires": (int, float, _OPT)}
"""The Python types each cell of a claims row may read back as."""
_SWEEP_ID = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Task:
    """One row of the claims table."""

    id: int
    seq: int
    key: ProblemKey
    problem: Problem
    state: str
    worker: str | None
    host: str | None
    pid: int | None
    attempts: int
    trials: int | None
    best_tflops: float | None
    median_ms: float | None
    note: str | None
    started_at: float | None
    finished_at: float | None

    @property
    def direction(self) -> str:
        return self.key.direction


def task_digest(key: ProblemKey) -> str:
    return hashlib.sha256(json.dumps(key.as_dict(), sort_keys=True).encode()).hexdigest()[:32]


def sweep_id(device_fingerprint: str, software_fingerprint: str, keys: Sequence[ProblemKey],
             trials: int | None) -> str:
    """The id every worker computes for the same sweep: device, software, trials, tasks."""
    h = hashlib.sha256()
    for part in (device_fingerprint, software_fingerprint, str(trials)):
        h.update(part.encode() + b"\0")
    for d in sorted(task_digest(k) for k in keys):
        h.update(d.encode())
    return h.hexdigest()[:16]


def tasks_for(problems: Sequence[Problem], directions: Sequence[str]
              ) -> list[tuple[ProblemKey, Problem]]:
    """One task per distinct key, in shape-set order; the first problem of a key is its
    representative (problems in one bucket share a tuned entry)."""
    seen: dict[ProblemKey, Problem] = {}
    for p in problems:
        for d in directions:
            seen.setdefault(p.key(d), p)
    return list(seen.items())


def check_lease(lease_s: float) -> None:
    """A lease must be finite and positive: with NaN no expiry is stored, and a dead
    worker's task is never taken over."""
    if not (isinstance(lease_s, (int, float)) and math.isfinite(lease_s) and lease_s > 0):
        raise ValueError(f"lease_s must be a finite number of seconds > 0, got {lease_s!r}")


class Board:
    """The claims table of one database: create sweeps, claim and settle their tasks.

    ``create=False`` (a sweep's workers and watcher) refuses to make a missing SQLite file:
    the sweep command made it, so one that is gone was deleted under the sweep."""

    def __init__(self, url: str, *, create: bool = True) -> None:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import SQLAlchemyError

        from flashtune.db import resolve_url
        from flashtune.db.rdb import WRITE_OPTION, RDBStorage

        self._sa_error = SQLAlchemyError
        self.url = url
        self.sweeps: Any = SweepRow.__table__
        self.claims: Any = ClaimRow.__table__
        u = make_url(resolve_url(url))
        if u.get_backend_name() == "sqlite" and u.database in (None, "", ":memory:"):
            raise SweepError("a sweep needs a database file or server that its workers share, "
                             "not an in-memory database; pass --db PATH or --db URL")
        # The storage's engine recipe, and its migrations create the tables; every claims
        # transaction may write, so it takes the write lock up front (BEGIN IMMEDIATE on
        # SQLite): two workers never both read a task as free, and never deadlock upgrading.
        self._storage = RDBStorage(u.render_as_string(hide_password=False), create=create)
        self.engine = self._storage.engine.execution_options(**{WRITE_OPTION: True})

    def close(self) -> None:
        self._storage.close()

    def __enter__(self) -> Board:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except self._sa_error as e:
            msg = " ".join(str(e).split("\n")[0].split())
            raise StorageError(f"sweep claims table: {msg}") from None

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        self._storage.check_file()  # a sweep must not fill a deleted or replaced file
        with self._errors(), self.engine.begin() as conn:
            yield conn

    # -- setup -----------------------------------------------------------------------------

    def create(self, device: Any, software: Any, tasks: Sequence[tuple[ProblemKey, Problem]],
               trials: int | None) -> str:
        """Register a sweep and its tasks (idempotent: every worker may call it)."""
        from sqlalchemy import select

        sid = sweep_id(device.fingerprint, software.fingerprint, [k for k, _ in tasks], trials)
        with self._tx() as c:
            if c.execute(select(self.sweeps.c.id).where(self.sweeps.c.id == sid)).first():
                return sid
        rows = [dict(sweep_id=sid, task=task_digest(k), seq=i, direction=k.direction,
                     key_json=json.dumps(k.as_dict(), sort_keys=True),
                     problem_json=json.dumps(p.as_dict(), sort_keys=True),
                     state="pending", attempts=0) for i, (k, p) in enumerate(tasks)]
        with self._tx() as c:
            ins = self._insert(c)
            c.execute(ins(self.sweeps).values(
                id=sid, device_json=json.dumps(device.as_dict(), sort_keys=True),
                software_fingerprint=software.fingerprint, trials=trials, total=len(rows),
                created_at=time.time()).on_conflict_do_nothing())
            if rows:
                c.execute(ins(self.claims).values(rows).on_conflict_do_nothing())
        return sid

    @staticmethod
    def _insert(conn: Any) -> Callable[[Any], Any]:
        """The dialect's INSERT, which has ``on_conflict_do_nothing``."""
        from sqlalchemy.dialects import postgresql, sqlite

        return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert

    # -- claims ----------------------------------------------------------------------------

    def claim(self, sid: str, worker: str, *, lease_s: float = DEFAULT_LEASE_S,
              retry_failed: bool = False) -> Task | None:
        """Atomically take the next free task of sweep ``sid`` for ``worker`` (or None)."""
        check_lease(lease_s)
        from sqlalchemy import and_, or_, select, update

        c = self.claims
        now = time.time()
        free = [c.c.state == "pending",
                and_(c.c.state == "running", c.c.lease_expires < now)]
        if retry_failed:
            free.append(c.c.state == "failed")
        while True:
            with self._tx() as conn:
                row = conn.execute(
                    select(c.c.id).where(c.c.sweep_id == sid, or_(*free)).order_by(c.c.seq)
                    .limit(1).with_for_update(skip_locked=True)).first()
                if row is None:
                    return None
                conn.execute(update(c).where(c.c.id == row.id).values(
                    state="running", worker=worker, host=socket.gethostname(), pid=os.getpid(),
                    lease_expires=now + lease_s, attempts=c.c.attempts + 1, started_at=now,
                    finished_at=None, note=None))
                got = self._task(conn.execute(select(c).where(c.c.id == row.id)).one())
                if got is not None:
                    return got
                # A corrupt row is failed (a rerun with --retry-failed meets it again).
                conn.execute(update(c).where(c.c.id == row.id).values(
                    state="failed", note="corrupt row: see the log", lease_expires=None))

    def _owned(self, task_id: int, worker: str) -> Any:
        c = self.claims
        return (c.c.id == task_id) & (c.c.worker == worker) & (c.c.state == "running")

    def heartbeat(self, task_id: int, worker: str, *, lease_s: float = DEFAULT_LEASE_S,
                  best_tflops: float | None = None, trials: int | None = None) -> bool:
        """Renew ``worker``'s lease (and its progress); False if the task is no longer its."""
        check_lease(lease_s)
        from sqlalchemy import update

        values: dict[str, Any] = {"lease_expires": time.time() + lease_s}
        if best_tflops is not None:
            values["best_tflops"] = best_tflops
        if trials is not None:
            values["trials"] = trials
        with self._tx() as conn:
            n = conn.execute(update(self.claims).where(self._owned(task_id, worker))
                             .values(**values)).rowcount
        return bool(n)

    def _settle(self, task_id: int, owner: str, **values: Any) -> bool:
        from sqlalchemy import update

        with self._tx() as conn:
            n = conn.execute(update(self.claims).where(self._owned(task_id, owner))
                             .values(**values)).rowcount
        return bool(n)

    def finish(self, task_id: int, worker: str, *, trials: int | None,
               best_tflops: float | None, median_ms: float | None,
               note: str | None = None) -> bool:
        return self._settle(task_id, worker, state="done", trials=trials,
                            best_tflops=best_tflops, median_ms=median_ms, note=note,
                            lease_expires=None, finished_at=time.time())

    def fail(self, task_id: int, worker: str, error: str) -> bool:
        return self._settle(task_id, worker, state="failed", note=error[:2000],
                            lease_expires=None, finished_at=time.time())

    def release(self, task_id: int, worker: str) -> bool:
        """Give a task back unfinished (interrupted): pending again, study kept."""
        return self._settle(task_id, worker, state="pending", worker=None, lease_expires=None)

    def recover_local(self, sid: str) -> int:
        """Free the running tasks of this host whose worker process is gone (a rerun after a
        crash need not wait for their leases to expire). Returns how many were freed."""
        from sqlalchemy import select, update

        c = self.claims
        host = socket.gethostname()
        with self._tx() as conn:
            rows = conn.execute(select(c.c.id, c.c.pid).where(
                c.c.sweep_id == sid, c.c.state == "running", c.c.host == host)).all()
            dead = [r.id for r in rows if r.pid is not None and not pid_alive(r.pid)]
            if dead:
                conn.execute(update(c).where(c.c.id.in_(dead), c.c.state == "running")
                             .values(state="pending", worker=None, lease_expires=None))
        return len(dead)

    # -- reading ---------------------------------------------------------------------------

    def tasks(self, sid: str) -> list[Task]:
        from sqlalchemy import select

        with self._tx() as conn:
            rows = conn.execute(select(self.claims).where(self.claims.c.sweep_id == sid)
                                .order_by(self.claims.c.seq)).all()
        return [t for t in map(self._task, rows) if t is not None]

    def sweep_ids(self) -> list[str]:
        from sqlalchemy import select

        c = self.claims
        with self._tx() as conn:
            ids = [r.id for r in conn.execute(
                select(self.sweeps.c.id).order_by(self.sweeps.c.created_at)).all()]
            orphans = conn.execute(select(c.c.id).where(
                c.c.sweep_id.not_in(select(self.sweeps.c.id))).order_by(c.c.id)).all()
        where = self._storage._where
        for r in orphans:  # a corrupt sweep id, here or in the sweeps table
            log.warning("flashtune: %s: skipping sweep task row %s: it belongs to no sweep",
                        where, r.id)
        good = [i for i in ids if isinstance(i, str) and _SWEEP_ID.fullmatch(i)]
        for i in ids:
            if i not in good:
                log.warning("flashtune: %s: skipping corrupt sweep row %s: not a sweep id",
                            where, str(i)[:40])
        return good

    def _task(self, r: Any) -> Task | None:
        """The task of row ``r``, or None (with a warning naming the database and the row)
        if a cell is corrupt: SQLite stores any value in any column."""
        try:
            key, problem = check_task(json.loads(r.key_json), json.loads(r.problem_json))
            if r.state not in STATES:
                raise ValueError(f"state {str(r.state)[:40]!r} is not one of {STATES}")
            for name, kinds in _CELL_TYPES.items():
                v = getattr(r, name)
                if isinstance(v, bool) or not isinstance(v, kinds) or (
                        name in ("worker", "host") and isinstance(v, str)
                        and not v.isprintable()):
                    raise ValueError(f"{name} is {str(v)[:40]!r}, not of its type")
            return Task(id=r.id, seq=r.seq, key=key, problem=problem, state=r.state,
                        worker=r.worker, host=r.host, pid=r.pid, attempts=r.attempts,
                        trials=r.trials, best_tflops=r.best_tflops, median_ms=r.median_ms,
                        note=r.note, started_at=r.started_at, finished_at=r.finished_at)
        except (ValueError, TypeError, KeyError) as e:
            log.warning("flashtune: %s: skipping corrupt sweep task row %s: %s",
                        self._storage._where, r.id, e)
            return None


def counts(tasks: Sequence[Task]) -> dict[str, int]:
    out = dict.fromkeys(STATES, 0)
    for t in tasks:
        out[t.state] = out.get(t.state, 0) + 1
    return out
