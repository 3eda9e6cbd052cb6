"""The lookup ladder over one device's table: tuned, nearest, default.

The table holds the fresh results of one device, the user database's layer over the
shipped package layer, with their configs parsed. Loading it never raises: a database
that cannot be used gives one warning per process and an empty user layer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flashtune._env import database_url
from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo, software_info
from flashtune.dispatch._state import Config, counters, warn_once
from flashtune.exceptions import StorageError
from flashtune.kernels.config import (
    HOST_BOUND_SCORES,
    check,
    config_from_dict,
    default_config,
    for_nondeterministic_call,
    host_bound,
)
from flashtune.problem import Problem, ProblemKey

if TYPE_CHECKING:
    from flashtune.db.storage import Result

READ_BUSY_TIMEOUT_S = 2.0  # how long the dispatcher waits on a locked database
LAYER_RANK = {"user": 0, "shipped": 1}
log = logging.getLogger("flashtune.dispatch")


@dataclass(frozen=True)
class Choice:
    """One direction's decision: the config, where it came from, and the entry behind it."""

    config: Config
    source: str  # "tuned" | "nearest" | "default"
    key: ProblemKey  # the key asked for (the entry's key may differ: see ``entry.key``)
    entry: Result | None = None
    layer: str | None = None  # "user" | "shipped" | None


@dataclass
class Entry:
    result: Result
    layer: str
    config: Config


class Table:
    """The fresh results of one device, user layer over shipped layer, configs parsed."""

    def __init__(self, device: DeviceInfo, entries: dict[ProblemKey, Entry],
                 database: str | None = None, error: str | None = None) -> None:
        self.device = device
        self.entries = entries
        self.database = database
        self.error = error
        self.families: dict[tuple[Any, ...], list[ProblemKey]] = {}
        for key in entries:
            self.families.setdefault(key.family(), []).append(key)

    def add(self, entry: Entry) -> None:
        key = entry.result.key
        if key not in self.entries:
            self.families.setdefault(key.family(), []).append(key)
        self.entries[key] = entry

    def choose(self, problem: Problem, direction: str) -> Choice:
        key = problem.key(direction)
        hit = self.entries.get(key)
        if hit is not None and feasible(hit.config, problem):
            return Choice(hit.config, "tuned", key, hit.result, hit.layer)
        small = host_bound(problem)
        ranked = sorted(
            (k.distance(key), LAYER_RANK[self.entries[k].layer],
             self.entries[k].result.median_ms, k)
            for k in self.families.get(key.family(), ())
            if k != key and entry_host_bound(self.entries[k].result) == small)
        for dist, _, _, k in ranked:
            e = self.entries[k]
            cfg = e.config
            if k.deterministic and not key.deterministic:
                cfg = for_nondeterministic_call(cfg)  # runs as it was timed
            if dist != float("inf") and feasible(cfg, problem):
                return Choice(cfg, "nearest", key, e.result, e.layer)
        return Choice(default_config(direction, problem), "default", key)


def entry_host_bound(r: Result) -> bool:
    """Whether the problem ``r`` was tuned on is host-bound (:func:`host_bound`; from its
    key's buckets, which round up, when the entry has no example problem). A nearest entry
    never crosses that line: a config tuned where the kernel's time decides (the Hopper
    kernels, whose launches cost more host time) is no guide where host time decides,
    and the other way round; the heuristic default is built for both sides."""
    if r.problem is not None:
        return host_bound(r.problem)
    k = r.key
    return k.bh_bucket * k.sq_bucket * k.sk_bucket < HOST_BOUND_SCORES


def feasible(cfg: Config, problem: Problem) -> bool:
    try:
        check(cfg, problem)
    except ValueError:
        return False
    return True


def parse(r: Result, layer: str) -> Entry | None:
    try:
        return Entry(r, layer, config_from_dict(r.key.direction, r.config))
    except (ValueError, TypeError) as e:
        log.warning("flashtune: skipping the %s entry for %s: %s", layer, r.key.short(), e)
        return None


def load_table(device: DeviceInfo, url: str | None = None) -> Table:
    """``device``'s table: the shipped layer under the user database at ``url`` (default:
    the one the dispatcher uses, ``FLASHTUNE_DB`` or the default place)."""
    counters["table_loads"] += 1
    sw = software_info()
    entries: dict[ProblemKey, Entry] = {}
    try:
        from flashtune.db.exchange import shipped_results

        index(entries, ((r, "shipped") for r in shipped_results(sw)
                         if not r.stale and r.device.fingerprint == device.fingerprint))
    except Exception as e:  # the shipped layer is optional; never fatal
        warn_once("shipped", f"flashtune: cannot read the shipped tuning data ({e}); "
                   "ignoring it")
    url, user, failed, error = read_user(device, sw, url)
    for key, r in failed.items():  # `autotune verify` failed this config here: never serve it
        shipped = entries.get(key)
        if shipped is not None and dict(shipped.result.config) == dict(r.config):
            del entries[key]
    index(entries, ((r, "user") for r in user.values()))  # over the shipped layer
    return Table(device, entries, url, error)


def index(entries: dict[ProblemKey, Entry], results: Iterable[tuple[Result, str]]) -> None:
    for r, layer in results:
        parsed = parse(r, layer)
        if parsed is not None:
            entries[r.key] = parsed


def read_user(device: DeviceInfo, sw: SoftwareInfo, url: str | None = None) -> tuple[
        str, dict[ProblemKey, Result], dict[ProblemKey, Result], str | None]:
    """(database, its fresh servable results for ``device``, its fresh results that
    ``autotune verify`` failed, the error that made it unusable). ``url``: a database a
    command names (a missing one holds nothing yet); None: the dispatcher's own."""
    from flashtune.db import resolve_url

    named = url is not None
    url = url if named else database_url()
    where = resolve_url(url)
    counters["db_reads"] += 1
    try:
        from flashtune.db import open_storage
        from flashtune.exceptions import DatabaseMissingError, SchemaOutdatedError

        try:
            # A locked database must not stall a training step for SQLite's 30 s default.
            storage = open_storage(url, read_only=True, busy_timeout=READ_BUSY_TIMEOUT_S)
        except DatabaseMissingError as e:
            if url is None or named:  # none yet at the default place (a first run), or
                # at the place a command named: nothing tuned there
                log.info("flashtune: %s; using the shipped configs and heuristics", e)
                return where, {}, {}, None
            raise
        except SchemaOutdatedError:
            # A database of an older flashtune: upgrade it once (one locked transaction,
            # the same as any autotune command's open), so that an upgrade loses no results.
            log.info("flashtune: upgrading the tuning database %s to this schema", where)
            open_storage(url, busy_timeout=READ_BUSY_TIMEOUT_S).close()
            storage = open_storage(url, read_only=True, busy_timeout=READ_BUSY_TIMEOUT_S)
        try:
            return where, storage.load_table(device, sw), storage.failed(device, sw), None
        finally:
            storage.close()
    except Exception as e:  # StorageError, or anything a broken install throws: never fatal
        what = str(e) if isinstance(e, StorageError) else f"{type(e).__name__}: {e}"
        warn_once(f"db:{where}", f"flashtune: cannot use the tuning database ({what}); "
                   "using the shipped configs and heuristics. Training goes on.")
        return where, {}, {}, what
