"""The tables of the tuning database (SQLAlchemy 2.x typed models).

Every table is prefixed ``ft_``: Optuna keeps its study tables (and its own Alembic
version table) in the same database. Unique constraints mirror the keys: a device
and a software environment by fingerprint, a problem by every :class:`ProblemKey`
field, a result by (device, software, problem), a miss by (device, problem), a sweep's
task by (sweep, task digest).

Schema changes are Alembic migrations in ``migrations/versions``; these models must
always equal the newest migration (a test compares them).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Double,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Select,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    select,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from flashtune.db.fingerprint import UNRECORDED, DeviceInfo, SoftwareInfo
from flashtune.problem import ProblemKey

VERSION_TABLE = "flashtune_alembic_version"
SCHEMA_REVISION = "0003"
"""The newest migration: a database at it opens without loading Alembic (a test checks)."""
READABLE_REVISIONS = frozenset({SCHEMA_REVISION})
"""Revisions whose result tables equal the newest: a read-only open (the dispatcher's)
serves them as they are. 0003 changed the key, the software table and the results, so an
older database must be opened once for writing (any ``autotune`` command does it)."""
_NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Timestamp(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` whose read never raises: SQLite stores any value in any
    column, and a cell that is not a time ('yesterday') comes back as it is stored, for the
    reader to reject with its row (the driver's own parser would fail the whole query)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def result_processor(self, dialect: Any, coltype: Any) -> Any:
        parse = self.impl_instance.result_processor(dialect, coltype)
        if parse is None:
            return None

        def process(value: Any) -> Any:
            try:
                return parse(value)
            except (ValueError, TypeError, OverflowError):
                return value
        return process


class Flag(TypeDecorator[bool]):
    """``Boolean`` that reads only 0 and 1 as False and True: any other stored value
    ('garbage', 7) comes back as it is, for the reader to reject (SQLAlchemy's own
    conversion would read both as True)."""

    impl = Boolean
    cache_ok = True

    def result_processor(self, dialect: Any, coltype: Any) -> Any:
        def process(value: Any) -> Any:
            if isinstance(value, (bool, int)) and value in (0, 1):
                return bool(value)
            return value
        return process


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=_NAMING)

    @classmethod
    def id_where(cls, **where: Any) -> Select[Any]:
        """Finder: the id of the row whose columns equal ``where`` (a unique key)."""
        return select(cls.__table__.c.id).filter_by(**where)  # type: ignore[attr-defined]


class _Fingerprinted:
    """A row found by its fingerprint (the hash of the other columns)."""

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(32), unique=True)


class Device(_Fingerprinted, Base):
    __tablename__ = "ft_devices"

    name: Mapped[str] = mapped_column(String(200))
    capability: Mapped[str] = mapped_column(String(32))
    sm_count: Mapped[int] = mapped_column(Integer)
    memory_gb: Mapped[int] = mapped_column(Integer)

    def info(self) -> DeviceInfo:
        return DeviceInfo(name=self.name, capability=self.capability, sm_count=self.sm_count,
                          memory_gb=self.memory_gb)


class Software(_Fingerprinted, Base):
    """What changes the generated code; torch and CUDA are provenance, on each result."""

    __tablename__ = "ft_software"

    triton: Mapped[str] = mapped_column(String(128))
    ptxas: Mapped[str] = mapped_column(String(128))  # "": not recorded (flashtune <= 0.1)
    kernels_hash: Mapped[str] = mapped_column(String(128))

    def info(self, torch: str, cuda: str) -> SoftwareInfo:
        return SoftwareInfo(torch=torch, triton=self.triton, cuda=cuda,
                            kernels_hash=self.kernels_hash, ptxas=self.ptxas)


KEY_COLUMNS = tuple(ProblemKey.__dataclass_fields__)


class ProblemRow(Base):
    __tablename__ = "ft_problems"
    __table_args__ = (UniqueConstraint(*KEY_COLUMNS, name="uq_ft_problems_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    direction: Mapped[str] = mapped_column(String(8))
    dtype: Mapped[str] = mapped_column(String(16))
    head_dim: Mapped[int] = mapped_column(Integer)
    causal: Mapped[bool] = mapped_column(Flag)
    window: Mapped[bool] = mapped_column(Flag)
    softcap: Mapped[bool] = mapped_column(Flag)
    gqa_ratio: Mapped[int] = mapped_column(Integer)
    bh_bucket: Mapped[int] = mapped_column(Integer)
    sq_bucket: Mapped[int] = mapped_column(Integer)
    sk_bucket: Mapped[int] = mapped_column(Integer)
    deterministic: Mapped[bool] = mapped_column(Boolean)
    packed: Mapped[bool] = mapped_column(Boolean)
    tokens_bucket: Mapped[int] = mapped_column(Integer)

    def key(self) -> ProblemKey:
        return ProblemKey(**{c: getattr(self, c) for c in KEY_COLUMNS})


class ResultRow(Base):
    __tablename__ = "ft_results"
    __table_args__ = (UniqueConstraint("device_id", "software_id", "problem_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"))
    software_id: Mapped[int] = mapped_column(ForeignKey("ft_software.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"))
    config_json: Mapped[str] = mapped_column(Text)
    example_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    median_ms: Mapped[float] = mapped_column(Double)
    p20_ms: Mapped[float] = mapped_column(Double)
    p80_ms: Mapped[float] = mapped_column(Double)
    tflops: Mapped[float] = mapped_column(Double)
    max_error: Mapped[float] = mapped_column(Double)
    trials: Mapped[int] = mapped_column(Integer)
    search_seconds: Mapped[float] = mapped_column(Double)
    host: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(Timestamp)
    flashtune_version: Mapped[str] = mapped_column(String(64))
    torch: Mapped[str] = mapped_column(String(128))  # provenance
    cuda: Mapped[str] = mapped_column(String(128))  # provenance
    origin: Mapped[str] = mapped_column(String(16))  # storage.ORIGINS
    verify: Mapped[str] = mapped_column(String(16))  # storage.VERIFY_STATES
    # ISO-8601 UTC text, parsed when read: one unreadable cell must cost its row only.
    verified_at: Mapped[str | None] = mapped_column(String(64), nullable=True)

    device: Mapped[Device] = relationship(lazy="joined", innerjoin=True)
    software: Mapped[Software] = relationship(lazy="joined", innerjoin=True)
    problem: Mapped[ProblemRow] = relationship(lazy="joined", innerjoin=True)

    @classmethod
    def find(cls, device: DeviceInfo | None = None, software: SoftwareInfo | None = None,
             key: ProblemKey | None = None) -> Select[Any]:
        """Finder: the results of ``device``, fresh under ``software`` (its code fields: the
        kernel sources, Triton, and ptxas where both sides recorded it), of ``key``; None
        leaves that side open. Without a key, a backward result under the forward's own
        hash passes the filter: read it through :meth:`Result.against`."""
        stmt = select(cls).join(cls.device).join(cls.software).join(cls.problem)
        if device is not None:
            stmt = stmt.where(Device.fingerprint == device.fingerprint)
        if software is not None:
            hashes = software.fresh_hashes(None if key is None else key.direction)
            stmt = stmt.where(Software.triton == software.triton,
                              Software.kernels_hash.in_(hashes))
            if software.ptxas != UNRECORDED:
                stmt = stmt.where(Software.ptxas.in_([software.ptxas, UNRECORDED]))
        if key is not None:
            stmt = stmt.filter_by(**key.as_dict())
        return stmt

    @classmethod
    def by_ids(cls, device_id: int, software_id: int, problem_id: int) -> Select[Any]:
        """Finder: the one result of a (device, software, problem) triple, locked for update."""
        return select(cls).filter_by(device_id=device_id, software_id=software_id,
                                     problem_id=problem_id).with_for_update()


class MissRow(Base):
    __tablename__ = "ft_misses"
    __table_args__ = (UniqueConstraint("device_id", "problem_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"))
    software_id: Mapped[int] = mapped_column(ForeignKey("ft_software.id"))
    count: Mapped[int] = mapped_column(BigInteger)
    example_json: Mapped[str] = mapped_column(Text)
    last_seen: Mapped[datetime] = mapped_column(Timestamp)

    device: Mapped[Device] = relationship(lazy="joined", innerjoin=True)
    problem: Mapped[ProblemRow] = relationship(lazy="joined", innerjoin=True)


class SweepRow(Base):
    """One sweep (:mod:`flashtune.db.claims`): its id is a digest of what it tunes."""

    __tablename__ = "ft_sweeps"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    device_json: Mapped[str] = mapped_column(Text)
    software_fingerprint: Mapped[str] = mapped_column(String(32))
    trials: Mapped[int | None] = mapped_column(Integer, nullable=True)
    total: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)  # seconds since the epoch


class ClaimRow(Base):
    """One task of a sweep: a (problem key, direction) and who holds it until when."""

    __tablename__ = "ft_sweep_claims"
    __table_args__ = (UniqueConstraint("sweep_id", "task", name="uq_ft_sweep_claims_task"),
                      Index("ix_ft_sweep_claims_state", "sweep_id", "state", "seq"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sweep_id: Mapped[str] = mapped_column(String(32))
    task: Mapped[str] = mapped_column(String(32))  # digest of the problem key
    seq: Mapped[int] = mapped_column(Integer)  # order in the shape set
    direction: Mapped[str] = mapped_column(String(3))
    key_json: Mapped[str] = mapped_column(Text)
    problem_json: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(8))
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    lease_expires: Mapped[float | None] = mapped_column(Float, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer)
    trials: Mapped[int | None] = mapped_column(Integer, nullable=True)
    best_tflops: Mapped[float | None] = mapped_column(Float, nullable=True)
    median_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    note: Mapped[str | None] = mapped_column(Text, nullable=True)  # a failure, "cached", ...
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
