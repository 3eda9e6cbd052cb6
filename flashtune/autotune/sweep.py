"""Sweeps: many problems tuned by many workers (processes, GPUs, hosts) through one database.

A sweep is a list of tasks, one per (problem key, direction), stored in the claims table
``ft_sweep_claims`` of the tuning database itself. Workers on any number of GPUs and
hosts that share the database fill the sweep together:

- **claim**: in one short write transaction a worker takes the first task that is
  pending, or running under an expired lease (its worker died), and marks it running
  under its own id with a lease. PostgreSQL uses ``SELECT ... FOR UPDATE SKIP LOCKED``;
  SQLite serialises the transaction with ``BEGIN IMMEDIATE``. No task is ever held by two
  live workers.
- **heartbeat**: while tuning, a thread renews the lease every third of its length.
- **finish / fail / release**: the task is marked done (with its best TFLOP/s), failed
  (with the message; ``retry_failed`` claims it again) or pending again (Ctrl-C).
- **tune**: the task runs through :func:`flashtune.autotune.tune`, whose Optuna study
  lives in the same database (Optuna's RDB storage), so a task taken over from a dead
  worker, or a sweep run again, continues the study instead of starting over.

The sweep id is a digest of the device, the software, the trial count and the task keys:
every worker that is given the same shape set on the same kind of GPU joins the same
sweep, and a rerun resumes it. Lease times are wall-clock seconds since the epoch, so the
hosts' clocks must agree to well within a lease (NTP does).

The tables live on their own ``MetaData`` with ``create_all``, beside (not inside) the
database package's Alembic-managed schema.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flashtune.exceptions import FlashtuneError, StorageError
from flashtune.problem import Problem, ProblemKey

STATES = ("pending", "running", "done", "failed")
DEFAULT_LEASE_S = 120.0
_PG_CREATE_LOCK = 0x66745F73776565  # advisory lock key for creating the tables ("ft_swee")


class SweepError(FlashtuneError):
    """A sweep could not be set up or coordinated (the message says why)."""


# ---------------------------------------------------------------------------------- tables


def _tables() -> tuple[Any, Any, Any]:
    from sqlalchemy import (
        Column,
        Float,
        Index,
        Integer,
        MetaData,
        String,
        Table,
        Text,
        UniqueConstraint,
    )

    md = MetaData()
    sweeps = Table(
        "ft_sweeps", md,
        Column("id", String(32), primary_key=True),
        Column("device_json", Text, nullable=False),
        Column("software_fingerprint", String(32), nullable=False),
        Column("trials", Integer, nullable=True),
        Column("total", Integer, nullable=False),
        Column("created_at", Float, nullable=False),
    )
    claims = Table(
        "ft_sweep_claims", md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("sweep_id", String(32), nullable=False),
        Column("task", String(32), nullable=False),  # digest of the problem key
        Column("seq", Integer, nullable=False),  # order in the shape set
        Column("direction", String(3), nullable=False),
        Column("key_json", Text, nullable=False),
        Column("problem_json", Text, nullable=False),
        Column("state", String(8), nullable=False),
        Column("worker", String(200), nullable=True),
        Column("host", String(200), nullable=True),
        Column("pid", Integer, nullable=True),
        Column("lease_expires", Float, nullable=True),
        Column("attempts", Integer, nullable=False),
        Column("trials", Integer, nullable=True),
        Column("best_tflops", Float, nullable=True),
        Column("median_ms", Float, nullable=True),
        Column("note", Text, nullable=True),  # the error of a failed task, "cached", ...
        Column("started_at", Float, nullable=True),
        Column("finished_at", Float, nullable=True),
        UniqueConstraint("sweep_id", "task", name="uq_ft_sweep_claims_task"),
        Index("ix_ft_sweep_claims_state", "sweep_id", "state", "seq"),
    )
    return md, sweeps, claims


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


# ----------------------------------------------------------------------------------- board


def _engine(url: str) -> Any:
    from sqlalchemy import create_engine, event
    from sqlalchemy.engine import make_url

    from flashtune.db import resolve_url

    u = make_url(resolve_url(url))
    if u.get_backend_name() == "sqlite":
        if not u.database or u.database == ":memory:":
            raise SweepError("a sweep needs a database file or server that its workers share, "
                             "not an in-memory database; pass --db PATH or --db URL")
        engine = create_engine(u, connect_args={"timeout": 30.0})

        @event.listens_for(engine, "connect")
        def _connect(conn: Any, _rec: Any) -> None:
            conn.isolation_level = None  # SQLAlchemy's begin event below issues BEGIN
            conn.execute("PRAGMA busy_timeout = 30000")

        @event.listens_for(engine, "begin")
        def _begin(conn: Any) -> None:
            # Every claims transaction may write: take the write lock up front, so two
            # workers never both read a task as free (and never deadlock upgrading).
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(u, pool_pre_ping=True, pool_size=2)


class Board:
    """The claims table of one database: create sweeps, claim and settle their tasks."""

    def __init__(self, url: str) -> None:
        from sqlalchemy.exc import SQLAlchemyError

        self._sa_error = SQLAlchemyError
        self.url = url
        self.md, self.sweeps, self.claims = _tables()
        with self._errors():
            self.engine = _engine(url)
            with self.engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    # Workers that start together would race to CREATE TABLE; one waits.
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_CREATE_LOCK})")
                self.md.create_all(conn, checkfirst=True)

    def close(self) -> None:
        self.engine.dispose()

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
        from sqlalchemy import and_, or_, select, update

        c = self.claims
        now = time.time()
        free = [c.c.state == "pending",
                and_(c.c.state == "running", c.c.lease_expires < now)]
        if retry_failed:
            free.append(c.c.state == "failed")
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
            got = conn.execute(select(c).where(c.c.id == row.id)).one()
        return self._task(got)

    def _owned(self, task_id: int, worker: str) -> Any:
        c = self.claims
        return (c.c.id == task_id) & (c.c.worker == worker) & (c.c.state == "running")

    def heartbeat(self, task_id: int, worker: str, *, lease_s: float = DEFAULT_LEASE_S,
                  best_tflops: float | None = None, trials: int | None = None) -> bool:
        """Renew ``worker``'s lease (and its progress); False if the task is no longer its."""
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

        from flashtune.autotune.tuner import _pid_alive

        c = self.claims
        host = socket.gethostname()
        with self._tx() as conn:
            rows = conn.execute(select(c.c.id, c.c.pid).where(
                c.c.sweep_id == sid, c.c.state == "running", c.c.host == host)).all()
            dead = [r.id for r in rows if r.pid is not None and not _pid_alive(r.pid)]
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
        return [self._task(r) for r in rows]

    def sweep_ids(self) -> list[str]:
        from sqlalchemy import select

        with self._tx() as conn:
            return [r.id for r in conn.execute(
                select(self.sweeps.c.id).order_by(self.sweeps.c.created_at)).all()]

    @staticmethod
    def _task(r: Any) -> Task:
        return Task(id=r.id, seq=r.seq, key=ProblemKey.from_dict(json.loads(r.key_json)),
                    problem=Problem.from_dict(json.loads(r.problem_json)), state=r.state,
                    worker=r.worker, host=r.host, pid=r.pid, attempts=r.attempts,
                    trials=r.trials, best_tflops=r.best_tflops, median_ms=r.median_ms,
                    note=r.note, started_at=r.started_at, finished_at=r.finished_at)


def counts(tasks: Sequence[Task]) -> dict[str, int]:
    out = dict.fromkeys(STATES, 0)
    for t in tasks:
        out[t.state] = out.get(t.state, 0) + 1
    return out


# ---------------------------------------------------------------------------------- worker


@dataclass
class Options:
    """What a worker needs besides the board: the database and the tuning budget."""

    db_url: str
    trials: int | None = None
    time_budget: float | None = None  # seconds per task
    lease_s: float = DEFAULT_LEASE_S
    retry_failed: bool = False
    wait: bool = True  # keep polling while other workers hold tasks (take over dead ones)
    poll_s: float = 2.0


class _Heartbeat(threading.Thread):
    """Renews the lease of the task in hand every third of the lease."""

    def __init__(self, board: Board, task: Task, worker: str, lease_s: float) -> None:
        super().__init__(daemon=True, name=f"flashtune-heartbeat-{task.id}")
        self.board, self.task, self.worker, self.lease_s = board, task, worker, lease_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.lease_s / 3):
            try:
                self.board.heartbeat(self.task.id, self.worker, lease_s=self.lease_s)
            except StorageError:
                pass  # a missed beat is survivable; the next one may get through

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


def worker_id(label: str = "") -> str:
    tail = f":{label}" if label else ""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}{tail}"


def _cached(storage: Any, device: Any, software: Any, task: Task, trials: int | None) -> Any:
    """A fresh stored result good enough to skip the task (as many trials as asked)."""
    r = storage.get_result(device, software, task.key)
    if r is None or (trials is not None and r.trials < trials):
        return None
    return r


class _Progress:
    """Forwards the tuner's per-trial events to the board, at most every ``every_s``, so
    every watcher (this host or another) sees the current task's best TFLOP/s."""

    def __init__(self, board: Board, task: Task, worker: str, lease_s: float,
                 every_s: float = 2.0) -> None:
        self.board, self.task, self.worker, self.lease_s = board, task, worker, lease_s
        self.every_s, self.last = every_s, 0.0
        self.flops = task.problem.flops(task.direction)

    def __call__(self, ev: dict[str, Any]) -> None:
        if ev.get("event") != "trial":
            return
        best = ev.get("best_ms")
        now = time.monotonic()
        if not isinstance(best, float) or not 0 < best < float("inf") \
                or now - self.last < self.every_s:
            return
        self.last = now
        try:
            self.board.heartbeat(self.task.id, self.worker, lease_s=self.lease_s,
                                 best_tflops=self.flops / (best * 1e-3) / 1e12,
                                 trials=ev.get("measured"))
        except StorageError:
            pass


def tune_task(task: Task, opts: Options, storage: Any, session: Any,
              progress: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """Tune one task with the tuner (its study resumes if it exists); returns its result."""
    from flashtune.autotune import tune

    return tune(task.problem, task.direction, trials=opts.trials, time_budget=opts.time_budget,
                storage=storage, session=session, progress=progress)


def prepare_optuna(url: str) -> None:
    """Create Optuna's tables in ``url`` before the workers start (``optuna_storage``
    retries the creation race, so workers that start together would also be safe)."""
    from flashtune.autotune.tuner import optuna_storage
    from flashtune.db import resolve_url

    optuna_storage(resolve_url(url))


def run_worker(board: Board, sid: str, opts: Options, *, worker: str | None = None,
               on_event: Callable[[str, Task], None] | None = None) -> dict[str, int]:
    """Claim and tune tasks of sweep ``sid`` until none is left; returns what it did.

    ``on_event(kind, task)`` is called with ``"start"``, ``"done"`` and ``"failed"``.
    A KeyboardInterrupt releases the task in hand and propagates.
    """
    from flashtune.autotune import TuneSession
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info, software_info

    worker = worker or worker_id()
    did = {"done": 0, "failed": 0, "cached": 0}
    device, software = device_info(), software_info()
    board.recover_local(sid)
    prepare_optuna(opts.db_url)
    with open_storage(opts.db_url) as storage, TuneSession() as session:
        while True:
            task = board.claim(sid, worker, lease_s=opts.lease_s, retry_failed=opts.retry_failed)
            if task is None:
                left = counts(board.tasks(sid))
                if not opts.wait or left["running"] == 0:
                    return did
                time.sleep(opts.poll_s)  # others hold tasks: take over any whose lease lapses
                continue
            if on_event:
                on_event("start", task)
            hb = _Heartbeat(board, task, worker, opts.lease_s)
            hb.start()
            try:
                hit = _cached(storage, device, software, task, opts.trials)
                note = "cached" if hit is not None else None
                result = hit if hit is not None else tune_task(
                    task, opts, storage, session, _Progress(board, task, worker, opts.lease_s))
            except KeyboardInterrupt:
                hb.stop()
                board.release(task.id, worker)
                raise
            except Exception as e:  # one bad problem must not end the sweep
                hb.stop()
                msg = " ".join(str(e).split()) or type(e).__name__
                board.fail(task.id, worker, f"{type(e).__name__}: {msg}")
                did["failed"] += 1
                if on_event:
                    on_event("failed", task)
                continue
            hb.stop()
            board.finish(task.id, worker, trials=result.trials, best_tflops=result.tflops,
                         median_ms=result.median_ms, note=note)
            did["cached" if note else "done"] += 1
            if on_event:
                on_event("done", task)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a worker process: ``python -m flashtune.autotune.sweep SPEC_JSON``.

    ``SPEC_JSON`` holds ``sweep_id``, ``options`` (:class:`Options` fields) and ``label``.
    """
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    spec = json.loads(args[0])
    opts = Options(**spec["options"])
    try:
        with Board(opts.db_url) as board:
            did = run_worker(board, spec["sweep_id"], opts,
                             worker=worker_id(spec.get("label", "")))
    except KeyboardInterrupt:
        return 130
    except FlashtuneError as e:
        print(f"flashtune sweep worker: {e}", file=sys.stderr)
        return 1
    print(json.dumps(did), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
