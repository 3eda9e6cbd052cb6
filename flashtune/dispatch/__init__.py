"""The runtime dispatcher: which config runs each ``flashtune.flash_attention`` call.

:func:`install` makes :func:`resolve` the kernels' config resolver (see
:func:`flashtune.kernels.attention.set_config_resolver`). Importing this package does not:
the public names of :mod:`flashtune` (``flashtune.flash_attention`` and the others) call
:func:`install` when they load, ``flashtune.kernels.attention.flash_attention`` does not.

The ladder, per direction (fwd/bwd) and call:

1. the problem key, :meth:`flashtune.problem.Problem.key`, the one the tuner stores under;
2. **tuned**: a fresh result for exactly that key on this device, from the per-process
   table (the user's database over the shipped package layer);
3. **nearest**: else the closest tuned bucket of the same device, dtype, head dim and
   mask kind (:meth:`ProblemKey.distance`; ties: user layer, then faster), tuned on the
   same side of the host-bound line as the call (:func:`~flashtune.dispatch._table.
   entry_host_bound`);
4. **default**: else the heuristic default of :mod:`flashtune.kernels.config`.

Hot path. A dict keyed by a tuple of the tensors' shapes and flags holds the chosen
config; only the first call of a shape builds a :class:`Problem` and walks the ladder.
The kernels' per-signature plans (:mod:`flashtune.kernels._plans`) remember these
decisions too, so whatever changes a decision forgets it in both places, no more:
:func:`reload` (all of them, or one device's), a tuned result written by this process
to the database a device's table reads (the decisions of that device and key family:
the exact bucket and the nearest ones may change), and online tuning (likewise).
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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashtune._env import flag
from flashtune.db.fingerprint import DeviceInfo, device_info, software_info
from flashtune.db.storage import on_write
from flashtune.dispatch._distributed import dist_group, records_misses, sync_table
from flashtune.dispatch._misses import flush_misses, recorder
from flashtune.dispatch._online import tune_on_miss
from flashtune.dispatch._state import (
    Config,
    counters,
    device_index,
    fast,
    forget,
    in_graph,
    lock,
    missed,
    reload,
    remember,
    stats,
    tables,
    tune_tried,
    warn_once,
)
from flashtune.dispatch._table import Choice, Table, load_table, log, parse
from flashtune.exceptions import DispatchMissError
from flashtune.kernels import _plans
from flashtune.kernels import attention as _attention
from flashtune.kernels import varlen as _varlen
from flashtune.kernels.attention import flash_attention, flash_attn_func
from flashtune.kernels.config import BwdConfig, FwdConfig, config_to_dict, default_config
from flashtune.kernels.varlen import flash_attn_varlen_func
from flashtune.problem import Problem, ProblemKey

if TYPE_CHECKING:
    from flashtune.db.storage import Result

__all__ = ["Choice", "Explanation", "explain", "preload", "reload", "flush_misses", "stats",
           "resolve", "resolve_problem", "install", "SOURCES", "flash_attention",
           "flash_attn_func", "flash_attn_varlen_func"]

SOURCES = ("tuned", "nearest", "default")


def resolve(direction: str, q: torch.Tensor, k: torch.Tensor, causal: bool,
            window: tuple[int, int], softcap: float, deterministic: bool = True) -> Config:
    """The config for one call (the resolver the kernels call when no config is forced).
    ``deterministic`` is the backward's kind, part of its key."""
    fk = (direction, q.shape, k.shape, q.dtype, q.get_device(), causal, window, softcap,
          deterministic)
    cfg = fast.get(fk)
    if cfg is not None:
        return cfg
    problem = Problem.from_tensors(q, k, causal=causal, window_size=window, softcap=softcap,
                                   deterministic=deterministic)
    return _first_sight(fk, direction, problem, q.device)


def resolve_problem(direction: str, problem: Problem, device: torch.device) -> Config:
    """The config for one packed (varlen) call, by its :class:`Problem` (the resolver
    :mod:`flashtune.kernels.varlen` calls when no config is forced)."""
    fk = (direction, problem, device)
    cfg = fast.get(fk)
    if cfg is not None:
        return cfg
    return _first_sight(fk, direction, problem, device)


def _first_sight(fk: tuple[Any, ...], direction: str, problem: Problem,
                 device: torch.device) -> Config:
    graph = in_graph()
    with lock:
        counters["first_sights"] += 1
        table = table_for(device, load=not graph)
        if table is None:
            counters["uncached"] += 1
            warn_once("in-graph", "flashtune: first call of a shape inside CUDA-graph capture or "
                       "torch.compile tracing before the tuning table was loaded; using the "
                       "heuristic default there. Call flashtune.dispatch.preload() or run one "
                       "eager step first")
            return default_config(direction, problem)
        choice = table.choose(problem, direction)
        if choice.source != "tuned":
            choice = _on_miss(choice, problem, direction, table, graph)
        remember(fk, choice.config, device_index(device), choice.key)
        return choice.config


def _on_miss(choice: Choice, problem: Problem, direction: str, table: Table,
             graph: bool) -> Choice:
    key = choice.key
    tag = (table.device.fingerprint, key)
    if flag("FLASHTUNE_TUNE_ON_MISS") and not graph and tag not in tune_tried:
        tune_tried.add(tag)
        tuned = tune_on_miss(problem, direction, table)
        if tuned is not None:
            # Shapes of this family on this device may now prefer the new entry.
            forget(device_index_of(table), key.family())
            return table.choose(problem, direction)
    if flag("FLASHTUNE_STRICT"):
        near = "" if choice.entry is None else \
            f"; the nearest tuned bucket is {choice.entry.key.short()}"
        raise DispatchMissError(
            f"FLASHTUNE_STRICT=1: no tuned {direction} config for {key.short()} "
            f"(problem {problem.as_dict()}) on {table.device.name}{near}. Tune it with "
            f"`autotune tune` or `autotune sweep --from-misses`, or unset FLASHTUNE_STRICT")
    counters["misses"] += 1
    if tag not in missed:
        missed.add(tag)
        log.info("flashtune: no tuned %s config for %s on %s; using the %s config %s",
                 direction, key.short(), table.device.name, choice.source,
                 config_to_dict(choice.config))
    if table.error is None and not graph and records_misses():
        recorder.add(table.device, key, problem)
    return choice


def table_for(device: torch.device, *, load: bool) -> Table | None:
    index = device_index(device)
    table = tables.get(index)
    if table is None and load:
        table = tables[index] = sync_table(load_table(device_info(device)))
    return table


@dataclass(frozen=True)
class Explanation:
    """What the dispatcher does for one call (:func:`explain`)."""

    problem: Problem
    key: ProblemKey  # the forward key; the backward's (``bwd.key``) differs in ``direction``
    # and, for a non-deterministic call, ``deterministic``
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
            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
            deterministic: bool = True, cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
            max_seqlen_k: int | None = None) -> Explanation:
    """What :func:`flashtune.flash_attention` would run for these inputs, and why.

    Returns the problem key, the forward and backward configs, ``source`` ("tuned",
    "nearest" or "default"; the weaker of the two directions) and the database entries
    they came from. ``deterministic`` is the backward's kind, as in ``flash_attention``.
    A packed batch is explained as :func:`flashtune.flash_attn_varlen_func` runs it: pass
    its (total, H, D) tensors with ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q`` and
    ``max_seqlen_k``. Launches nothing, records no miss, tunes nothing; it may load the
    device's table (as the first call would).
    """
    _attention.validate_deterministic(deterministic)
    packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if cu_seqlens_q is not None and cu_seqlens_k is not None and max_seqlen_q is not None \
            and max_seqlen_k is not None:
        _varlen.validate_varlen(q, k, v, *packed)
        _, window, cap = _attention.validate_options(
            q.shape[2], causal, None, window_size, softcap, max_seqlen_q, max_seqlen_k)
        problem = _varlen.varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                                         causal, window, cap, deterministic)
    elif any(a is not None for a in packed):
        raise ValueError("a packed batch needs all of cu_seqlens_q, cu_seqlens_k, "
                         "max_seqlen_q and max_seqlen_k; a dense one none of them")
    else:
        _, window, cap = _attention.validate(q, k, v, causal, None, window_size, softcap)
        problem = Problem.from_tensors(q, k, causal=causal, window_size=window, softcap=cap,
                                       deterministic=deterministic)
    with lock:
        table = table_for(q.device, load=True)
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
    with lock:
        table = table_for(torch.device(device), load=True)
        assert table is not None
    layers = [e.layer for e in table.entries.values()]
    return {"device": table.device.name, "entries": len(layers),
            "user": layers.count("user"), "shipped": layers.count("shipped"),
            "database": table.database, "error": table.error}


def device_index_of(table: Table) -> int | None:
    for index, t in tables.items():
        if t is table:
            return index
    return None


def results_written(url: str, results: list[Result]) -> None:
    """A write to the tuning database by this process (:func:`flashtune.db.storage.on_write`):
    each fresh result for a device whose table reads that database joins the table, and the
    decisions it may change (that device, that key family) are forgotten. Under
    torch.distributed the tables are rank 0's and stay as they are until :func:`reload`."""
    if dist_group() is not None:
        return
    sw = software_info()
    with lock:
        for index, table in list(tables.items()):
            if table.database != url:
                continue
            for r in results:
                if r.device.fingerprint != table.device.fingerprint or r.against(sw).stale:
                    continue
                entry = parse(r, "user")
                if entry is not None:
                    table.add(entry)
                    forget(index, r.key.family())


def install() -> None:
    """Make :func:`resolve` and :func:`resolve_problem` the kernels' config resolvers, and
    keep the tables in step with what this process writes to the database. Idempotent;
    the public names of :mod:`flashtune` call it when they load."""
    if _attention.get_config_resolver() is not resolve:
        _attention.set_config_resolver(resolve)
    if _plans.resolvers()[1] is not resolve_problem:
        _varlen.set_varlen_resolver(resolve_problem)
    on_write(results_written)
