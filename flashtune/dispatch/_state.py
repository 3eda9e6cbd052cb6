"""The dispatcher's per-process state: decisions, tables, once-per-process notes, counters."""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch

from flashtune.kernels.config import BwdConfig, FwdConfig
from flashtune.problem import ProblemKey

if TYPE_CHECKING:
    from flashtune.dispatch._table import Table

Config = FwdConfig | BwdConfig

lock = threading.RLock()
fast: dict[tuple[Any, ...], Config] = {}
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


def reload() -> None:
    """Forget every table, decision and once-per-process note (after the database changed,
    or between tests), and zero :func:`stats`. Pending misses are kept."""
    with lock:
        for name in counters:
            counters[name] = 0
        fast.clear()
        tables.clear()
        warned.clear()
        missed.clear()
        tune_tried.clear()


def in_graph() -> bool:
    """True inside torch.compile tracing or CUDA-graph capture: touch nothing outside memory."""
    if torch.compiler.is_compiling():
        return True
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False
