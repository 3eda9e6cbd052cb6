"""The dispatcher's per-process state: decisions, tables, once-per-process notes, counters."""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch

from flashtune.kernels import _plans
from flashtune.kernels.config import BwdConfig, FwdConfig
from flashtune.problem import ProblemKey

if TYPE_CHECKING:
    from flashtune.dispatch._table import Table

Config = FwdConfig | BwdConfig

lock = threading.RLock()
fast: dict[tuple[Any, ...], Config] = {}
# What each remembered decision depends on: (device index, the key family asked for).
fast_deps: dict[tuple[Any, ...], tuple[int, tuple[Any, ...]]] = {}
tables: dict[int, Table] = {}  # by torch device index (-1: CPU)
warned: set[str] = set()
missed: set[tuple[str, ProblemKey]] = set()
tune_tried: set[tuple[str, ProblemKey]] = set()
counters = {"first_sights": 0, "table_loads": 0, "db_reads": 0, "misses": 0, "tunes": 0,
          "uncached": 0, "misses_recorded": 0, "misses_dropped": 0}


def stats() -> dict[str, int]:
    """Counters for tests and diagnostics: first sights of a shape, table loads, database
    reads, misses, online tunes, first sights served uncached (inside capture or
    compilation with no table loaded), and miss records written to the database or
    dropped (the database could not be written, e.g. locked by another writer)."""
    return dict(counters)


def warn_once(tag: str, message: str) -> None:
    with lock:
        if tag in warned:
            return
        warned.add(tag)
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def device_index(device: Any) -> int:
    """The index the dispatcher files a device under: -1 for the CPU (the interpreter)."""
    device = torch.device(device)
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def remember(fk: tuple[Any, ...], config: Config, index: int, key: ProblemKey) -> None:
    fast[fk] = config
    fast_deps[fk] = (index, key.family())


def forget(index: int | None = None, family: tuple[Any, ...] | None = None) -> None:
    """Forget the decisions of one device (by index; all with None) whose key family is
    ``family`` (any with None), here and in the kernels' per-signature plans."""
    with lock:
        for fk, (i, fam) in list(fast_deps.items()):
            if (index is None or i == index) and (family is None or fam == family):
                del fast[fk], fast_deps[fk]
        device = None if index is None else \
            torch.device("cpu") if index < 0 else torch.device("cuda", index)
        _plans.forget(device, family)


def reload(device: Any = None) -> None:
    """Forget every table, decision and once-per-process note (after the database changed,
    or between tests), and zero :func:`stats`. Pending misses are kept.

    With ``device``, forget only that device's table and decisions (the next call on it
    loads the table again); the other devices', the notes and the counters stay."""
    with lock:
        if device is not None:
            index = device_index(device)
            tables.pop(index, None)
            forget(index)
            return
        for name in counters:
            counters[name] = 0
        fast.clear()
        fast_deps.clear()
        tables.clear()
        warned.clear()
        missed.clear()
        tune_tried.clear()
        _plans.forget()


def in_graph() -> bool:
    """True inside torch.compile tracing or CUDA-graph capture: touch nothing outside memory."""
    if torch.compiler.is_compiling():
        return True
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False
