"""The storage contract of the tuning database: :class:`Result` and :class:`Storage`.

The contract only: :func:`flashtune.db.open_storage` opens the SQLAlchemy implementation
(:mod:`flashtune.db.rdb`). This module imports no database driver.
"""

from __future__ import annotations

import abc
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from flashtune._version import __version__
from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo, stale_fields
from flashtune.problem import Problem, ProblemKey

PREFER = ("faster", "ours", "theirs")
WriteListener = Callable[[str, "list[Result]"], None]
_write_listeners: list[WriteListener] = []


def on_write(listener: WriteListener) -> None:
    """Call ``listener(url, results)`` after results were written to the database at ``url``
    by this process (the dispatcher serves them from then on). Once per listener."""
    if listener not in _write_listeners:
        _write_listeners.append(listener)


def written(url: str, results: list[Result]) -> None:
    """Tell the listeners (:func:`on_write`) what a committed write stored. A listener
    that fails is logged, never the writer's failure."""
    if not results:
        return
    for listener in list(_write_listeners):
        try:
            listener(url, results)
        except Exception:  # the write is done; a stale cache must not turn it into an error
            import logging

            logging.getLogger("flashtune.db").exception("write listener %r failed", listener)


ORIGINS = ("local", "imported", "shipped", "unknown")
"""Where a stored result comes from: measured by a tune writing to this database, an
import, a copy of the shipped layer (written by ``autotune verify``), or a database of
flashtune <= 0.1 (which did not record it)."""
VERIFY_STATES = ("unverified", "passed", "failed")
"""What ``autotune verify`` found when it re-gated the result: a failed one is never served."""


@dataclass(frozen=True)
class Result:
    """One tuned config for (device, software, problem key), with its measurements.

    ``stale`` is True when ``software`` differs in a code field (kernel sources, Triton,
    ptxas: :func:`~flashtune.db.fingerprint.stale_fields`) from the software the result
    was read against (by default the running process's :func:`software_info`).
    ``origin`` is one of :data:`ORIGINS`; ``verify`` one of :data:`VERIFY_STATES`, with
    ``verified_at`` the time of that outcome (None: never verified).
    """

    device: DeviceInfo
    software: SoftwareInfo
    key: ProblemKey
    problem: Problem | None
    config: dict[str, Any]
    median_ms: float
    p20_ms: float
    p80_ms: float
    tflops: float
    max_error: float
    trials: int
    search_seconds: float
    host: str
    created_at: str
    flashtune_version: str
    # Where the result stands in the database that holds it, not its content: equality
    # ignores these (an exported and re-imported result equals the original).
    origin: str = field(default="local", compare=False)
    verify: str = field(default="unverified", compare=False)
    verified_at: str | None = field(default=None, compare=False)
    stale: bool = field(default=False, compare=False)

    @property
    def direction(self) -> str:
        return self.key.direction

    @property
    def trusted(self) -> bool:
        """Measured into this database, or verified here: an import cannot displace it
        without being faster (see :class:`Storage`, Writes)."""
        return self.origin == "local" or self.verify == "passed"

    @property
    def servable(self) -> bool:
        """Not failed by ``autotune verify`` (staleness aside)."""
        return self.verify != "failed"

    def against(self, software: SoftwareInfo) -> Result:
        """This result with ``stale`` computed against ``software``."""
        stale = bool(stale_fields(self.software, software, self.key.direction))
        return self if stale == self.stale else replace(self, stale=stale)


def nearest_results(table: Mapping[ProblemKey, Result], key: ProblemKey,
                    n: int) -> list[Result]:
    """Up to ``n`` results of ``table`` (by key) closest to ``key`` by
    :meth:`ProblemKey.distance` (finite only; the exact key first, if present), ties broken
    by ``median_ms``."""
    ranked = sorted((t for t in ((k.distance(key), r.median_ms, k, r)
                                 for k, r in table.items()) if t[0] != float("inf")),
                    key=lambda t: t[:3])
    return [r for *_, r in ranked[:n]]


class Storage(abc.ABC):
    """The tuning database, as the tuner, the dispatcher and the CLI use it.

    Keys. A result is stored under (device, software, problem key); at most one result
    per triple. ``device`` and ``software`` are :class:`DeviceInfo` / :class:`SoftwareInfo`
    (rows are created on first use); ``key`` is a :class:`ProblemKey`.

    Staleness. A result whose software differs in a code field (kernel sources, Triton,
    ptxas; not torch or CUDA) from the software it is read against is *stale*: it is kept
    and counted (:meth:`counts`), returned by :meth:`results` with ``stale=True`` and
    offered by :meth:`seeds`, but never returned by :meth:`get_result` or
    :meth:`load_table`, which serve only fresh results. Neither serves a result that
    ``autotune verify`` failed (``verify == "failed"``). Where two fresh results hold one
    key (a result of flashtune <= 0.1 without a ptxas version, and a newer one), the
    trusted one (:attr:`Result.trusted`) wins, then the faster.

    Writes. Every write is one transaction: it all happens or none of it does, and
    concurrent writers (threads, processes, hosts on one PostgreSQL server) never see
    a half-written state. Conflicts on one triple are settled by ``prefer``:
    ``"faster"`` keeps the lower ``median_ms`` (ties keep the stored one), ``"ours"``
    keeps the stored result, ``"theirs"`` takes the new one. Trust comes first: a result
    measured here (``origin="local"``) replaces a stored result that is not trusted
    (:attr:`Result.trusted`: imported, shipped or of unknown origin, and not verified
    here), whatever that one claimed; and under ``"faster"`` an untrusted result never
    replaces a trusted one. An import can neither block nor displace a measurement.

    Values. ``config`` must be a valid config of the key's direction (unknown fields
    or values outside a knob's choices raise ``ValueError``); it is stored in full,
    with defaults filled in. Timings are milliseconds, finite and ``p20 <= median <=
    p80``; violations raise ``ValueError`` and nothing is written.

    Errors. Any failure to open, read or write raises a subclass of
    :class:`flashtune.exceptions.StorageError` whose message is one line naming the
    database and what went wrong (garbage file, schema newer than this flashtune,
    locked, missing read-only database, ...); never a raw driver exception.
    """

    url: str
    read_only: bool

    # -- results ----------------------------------------------------------------------

    def put_result(self, device: DeviceInfo, software: SoftwareInfo, key: ProblemKey,
                   config: dict[str, Any], *, median_ms: float, p20_ms: float,
                   p80_ms: float, tflops: float, max_error: float, trials: int,
                   search_seconds: float, problem: Problem | None = None,
                   prefer: str = "faster") -> bool:
        """Store one result measured here (provenance: this host, now, this flashtune;
        ``origin="local"``); True if written."""
        host, created_at, version = provenance()
        r = Result(device=device, software=software.for_direction(key.direction), key=key,
                   problem=problem,
                   config=dict(config), median_ms=median_ms, p20_ms=p20_ms, p80_ms=p80_ms,
                   tflops=tflops, max_error=max_error, trials=trials,
                   search_seconds=search_seconds, host=host, created_at=created_at,
                   flashtune_version=version)
        return self.put_results([r], prefer=prefer)[0] != "kept"

    @abc.abstractmethod
    def put_results(self, results: Iterable[Result], *, prefer: str = "faster") -> list[str]:
        """Store many results in ONE transaction, keeping their provenance.

        Returns one outcome per result: ``"added"``, ``"replaced"`` or ``"kept"`` (the
        stored result won). Any invalid result raises before anything is written.
        """

    @abc.abstractmethod
    def get_result(self, device: DeviceInfo, software: SoftwareInfo,
                   key: ProblemKey) -> Result | None:
        """The fresh result for exactly (device, software, key), or None."""

    @abc.abstractmethod
    def load_table(self, device: DeviceInfo, software: SoftwareInfo) -> dict[ProblemKey, Result]:
        """Every fresh, servable result of ``device`` under ``software``, by key, in one
        query."""

    @abc.abstractmethod
    def failed(self, device: DeviceInfo, software: SoftwareInfo) -> dict[ProblemKey, Result]:
        """The fresh results of ``device`` that ``autotune verify`` failed, by key (the
        dispatcher also drops a shipped entry with the same config)."""

    @abc.abstractmethod
    def set_verify(self, result: Result, outcome: str, *, median_ms: float | None = None,
                   p20_ms: float | None = None, p80_ms: float | None = None,
                   max_error: float | None = None) -> None:
        """Record ``autotune verify``'s outcome ("passed" or "failed") for ``result`` (by
        its device, software and key), and on a pass the re-timed times and measured error.
        A result not stored yet (a shipped one) is added with ``origin="shipped"``."""

    @abc.abstractmethod
    def results(self, *, device: str | None = None, include_stale: bool = True,
                software: SoftwareInfo | None = None) -> list[Result]:
        """All results, sorted by (device, software, key).

        ``device`` filters by fingerprint or by part of the device name (any case).
        ``stale`` is computed against ``software`` (default: :func:`software_info`);
        ``include_stale=False`` drops stale results.
        """

    def nearest(self, device: DeviceInfo, software: SoftwareInfo, key: ProblemKey,
                n: int = 1) -> list[Result]:
        """Up to ``n`` fresh results on ``device`` closest to ``key`` by
        :meth:`ProblemKey.distance` (finite only; the exact key first, if present),
        ties broken by ``median_ms``."""
        return nearest_results(self.load_table(device, software), key, n)

    def seeds(self, device: DeviceInfo, key: ProblemKey, software: SoftwareInfo,
              *, n_nearest: int = 3) -> list[Result]:
        """Warm-start seeds for tuning ``key`` on ``device`` under ``software``, best first:
        the key's stale results on this device, then the key's results on other devices
        (any software), then the :meth:`nearest` fresh results on this device."""
        same_key = [r for r in self.results(software=software) if r.key == key]
        here = device.fingerprint
        stale_here = [r for r in same_key if r.device.fingerprint == here and r.stale]
        elsewhere = [r for r in same_key if r.device.fingerprint != here]
        by_speed = lambda r: r.median_ms  # noqa: E731
        return (sorted(stale_here, key=by_speed) + sorted(elsewhere, key=by_speed)
                + self.nearest(device, software, key, n_nearest))

    # -- misses -----------------------------------------------------------------------

    @abc.abstractmethod
    def record_misses(self, device: DeviceInfo, software: SoftwareInfo,
                      misses: dict[ProblemKey, tuple[int, Problem]]) -> None:
        """Add dispatcher misses: per key, a count to add and one example problem."""

    @abc.abstractmethod
    def misses(self, device: str | None = None) -> list[tuple[ProblemKey, int, Problem]]:
        """Recorded misses (device filter as in :meth:`results`), summed over devices per
        key, most frequent first."""

    # -- bookkeeping ------------------------------------------------------------------

    def counts(self, software: SoftwareInfo | None = None) -> dict[str, Any]:
        """``{"entries": n, "stale": n, "misses": n, "devices": {fingerprint: {"name",
        "entries", "stale"}}}``, staleness against ``software`` (default: current)."""
        out: dict[str, Any] = {"entries": 0, "stale": 0, "devices": {}}
        for r in self.results(software=software):
            d = out["devices"].setdefault(r.device.fingerprint,
                                          {"name": r.device.name, "entries": 0, "stale": 0})
            for bucket in (out, d):
                bucket["entries"] += 1
                bucket["stale"] += int(r.stale)
        out["misses"] = sum(c for _, c, _ in self.misses())
        return out

    engine: Any
    """The SQLAlchemy engine of the database (every storage is relational: SQLite or
    PostgreSQL), for what lives in other tables of it: Optuna's studies, the sweep's task
    claims."""

    @abc.abstractmethod
    def check_writable(self) -> None:
        """Raise StorageError unless this storage may be written (it was not opened
        read-only, and its file is still the one opened). Callers that also write through
        another engine (Optuna's study) check first."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. The storage must not be used afterwards."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def provenance() -> tuple[str, str, str]:
    """(host, now as ISO-8601 UTC, flashtune version): who stored a result, and when."""
    now = datetime.now(timezone.utc).isoformat(timespec="microseconds")
    return socket.gethostname(), now, __version__
