"""The runtime dispatcher: which config runs each ``flashtune.flash_attention`` call.

Importing this module installs :func:`resolve` as the kernels' config resolver (see
:func:`flashtune.kernels.attention.set_config_resolver`); ``flashtune.flash_attention``
imports it, ``flashtune.kernels.attention.flash_attention`` does not.

The ladder, per direction (fwd/bwd) and call:

1. the problem key, :meth:`flashtune._problem.Problem.key`, the one the tuner stores under;
2. **tuned**: a fresh result for exactly that key on this device, from the per-process
   table (the user's database over the shipped package layer);
3. **nearest**: else the closest tuned bucket of the same device, dtype, head dim and
   mask kind (:meth:`ProblemKey.distance`; ties: user layer, then faster);
4. **default**: else the heuristic default of :mod:`flashtune.kernels.config`.

Hot path. A dict keyed by a tuple of the tensors' shapes and flags holds the chosen
config; only the first call of a shape builds a :class:`Problem` and walks the ladder.
The table is loaded once per process and device, on the first call (or
:func:`preload`), never during CUDA-graph capture or ``torch.compile`` tracing: a
first sight there is served from memory (heuristic default if no table is loaded yet,
and not remembered).

Misses (steps 3 and 4) are logged once per process per key, and recorded in the user
database's misses table in batches by a background thread (one count per process and
concrete shape). ``FLASHTUNE_STRICT=1`` raises :class:`DispatchMissError` instead.
``FLASHTUNE_TUNE_ON_MISS=1`` runs the tuner with a small budget
(``FLASHTUNE_TUNE_TRIALS``, default 8) on a miss, outside capture and compilation.

Failures. A database that is missing, unreadable, corrupt, locked or of another
schema gives one warning per process, then the shipped layer and the heuristics.

Distributed. When ``torch.distributed`` is initialized with more than one rank, rank 0
publishes its table through the process group's key-value store and the other ranks
use it, so every rank decides alike; with online tuning, rank 0 tunes and publishes
the result. Rank 0 never waits for the others; they wait for rank 0 at most
``FLASHTUNE_DIST_TIMEOUT`` seconds (default 300), then decide locally with a warning.
``FLASHTUNE_DIST_SYNC=0`` turns this off.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import pickle
import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from flashtune._problem import Problem, ProblemKey
from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo, device_info, software_info
from flashtune.exceptions import DispatchMissError, StorageError
from flashtune.kernels import attention as _attention
from flashtune.kernels.config import (
    BwdConfig,
    FwdConfig,
    check,
    config_from_dict,
    config_to_dict,
    default_config,
)

if TYPE_CHECKING:
    from flashtune.db.storage import Result

__all__ = ["Choice", "Explanation", "explain", "preload", "reload", "flush_misses", "stats",
           "resolve", "SOURCES"]

_READ_BUSY_TIMEOUT_S = 2.0  # how long the dispatcher waits on a locked database
log = logging.getLogger(__name__)

SOURCES = ("tuned", "nearest", "default")
_LAYER_RANK = {"user": 0, "shipped": 1}
_STORE_PREFIX = "flashtune/dispatch/"
_MISS_BATCH = 64  # pending keys that wake the recorder before its period is up
_MISS_PERIOD_S = 30.0
_EXIT_FLUSH_S = 5.0  # at most this long at interpreter exit for the last batch

Config = FwdConfig | BwdConfig


def _env_on(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# ----------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Choice:
    """One direction's decision: the config, where it came from, and the entry behind it."""

    config: Config
    source: str  # "tuned" | "nearest" | "default"
    key: ProblemKey  # the key asked for (the entry's key may differ: see ``entry.key``)
    entry: Result | None = None
    layer: str | None = None  # "user" | "shipped" | None


@dataclass
class _Entry:
    result: Result
    layer: str
    config: Config


class _Table:
    """The fresh results of one device, user layer over shipped layer, configs parsed."""

    def __init__(self, device: DeviceInfo, entries: dict[ProblemKey, _Entry],
                 database: str | None = None, error: str | None = None) -> None:
        self.device = device
        self.entries = entries
        self.database = database
        self.error = error
        self.families: dict[tuple[Any, ...], list[ProblemKey]] = {}
        for key in entries:
            self.families.setdefault(key.family(), []).append(key)

    def add(self, entry: _Entry) -> None:
        key = entry.result.key
        if key not in self.entries:
            self.families.setdefault(key.family(), []).append(key)
        self.entries[key] = entry

    def choose(self, problem: Problem, direction: str) -> Choice:
        key = problem.key(direction)
        hit = self.entries.get(key)
        if hit is not None and _feasible(hit.config, problem):
            return Choice(hit.config, "tuned", key, hit.result, hit.layer)
        ranked = sorted(
            (k.distance(key), _LAYER_RANK[self.entries[k].layer],
             self.entries[k].result.median_ms, k)
            for k in self.families.get(key.family(), ()) if k != key)
        for dist, _, _, k in ranked:
            e = self.entries[k]
            if dist != float("inf") and _feasible(e.config, problem):
                return Choice(e.config, "nearest", key, e.result, e.layer)
        return Choice(default_config(direction, problem), "default", key)


def _feasible(cfg: Config, problem: Problem) -> bool:
    try:
        check(cfg, problem)
    except ValueError:
        return False
    return True


def _parse(r: Result, layer: str) -> _Entry | None:
    try:
        return _Entry(r, layer, config_from_dict(r.key.direction, r.config))
    except (ValueError, TypeError) as e:
        log.warning("flashtune: skipping the %s entry for %s: %s", layer, r.key.short(), e)
        return None


# ----------------------------------------------------------------------------- state

_lock = threading.RLock()
_fast: dict[tuple[Any, ...], Config] = {}
_tables: dict[int, _Table] = {}  # by torch device index (-1: CPU)
_warned: set[str] = set()
_missed: set[tuple[str, ProblemKey]] = set()
_tune_tried: set[tuple[str, ProblemKey]] = set()
_stats = {"first_sights": 0, "table_loads": 0, "db_reads": 0, "misses": 0, "tunes": 0,
          "uncached": 0}


def stats() -> dict[str, int]:
    """Counters for tests and diagnostics: first sights of a shape, table loads, database
    reads, misses, online tunes, and first sights served uncached (inside capture or
    compilation with no table loaded)."""
    return dict(_stats)


def _warn_once(tag: str, message: str) -> None:
    with _lock:
        if tag in _warned:
            return
        _warned.add(tag)
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def reload() -> None:
    """Forget every table, decision and once-per-process note (after the database changed,
    or between tests), and zero :func:`stats`. Pending misses are kept."""
    with _lock:
        for name in _stats:
            _stats[name] = 0
        _fast.clear()
        _tables.clear()
        _warned.clear()
        _missed.clear()
        _tune_tried.clear()


def _in_graph() -> bool:
    """True inside torch.compile tracing or CUDA-graph capture: touch nothing outside memory."""
    if torch.compiler.is_compiling():
        return True
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


# ----------------------------------------------------------------------------- hot path


def resolve(direction: str, q: torch.Tensor, k: torch.Tensor, causal: bool,
            window: tuple[int, int], softcap: float) -> Config:
    """The config for one call (the resolver the kernels call when no config is forced)."""
    fk = (direction, q.shape, k.shape, q.dtype, q.get_device(), causal, window, softcap)
    cfg = _fast.get(fk)
    if cfg is not None:
        return cfg
    return _first_sight(fk, direction, q, k, causal, window, softcap)


def _first_sight(fk: tuple[Any, ...], direction: str, q: torch.Tensor, k: torch.Tensor,
                 causal: bool, window: tuple[int, int], softcap: float) -> Config:
    problem = Problem.from_tensors(q, k, causal=causal, window_size=window, softcap=softcap)
    in_graph = _in_graph()
    with _lock:
        _stats["first_sights"] += 1
        table = _table(q.device, load=not in_graph)
        if table is None:
            _stats["uncached"] += 1
            _warn_once("in-graph", "flashtune: first call of a shape inside CUDA-graph capture or "
                       "torch.compile tracing before the tuning table was loaded; using the "
                       "heuristic default there. Call flashtune.dispatch.preload() or run one "
                       "eager step first")
            return default_config(direction, problem)
        choice = table.choose(problem, direction)
        if choice.source != "tuned":
            choice = _on_miss(choice, problem, direction, table, in_graph)
        _fast[fk] = choice.config
        return choice.config


def _on_miss(choice: Choice, problem: Problem, direction: str, table: _Table,
             in_graph: bool) -> Choice:
    key = choice.key
    tag = (table.device.fingerprint, key)
    if _env_on("FLASHTUNE_TUNE_ON_MISS") and not in_graph and tag not in _tune_tried:
        _tune_tried.add(tag)
        tuned = _tune_on_miss(problem, direction, table)
        if tuned is not None:
            _fast.clear()  # nearest choices of other shapes may now prefer the new entry
            return table.choose(problem, direction)
    if _env_on("FLASHTUNE_STRICT"):
        near = "" if choice.entry is None else \
            f"; the nearest tuned bucket is {choice.entry.key.short()}"
        raise DispatchMissError(
            f"FLASHTUNE_STRICT=1: no tuned {direction} config for {key.short()} "
            f"(problem {problem.as_dict()}) on {table.device.name}{near}. Tune it with "
            f"`autotune tune` or `autotune sweep --from-misses`, or unset FLASHTUNE_STRICT")
    _stats["misses"] += 1
    if tag not in _missed:
        _missed.add(tag)
        log.info("flashtune: no tuned %s config for %s on %s; using the %s config %s",
                 direction, key.short(), table.device.name, choice.source,
                 config_to_dict(choice.config))
    if table.error is None and not in_graph and _records_misses():
        _recorder.add(table.device, key, problem)
    return choice


# ----------------------------------------------------------------------------- tables


def _table(device: torch.device, *, load: bool) -> _Table | None:
    index = -1 if device.type == "cpu" else (device.index if device.index is not None
                                              else torch.cuda.current_device())
    table = _tables.get(index)
    if table is None and load:
        table = _tables[index] = _sync_table(_load_table(device_info(device)))
    return table


def _load_table(device: DeviceInfo) -> _Table:
    _stats["table_loads"] += 1
    sw = software_info()
    entries: dict[ProblemKey, _Entry] = {}
    try:
        from flashtune.db.exchange import shipped_results

        _index(entries, ((r, "shipped") for r in shipped_results(sw)
                         if not r.stale and r.device.fingerprint == device.fingerprint))
    except Exception as e:  # the shipped layer is optional; never fatal
        _warn_once("shipped", f"flashtune: cannot read the shipped tuning data ({e}); "
                   "ignoring it")
    url, user, error = _read_user(device, sw)
    _index(entries, ((r, "user") for r in user.values()))  # over the shipped layer
    return _Table(device, entries, url, error)


def _index(entries: dict[ProblemKey, _Entry], results: Iterable[tuple[Result, str]]) -> None:
    for r, layer in results:
        parsed = _parse(r, layer)
        if parsed is not None:
            entries[r.key] = parsed


def _db_url() -> str | None:
    return os.environ.get("FLASHTUNE_DB") or None


def _read_user(device: DeviceInfo, sw: SoftwareInfo) -> tuple[str, dict[ProblemKey, Result],
                                                                  str | None]:
    """(database, its fresh results for ``device``, the error that made it unusable)."""
    from flashtune.db.storage import resolve_url

    url = _db_url()
    where = resolve_url(url)
    _stats["db_reads"] += 1
    try:
        from flashtune.db.storage import open_storage
        from flashtune.exceptions import DatabaseMissingError

        try:
            # A locked database must not stall a training step for SQLite's 30 s default.
            storage = open_storage(url, read_only=True, busy_timeout=_READ_BUSY_TIMEOUT_S)
        except DatabaseMissingError as e:
            if url is None:  # no database yet at the default place: the normal first run
                log.info("flashtune: %s; using the shipped configs and heuristics", e)
                return where, {}, None
            raise
        try:
            return where, storage.load_table(device, sw), None
        finally:
            storage.close()
    except Exception as e:  # StorageError, or anything a broken install throws: never fatal
        what = str(e) if isinstance(e, StorageError) else f"{type(e).__name__}: {e}"
        _warn_once(f"db:{where}", f"flashtune: cannot use the tuning database ({what}); "
                   "using the shipped configs and heuristics. Training goes on.")
        return where, {}, what


# ----------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class _Dist:
    rank: int
    store: Any
    timeout: float


def _dist() -> _Dist | None:
    """The default process group's rank and store, if a multi-rank job syncs decisions."""
    if not _env_on("FLASHTUNE_DIST_SYNC") and "FLASHTUNE_DIST_SYNC" in os.environ:
        return None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        return _Dist(dist.get_rank(), store, _env_float("FLASHTUNE_DIST_TIMEOUT", 300.0))
    except Exception as e:
        _warn_once("dist", f"flashtune: cannot reach the process group's store ({e}); each "
                   "rank decides on its own")
        return None


def _store_key(*parts: object) -> str:
    return _STORE_PREFIX + hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _exchange(d: _Dist, name: str, produce: Any) -> Any:
    """Rank 0 computes ``produce()`` and publishes it; the others read it (bounded wait).
    Returns the value, or raises TimeoutError/RuntimeError on the non-zero ranks."""
    if d.rank == 0:
        value = produce()
        d.store.set(name, pickle.dumps(value))
        return value
    d.store.wait([name], timedelta(seconds=d.timeout))
    return pickle.loads(d.store.get(name))


def _sync_table(local: _Table) -> _Table:
    d = _dist()
    if d is None:
        return local
    name = _store_key("table", local.device.fingerprint)
    payload = lambda: [(e.result, e.layer) for e in local.entries.values()]  # noqa: E731
    try:
        published = _exchange(d, name, payload)
    except Exception as e:
        _warn_once("dist-table", f"flashtune: rank {d.rank} got no tuning table from rank 0 "
                   f"({type(e).__name__}: {e}); using its own")
        return local
    if d.rank == 0:
        return local
    entries: dict[ProblemKey, _Entry] = {}
    _index(entries, published)
    return _Table(local.device, entries, local.database, local.error)


def _records_misses() -> bool:
    d = _dist()
    return d is None or d.rank == 0  # one writer per job: the ranks share their decisions


# ----------------------------------------------------------------------------- online tuning


def _tune_on_miss(problem: Problem, direction: str, table: _Table) -> Result | None:
    """Tune ``problem`` (rank 0 only under torch.distributed) and add the result to ``table``."""
    d = _dist()
    run = lambda: _run_tuner(problem, direction, table)  # noqa: E731
    if d is None:
        result = run()
    else:
        name = _store_key("tuned", table.device.fingerprint, problem.key(direction))
        try:
            result = _exchange(d, name, run)
        except Exception as e:
            _warn_once(f"dist-tune:{name}", f"flashtune: rank {d.rank} got no online-tuning "
                       f"result from rank 0 ({type(e).__name__}: {e}); deciding locally")
            return None
    if result is None:
        return None
    entry = _parse(result, "user")
    if entry is None:
        return None
    table.add(entry)
    return result


def _run_tuner(problem: Problem, direction: str, table: _Table) -> Result | None:
    trials = max(1, int(_env_float("FLASHTUNE_TUNE_TRIALS", 8)))
    budget = _env_float("FLASHTUNE_TUNE_SECONDS", 120.0)
    _stats["tunes"] += 1
    t0 = time.perf_counter()
    try:
        from flashtune.autotune import tune

        # A broken user database still gets a tune; its result lives in this process only.
        where: Any = _db_url() if table.error is None else "sqlite://"
        out = tune(problem, direction=direction, trials=trials, time_budget=budget,
                   storage=where, store=table.error is None)
    except Exception as e:  # online tuning is best effort: never the reason a run fails
        _warn_once(f"tune:{type(e).__name__}", f"flashtune: online tuning failed "
                   f"({type(e).__name__}: {e}); falling back to the stored/heuristic configs")
        return None
    result = _as_result(out, table.device)
    if result is not None:
        log.info("flashtune: tuned %s %s in %.1f s: %s", direction, result.key.short(),
                 time.perf_counter() - t0, result.config)
    return result


def _as_result(out: Any, device: DeviceInfo) -> Result | None:
    """The tuner's answer (a TuneResult: config, key and timings) as a database Result."""
    from flashtune.db.storage import Result, provenance

    if isinstance(out, Result) or out is None:
        return out
    try:
        host, created_at, version = provenance()
        return Result(device=device, software=software_info(), key=out.key,
                      problem=out.problem, config=config_to_dict(out.config),
                      median_ms=out.median_ms, p20_ms=out.p20_ms, p80_ms=out.p80_ms,
                      tflops=out.tflops, max_error=out.max_error, trials=out.trials,
                      search_seconds=out.search_seconds, host=host, created_at=created_at,
                      flashtune_version=version)
    except (AttributeError, TypeError) as e:
        _warn_once("tune-result", f"flashtune: cannot use the tuner's result ({e})")
        return None


# ----------------------------------------------------------------------------- misses


class _MissRecorder:
    """Batches misses and writes them from a background thread (never on the hot path)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._pending: dict[DeviceInfo, dict[ProblemKey, tuple[int, Problem]]] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._writing = threading.Lock()

    def add(self, device: DeviceInfo, key: ProblemKey, problem: Problem) -> None:
        with self._cv:
            per = self._pending.setdefault(device, {})
            count = per.get(key, (0, problem))[0]
            per[key] = (count + 1, problem)
            if self._thread is None or self._pid != os.getpid():  # none yet, or forked
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="flashtune-misses",
                                                daemon=True)
                self._thread.start()
            if sum(len(p) for p in self._pending.values()) >= _MISS_BATCH:
                self._cv.notify()

    def _take(self) -> dict[DeviceInfo, dict[ProblemKey, tuple[int, Problem]]]:
        with self._cv:
            batch, self._pending = self._pending, {}
            return batch

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait(timeout=_MISS_PERIOD_S)
            self.write()

    def write(self) -> None:
        with self._writing:
            batch = self._take()
            if not batch:
                return
            try:
                from flashtune.db.storage import open_storage

                sw = software_info()
                with open_storage(_db_url()) as storage:
                    for device, misses in batch.items():
                        storage.record_misses(device, sw, misses)
            except Exception as e:
                _warn_once("misses", f"flashtune: cannot record dispatcher misses in the "
                           f"tuning database ({type(e).__name__}: {e}); dropping them")

    def flush(self, timeout: float | None = None) -> bool:
        """Write what is pending now; False if it did not finish within ``timeout``."""
        t = threading.Thread(target=self.write, name="flashtune-misses-flush", daemon=True)
        t.start()
        t.join(timeout)
        return not t.is_alive()


_recorder = _MissRecorder()


def flush_misses(timeout: float | None = None) -> bool:
    """Write the pending misses to the database now (also done at exit, bounded)."""
    return _recorder.flush(timeout)


atexit.register(flush_misses, _EXIT_FLUSH_S)


# ----------------------------------------------------------------------------- explain


@dataclass(frozen=True)
class Explanation:
    """What the dispatcher does for one call (:func:`explain`)."""

    problem: Problem
    key: ProblemKey  # the forward key; the backward key differs only in ``direction``
    source: str  # the weaker of the two directions' sources
    fwd: Choice
    bwd: Choice
    device: DeviceInfo
    database: str | None
    database_error: str | None

    @property
    def fwd_config(self) -> FwdConfig:
        return self.fwd.config  # type: ignore[return-value]

    @property
    def bwd_config(self) -> BwdConfig:
        return self.bwd.config  # type: ignore[return-value]

    @property
    def entry(self) -> Result | None:
        """The database entry behind the forward config (``bwd.entry`` for the backward)."""
        return self.fwd.entry

    def as_dict(self) -> dict[str, Any]:
        def one(c: Choice) -> dict[str, Any]:
            e = c.entry
            return {"source": c.source, "layer": c.layer, "config": config_to_dict(c.config),
                    "key": c.key.as_dict(),
                    "entry": None if e is None else {
                        "key": e.key.as_dict(), "median_ms": e.median_ms, "tflops": e.tflops,
                        "trials": e.trials, "host": e.host, "created_at": e.created_at,
                        "flashtune_version": e.flashtune_version}}

        return {"problem": self.problem.as_dict(), "key": self.key.as_dict(),
                "source": self.source, "device": self.device.as_dict(),
                "database": self.database, "database_error": self.database_error,
                "fwd": one(self.fwd), "bwd": one(self.bwd)}

    def __str__(self) -> str:
        lines = [f"{self.key.short()} on {self.device.name}: {self.source}"]
        for c in (self.fwd, self.bwd):
            e = c.entry
            what = c.source if e is None else \
                f"{c.source} from {c.layer} entry {e.key.short()} ({e.median_ms:.4g} ms)"
            lines.append(f"  {c.key.direction}: {config_to_dict(c.config)}  [{what}]")
        if self.database_error:
            lines.append(f"  database unusable: {self.database_error}")
        return "\n".join(lines)


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> Explanation:
    """What :func:`flashtune.flash_attention` would run for these inputs, and why.

    Returns the problem key, the forward and backward configs, ``source`` ("tuned",
    "nearest" or "default"; the weaker of the two directions) and the database entries
    they came from. Launches nothing, records no miss, tunes nothing; it may load the
    device's table (as the first call would).
    """
    _, window, cap = _attention.validate(q, k, v, causal, None, window_size, softcap)
    problem = Problem.from_tensors(q, k, causal=causal, window_size=window, softcap=cap)
    with _lock:
        table = _table(q.device, load=True)
        assert table is not None
        fwd, bwd = table.choose(problem, "fwd"), table.choose(problem, "bwd")
    source = max(fwd.source, bwd.source, key=SOURCES.index)
    return Explanation(problem, fwd.key, source, fwd, bwd, table.device, table.database,
                       table.error)


def preload(device: Any = None) -> dict[str, Any]:
    """Load the tuning table for ``device`` now (default: the current CUDA device, or the
    CPU interpreter), outside any hot loop, CUDA-graph capture or compiled region. Under
    torch.distributed, call it on every rank. Returns a short summary."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() and not _attention._INTERPRET else torch.device("cpu")
    with _lock:
        table = _table(torch.device(device), load=True)
        assert table is not None
    layers = [e.layer for e in table.entries.values()]
    return {"device": table.device.name, "entries": len(layers),
            "user": layers.count("user"), "shipped": layers.count("shipped"),
            "database": table.database, "error": table.error}


_attention.set_config_resolver(resolve)
