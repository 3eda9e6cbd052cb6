"""The SQLAlchemy implementation of :class:`~flashtune.db.storage.Storage`
(SQLite and PostgreSQL).

- One session scope (:meth:`RDBStorage._session`) carries every read and write: it
  commits, rolls back on error and turns driver errors into :class:`StorageError`.
- SQLite runs in WAL mode with a busy timeout; write transactions start with
  ``BEGIN IMMEDIATE`` so two writers never deadlock upgrading a read lock.
- Concurrent inserts of the same row are settled with ``INSERT ... ON CONFLICT DO
  NOTHING`` followed by a re-read, on both dialects: no retry loops.
- The schema is migrated with Alembic on open, under a lock (SQLite: the write
  transaction; PostgreSQL: an advisory lock), so many processes may open a new
  database at once.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sqlite3
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sqlalchemy import Engine, column, create_engine, event, inspect, select, table, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo, software_info
from flashtune.db.models import (
    READABLE_REVISIONS,
    SCHEMA_REVISION,
    VERSION_TABLE,
    Base,
    Device,
    MissRow,
    ProblemRow,
    ResultRow,
    Software,
)
from flashtune.db.storage import ORIGINS, PREFER, VERIFY_STATES, Result, Storage, written
from flashtune.db.validation import check_miss, check_result, sort_key
from flashtune.exceptions import (
    DatabaseMissingError,
    SchemaError,
    SchemaOutdatedError,
    StorageError,
)
from flashtune.problem import Problem, ProblemKey

if TYPE_CHECKING:  # alembic loads only when a database needs migrating (~0.2 s)
    from alembic.config import Config
    from alembic.script import ScriptDirectory

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 30.0
_MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# Any fixed 64-bit number: the PostgreSQL advisory lock that serializes migrations.
_PG_MIGRATION_LOCK = 0x666C617368_74756E  # "flashtun"
WRITE_OPTION = "flashtune_write"
"""Execution option of a connection whose transactions write (BEGIN IMMEDIATE on SQLite)."""


_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_inherited_connections() -> None:
    # A forked child (a DataLoader worker, a sweep worker) must not use the parent's
    # sockets or SQLite handles: drop them from the pools without closing them.
    for engine in list(_ENGINES):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_inherited_connections)


@functools.lru_cache(maxsize=1)
def _scripts() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(_MIGRATIONS))


def _alembic_config() -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    return cfg


def _first_line(e: BaseException) -> str:
    text = str(e.orig if isinstance(e, DBAPIError) and e.orig is not None else e)
    return (text.strip().splitlines() or [type(e).__name__])[0]


def _translate(e: BaseException, where: str) -> StorageError:
    """One line saying what went wrong and where."""
    msg = _first_line(e)
    low = msg.lower()
    if "database is locked" in low or "database is busy" in low:
        return StorageError(f"{where}: the database is locked by another writer "
                            f"(gave up waiting for it)")
    if "not a database" in low or "malformed" in low:
        return StorageError(f"{where}: not a flashtune database, or corrupt ({msg})")
    return StorageError(f"{where}: {msg}")


def rw_uri(path: Path) -> str:
    """The SQLite URI that opens ``path`` for writing but never creates it: a connection
    made after the file was deleted fails, instead of starting an empty database in its
    place (a sweep would fill it, and its results would look lost)."""
    return f"file:{quote(str(path.absolute()))}?mode=rw"


def _sqlite_engine(url: Any, read_only: bool, busy_timeout: float | None = None,
                   create: bool = True) -> Engine:
    timeout = BUSY_TIMEOUT_S if busy_timeout is None else busy_timeout
    db = url.database
    if not db or db == ":memory:":
        engine = create_engine("sqlite://", poolclass=StaticPool,
                               connect_args={"check_same_thread": False})
        wal = False
    else:
        path = Path(db)
        if path.is_dir():
            raise StorageError(f"{path}: is a directory, not a database file")
        if read_only:
            if not path.is_file():
                raise DatabaseMissingError(f"{path}: no such database (opened read-only)")
            uri = f"file:{quote(str(path.absolute()))}?mode=ro"
            engine = create_engine(
                "sqlite://", creator=lambda: sqlite3.connect(
                    uri, uri=True, timeout=timeout, check_same_thread=False))
        else:
            if not create and not path.is_file():
                raise DatabaseMissingError(
                    f"{path}: no such database; it was deleted or replaced while in use, "
                    "or never made (the sweep command makes it before its workers start)")
            if create:
                path.parent.mkdir(parents=True, exist_ok=True)
                sqlite3.connect(path).close()  # create it now, and never again (below)
            engine = create_engine(f"sqlite:///{rw_uri(path)}&uri=true",
                                   connect_args={"timeout": timeout})
        wal = not read_only

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event emit BEGIN itself (the driver's implicit
        # transactions cannot do BEGIN IMMEDIATE, nor transactional DDL).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        cur.execute("PRAGMA foreign_keys = ON")
        if wal:
            cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = NORMAL")  # durable against process death in WAL
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE_OPTION)
                             else "BEGIN")

    return engine


def _create_engine(url_text: str, read_only: bool, busy_timeout: float | None = None,
                   create: bool = True) -> Engine:
    url = make_url(url_text)
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(url, read_only, busy_timeout, create)
    if url.get_backend_name() != "postgresql":
        raise ArgumentError(f"{url.get_backend_name()} is not supported; use SQLite or "
                            "PostgreSQL")
    # The dispatcher passes a short ``busy_timeout``: a server that accepts connections but
    # never answers, or a query stuck behind a lock, must cost a training step about as
    # long as a locked SQLite file does (libpq's connect timeout is whole seconds, >= 2).
    connect_args: dict[str, Any] = {"connect_timeout": 10}
    if busy_timeout is not None:
        connect_args = {"connect_timeout": max(2, math.ceil(busy_timeout)),
                        "options": f"-c statement_timeout={max(1, int(busy_timeout * 1000))} "
                                   f"-c lock_timeout={max(1, int(busy_timeout * 1000))}"}
    opts: dict[str, Any] = {"pool_pre_ping": True, "connect_args": connect_args}
    if read_only:
        opts["execution_options"] = {"postgresql_readonly": True}
    return create_engine(url, **opts)


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)


def _iso_utc(text: Any) -> str:
    """An ISO-8601 time with a zone, as UTC text; ValueError / TypeError otherwise."""
    t = datetime.fromisoformat(text)
    if t.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return _utc(t).isoformat(timespec="microseconds")


def _insert(session: Session, model: type[Base]) -> Any:
    """The dialect's INSERT, which has ``on_conflict_do_nothing``."""
    dialect = session.get_bind().dialect.name
    return (pg_insert if dialect == "postgresql" else sqlite_insert)(model)


def _row_id(session: Session, model: Any, where: dict[str, Any], values: dict[str, Any],
            cache: dict[tuple[Any, ...], int]) -> int:
    """The id of the row matching ``where``, inserting ``values`` if there is none.

    Rows of these tables are never deleted, so an id found already committed is cached
    (one inserted by this transaction is not: the transaction may still roll back).
    """
    token = (model.__tablename__, *sorted(where.items()))
    if token in cache:
        return cache[token]
    find = model.id_where(**where)
    got = session.scalar(find)
    if got is not None:
        cache[token] = got
        return int(got)
    session.execute(_insert(session, model).values(**values).on_conflict_do_nothing())
    got = session.scalar(find)
    assert got is not None
    return int(got)


def _sqlite_foreign_keys(conn: Any, *, on: bool) -> None:
    """Turn SQLite's foreign-key checks on or off; outside a transaction only (inside one
    SQLite ignores it), so on the driver's connection, past SQLAlchemy's autobegin."""
    conn.connection.dbapi_connection.execute(f"PRAGMA foreign_keys = {'ON' if on else 'OFF'}")


class RDBStorage(Storage):
    """:class:`Storage` on any SQLAlchemy URL of SQLite or PostgreSQL.

    A SQLite file is created when missing, unless ``create`` is false (the sweep's own
    connections: the file was made before they open, and one that is gone was deleted
    under the sweep, so making it again would start an empty database in its place).
    """

    def __init__(self, url: str, *, read_only: bool = False,
                 busy_timeout: float | None = None, create: bool = True) -> None:
        self.url = url
        self.read_only = read_only
        try:
            parsed = make_url(url)
            # Messages name a SQLite database by its file, any other by its URL sans password.
            self._where = parsed.database if parsed.get_backend_name() == "sqlite" \
                and parsed.database not in (None, "", ":memory:") \
                else parsed.render_as_string(hide_password=True)
        except ArgumentError:
            raise StorageError(f"{url!r} is not a database path or SQLAlchemy URL") from None
        if parsed.get_backend_name() == "sqlite" and "mode" in parsed.query:
            # SQLite's own URI parameter: honour mode=ro (read-only), refuse the others
            # (pysqlite would ignore them with a warning, and then write).
            mode = parsed.query["mode"]
            if mode != "ro":
                raise StorageError(f"{self._where}: mode={mode!r} is not supported; use "
                                   "mode=ro for read-only, or no mode")
            read_only = self.read_only = True
            url = parsed.difference_update_query(["mode"]).render_as_string(
                hide_password=False)
        try:
            self.engine = _create_engine(url, read_only, busy_timeout, create)
        except (ArgumentError, NoSuchModuleError, ImportError) as e:
            raise StorageError(f"{self._where}: cannot use this URL ({_first_line(e)})") from None
        _ENGINES.add(self.engine)
        self._ids_cache: dict[tuple[Any, ...], int] = {}
        self._read = sessionmaker(bind=self.engine, expire_on_commit=False)
        self._write = sessionmaker(bind=self.engine.execution_options(**{WRITE_OPTION: True}),
                                   expire_on_commit=False)
        try:
            self._migrate()
        except BaseException:
            self.engine.dispose()
            raise
        sqlite_file = parsed.get_backend_name() == "sqlite" and parsed.database not in (
            None, "", ":memory:")
        self._file = Path(str(parsed.database)).absolute() if sqlite_file else None
        self._identity = self._file_identity()

    def __repr__(self) -> str:
        return f"RDBStorage({self._where!r}, read_only={self.read_only})"

    # -- plumbing -----------------------------------------------------------------------

    def _file_identity(self) -> tuple[int, int] | None:
        if self._file is None:
            return None
        try:
            st = os.stat(self._file)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def check_writable(self) -> None:
        """Raise StorageError unless this storage may be written: not opened read-only (a
        SQLite URL with ``mode=ro`` is read-only), and its file not deleted or replaced.
        Callers that also write through another engine (Optuna's study) check first."""
        if self.read_only:
            raise StorageError(f"{self._where}: opened read-only; cannot write")
        self.check_file()

    def check_file(self) -> None:
        """Raise StorageError if the SQLite file opened here was deleted or replaced since:
        SQLite would go on writing into the unlinked file, and every result would be lost.
        Every write checks this first (a server database has nothing to check)."""
        if self._identity is not None and self._file_identity() != self._identity:
            raise StorageError(f"{self._where}: the database file was deleted or replaced "
                               "while in use; nothing more is written (what would be written "
                               "now would be lost). Check what removed it, then rerun")

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (SQLAlchemyError, sqlite3.Error) as e:
            raise _translate(e, self._where) from None

    @contextmanager
    def _session(self, *, write: bool = False) -> Iterator[Session]:
        """The one session scope: commit on success, roll back on any error."""
        if write:
            self.check_writable()
        with self._errors():
            session = (self._write if write else self._read)()
            try:
                yield session
                if write:
                    session.commit()
            except BaseException:
                session.rollback()
                raise
            finally:
                session.close()

    def _revision(self) -> str | None:
        """The schema revision in our version table (None: no flashtune tables yet)."""
        with self._errors(), self.engine.connect() as conn:
            if not inspect(conn).has_table(VERSION_TABLE):
                return None
            found: Sequence[Any] = conn.execute(select(column("version_num")).select_from(
                table(VERSION_TABLE))).scalars().all()
        if len(found) > 1:
            raise SchemaError(f"{self._where}: several schema revisions {sorted(found)}; "
                              "not a database this flashtune wrote")
        return str(found[0]) if found else None

    def _migrate(self) -> None:
        current = self._revision()
        if current == SCHEMA_REVISION or (self.read_only and current in READABLE_REVISIONS):
            return
        from alembic import command

        if current is not None and current not in {s.revision for s in
                                                   _scripts().walk_revisions()}:
            raise SchemaError(
                f"{self._where}: schema revision {current!r} is newer than this flashtune "
                f"knows (up to {SCHEMA_REVISION!r}); upgrade flashtune")
        if self.read_only:
            if current is None:
                raise SchemaError(f"{self._where}: has no flashtune tables")
            raise SchemaOutdatedError(
                f"{self._where}: has schema revision {current!r}, older than "
                f"{SCHEMA_REVISION!r}; open it once for writing to upgrade (any autotune "
                "command does, e.g. `autotune info --db ...`)")
        cfg = _alembic_config()
        with self._errors(), self.engine.connect() as conn:
            conn = conn.execution_options(**{WRITE_OPTION: True})
            sqlite = conn.dialect.name == "sqlite"
            if sqlite:  # SQLite alters a table by copying it: no checks while it is away
                _sqlite_foreign_keys(conn, on=False)
            try:
                with conn.begin():
                    if conn.dialect.name == "postgresql":
                        conn.exec_driver_sql(
                            f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})")
                    cfg.attributes["connection"] = conn
                    command.upgrade(cfg, "head")
                    if sqlite:  # ... and every reference checked before the commit
                        broken = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
                        if broken:
                            raise SchemaError(f"{self._where}: the upgrade left {len(broken)} "
                                              f"broken references (first: {broken[0]}); "
                                              "nothing was changed")
            finally:
                if sqlite:
                    _sqlite_foreign_keys(conn, on=True)

    def close(self) -> None:
        self.engine.dispose()

    # -- conversion ---------------------------------------------------------------------

    def _skip(self, table: str, row_id: Any, e: BaseException) -> None:
        log.warning("flashtune: %s: skipping corrupt %s row %s: %s", self._where, table,
                    row_id, e)

    @staticmethod
    def _check_parents(row: ResultRow | MissRow) -> None:
        """A device or software row whose fingerprint is not that of its own fields was
        edited behind flashtune's back: its results cannot be trusted to be what they say."""
        software = getattr(row, "software", None)
        parents = [("device", row.device, row.device.info())]
        if software is not None:  # torch and cuda are provenance, not in the fingerprint
            parents.append(("software", software, software.info("", "")))
        for name, parent, info in parents:
            if parent.fingerprint != info.fingerprint:
                raise ValueError(f"the {name} row {parent.id} does not match its fingerprint "
                                 f"{str(parent.fingerprint)[:40]!r}")

    def _result(self, row: ResultRow, software: SoftwareInfo) -> Result | None:
        try:
            if not isinstance(row.created_at, datetime):
                raise ValueError(f"created_at is not a time: {str(row.created_at)[:40]!r}")
            self._check_parents(row)
            example = json.loads(row.example_json) if row.example_json else None
            r = Result(
                device=row.device.info(), software=row.software.info(row.torch, row.cuda),
                key=row.problem.key(),
                problem=Problem.from_dict(example) if example is not None else None,
                config=json.loads(row.config_json), median_ms=row.median_ms,
                p20_ms=row.p20_ms, p80_ms=row.p80_ms, tflops=row.tflops,
                max_error=row.max_error, trials=row.trials,
                search_seconds=row.search_seconds, host=row.host,
                created_at=_utc(row.created_at).isoformat(timespec="microseconds"),
                flashtune_version=row.flashtune_version, origin=row.origin, verify=row.verify,
                verified_at=None if row.verified_at is None else _iso_utc(row.verified_at))
            # Every column as an import would be checked: SQLite stores any value in any
            # column, and one bad cell ('fast' as a median) must cost its row, not the read.
            if not isinstance(r.config, dict):
                raise ValueError(f"config is not an object: {row.config_json[:40]!r}")
            if r.origin not in ORIGINS:
                raise ValueError(f"origin {r.origin!r} is not one of {ORIGINS}")
            if r.verify not in VERIFY_STATES:
                raise ValueError(f"verify {r.verify!r} is not one of {VERIFY_STATES}")
            check_result(r)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
            self._skip("result", row.id, e)
            return None
        return r.against(software)

    def _results(self, session: Session, stmt: Any, software: SoftwareInfo) -> list[Result]:
        out = [self._result(row, software) for row in session.scalars(stmt).unique()]
        return sorted((r for r in out if r is not None), key=sort_key)

    @staticmethod
    def _select(device: DeviceInfo | None = None, software: SoftwareInfo | None = None,
                key: ProblemKey | None = None) -> Any:
        """Results of ``device``, fresh under ``software`` (its code fields), of ``key``."""
        return ResultRow.find(device, software, key)

    def _fresh(self, device: DeviceInfo, software: SoftwareInfo, key: ProblemKey | None = None,
               *, failed: bool = False) -> dict[ProblemKey, Result]:
        """The fresh results by key, servable ones (or with ``failed``, failed ones); of
        two for one key, the trusted, then the faster (see :class:`Storage`)."""
        with self._session() as s:
            found = self._results(s, self._select(device, software, key), software)
        out: dict[ProblemKey, Result] = {}
        for r in sorted(found, key=lambda r: (not r.trusted, r.median_ms)):
            if r.servable != failed and not r.stale:
                out.setdefault(r.key, r)
        return out

    # -- writes -------------------------------------------------------------------------

    def _ids(self, s: Session, device: DeviceInfo, software: SoftwareInfo,
             key: ProblemKey) -> tuple[int, int, int]:
        c = self._ids_cache
        dev = _row_id(s, Device, {"fingerprint": device.fingerprint},
                      {"fingerprint": device.fingerprint, **device.as_dict()}, c)
        sw = _row_id(s, Software, {"fingerprint": software.fingerprint},
                     {"fingerprint": software.fingerprint, "triton": software.triton,
                      "ptxas": software.ptxas, "kernels_hash": software.kernels_hash}, c)
        prob = _row_id(s, ProblemRow, key.as_dict(), key.as_dict(), c)
        return dev, sw, prob

    def _put(self, s: Session, r: Result, prefer: str) -> str:
        dev, sw, prob = self._ids(s, r.device, r.software, r.key)
        ids = {"device_id": dev, "software_id": sw, "problem_id": prob}
        values = {
            "config_json": json.dumps(r.config, sort_keys=True),
            "example_json": None if r.problem is None
            else json.dumps(r.problem.as_dict(), sort_keys=True),
            "median_ms": r.median_ms, "p20_ms": r.p20_ms, "p80_ms": r.p80_ms,
            "tflops": r.tflops, "max_error": r.max_error, "trials": r.trials,
            "search_seconds": r.search_seconds, "host": r.host,
            "created_at": datetime.fromisoformat(r.created_at),
            "flashtune_version": r.flashtune_version, "torch": r.software.torch,
            "cuda": r.software.cuda, "origin": r.origin, "verify": r.verify,
            "verified_at": None if r.verified_at is None else _iso_utc(r.verified_at),
        }
        find = ResultRow.by_ids(**ids)
        row = s.scalars(find).one_or_none()
        if row is None:
            done = s.execute(_insert(s, ResultRow).values(**ids, **values)
                             .on_conflict_do_nothing())
            if done.rowcount:  # type: ignore[attr-defined]
                return "added"
            row = s.scalars(find).one()  # a concurrent writer inserted it first
        # A measurement made here replaces what no one here measured or verified, whatever
        # it claimed; and under "faster" a claim no one here checked never replaces one
        # that was: an import can neither block nor displace a real result.
        stored_trusted = row.origin == "local" or row.verify == "passed"
        if r.origin == "local" and not stored_trusted:
            pass
        elif prefer == "ours" or (prefer == "faster" and (
                row.median_ms <= r.median_ms or (stored_trusted and not r.trusted))):
            return "kept"
        for name, value in values.items():
            setattr(row, name, value)
        s.flush()
        return "replaced"

    def put_results(self, results: Iterable[Result], *, prefer: str = "faster") -> list[str]:
        if prefer not in PREFER:
            raise ValueError(f"prefer must be one of {PREFER}, got {prefer!r}")
        checked = [check_result(r) for r in results]
        with self._session(write=True) as s:
            outcomes = [self._put(s, r, prefer) for r in checked]
        written(self.url, [r for r, o in zip(checked, outcomes, strict=True) if o != "kept"])
        return outcomes

    def record_misses(self, device: DeviceInfo, software: SoftwareInfo,
                      misses: dict[ProblemKey, tuple[int, Problem]]) -> None:
        now = datetime.now(timezone.utc)
        with self._session(write=True) as s:
            for key, (count, problem) in sorted(misses.items()):
                dev, sw, prob = self._ids(s, device, software, key)
                where = {"device_id": dev, "problem_id": prob}
                values = {"software_id": sw, "last_seen": now,
                          "example_json": json.dumps(problem.as_dict(), sort_keys=True)}
                s.execute(_insert(s, MissRow).values(**where, **values, count=0)
                          .on_conflict_do_nothing())
                s.execute(update(MissRow).filter_by(**where)
                          .values(count=MissRow.count + int(count), **values))

    # -- reads --------------------------------------------------------------------------

    def get_result(self, device: DeviceInfo, software: SoftwareInfo,
                   key: ProblemKey) -> Result | None:
        return self._fresh(device, software, key).get(key)

    def load_table(self, device: DeviceInfo, software: SoftwareInfo) -> dict[ProblemKey, Result]:
        return self._fresh(device, software)

    def failed(self, device: DeviceInfo, software: SoftwareInfo) -> dict[ProblemKey, Result]:
        return self._fresh(device, software, failed=True)

    def set_verify(self, result: Result, outcome: str, *, median_ms: float | None = None,
                   p20_ms: float | None = None, p80_ms: float | None = None,
                   max_error: float | None = None) -> None:
        if outcome not in ("passed", "failed"):
            raise ValueError(f"outcome must be 'passed' or 'failed', got {outcome!r}")
        now = datetime.now(timezone.utc).isoformat(timespec="microseconds")
        r = replace(result, verify=outcome, verified_at=now)
        if median_ms is not None and p20_ms is not None and p80_ms is not None:
            flops = r.tflops * r.median_ms * 1e9  # the FLOPs the stored claim counts
            r = replace(r, median_ms=median_ms, p20_ms=min(p20_ms, median_ms),
                        p80_ms=max(p80_ms, median_ms), tflops=flops / (median_ms * 1e9))
        if max_error is not None:
            r = replace(r, max_error=max_error)
        check_result(r)
        with self._session(write=True) as s:
            self._put(s, r, "theirs")

    def results(self, *, device: str | None = None, include_stale: bool = True,
                software: SoftwareInfo | None = None) -> list[Result]:
        sw = software or software_info()
        with self._session() as s:
            found = self._results(s, self._select(software=None if include_stale else sw), sw)
        return [r for r in found if (device is None or r.device.matches(device))
                and (include_stale or not r.stale)]

    def misses(self, device: str | None = None) -> list[tuple[ProblemKey, int, Problem]]:
        total: dict[ProblemKey, list[Any]] = {}
        with self._session() as s:
            rows = s.scalars(select(MissRow).order_by(MissRow.last_seen)).unique().all()
            for row in rows:
                try:
                    self._check_parents(row)
                    dev, key = row.device.info(), row.problem.key()
                    example = check_miss(dev, key, row.count, json.loads(row.example_json))
                    if not isinstance(row.last_seen, datetime):
                        raise ValueError(f"last_seen is not a time: {str(row.last_seen)[:40]!r}")
                except (ValueError, TypeError, KeyError, AttributeError) as e:
                    self._skip("miss", row.id, e)
                    continue
                if device is not None and not dev.matches(device):
                    continue
                acc = total.setdefault(key, [0, example])
                acc[0] += row.count
                acc[1] = example  # the most recent example wins
        return sorted(((k, c, p) for k, (c, p) in total.items()), key=lambda t: (-t[1], t[0]))

