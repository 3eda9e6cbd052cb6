"""Distributed sync: rank 0 publishes its decisions through the process group's store.

Every rank then decides alike. Rank 0 never waits for the others; they wait for rank 0
at most ``FLASHTUNE_DIST_TIMEOUT`` seconds, then decide locally with a warning.
``FLASHTUNE_DIST_SYNC=0`` turns this off.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from flashtune._env import flag, is_set, number
from flashtune.db.storage import Result
from flashtune.db.validation import Bad, from_entry, to_entry
from flashtune.dispatch._state import warn_once
from flashtune.dispatch._table import Entry, Table, index
from flashtune.problem import ProblemKey

STORE_PREFIX = "flashtune/dispatch/"


@dataclass(frozen=True)
class Dist:
    rank: int
    store: Any
    timeout: float


def dist_group() -> Dist | None:
    """The default process group's rank and store, if a multi-rank job syncs decisions."""
    if not flag("FLASHTUNE_DIST_SYNC") and is_set("FLASHTUNE_DIST_SYNC"):
        return None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        return Dist(dist.get_rank(), store, number("FLASHTUNE_DIST_TIMEOUT", 300.0))
    except Exception as e:
        warn_once("dist", f"flashtune: cannot reach the process group's store ({e}); each "
                   "rank decides on its own")
        return None


def store_key(*parts: object) -> str:
    return STORE_PREFIX + hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def exchange(d: Dist, name: str, produce: Any, encode: Any, decode: Any) -> Any:
    """Rank 0 computes ``produce()`` and publishes ``encode(value)`` as JSON; the others read
    it (bounded wait) and return ``decode(json)``. JSON, never pickle: any client of the
    store's TCP port can write to it, and what a rank reads must stay data. Raises
    TimeoutError/RuntimeError/ValueError on the non-zero ranks."""
    if d.rank == 0:
        value = produce()
        d.store.set(name, json.dumps(encode(value)).encode())
        return value
    d.store.wait([name], timedelta(seconds=d.timeout))
    return decode(json.loads(d.store.get(name).decode()))


def encode_results(pairs: list[tuple[Result, str]]) -> list[dict[str, Any]]:
    return [{"entry": to_entry(r), "layer": layer} for r, layer in pairs]


def decode_results(doc: Any) -> list[tuple[Result, str]]:
    """The (result, layer) pairs of :func:`encode_results`, each validated as an import is."""
    if not isinstance(doc, list):
        raise ValueError(f"expected a list of entries, got {type(doc).__name__}")
    out = []
    for item in doc:
        if not isinstance(item, dict) or item.get("layer") not in ("user", "shipped"):
            raise ValueError("an entry without a valid layer")
        try:
            out.append((from_entry(item.get("entry")), item["layer"]))
        except Bad as e:
            raise ValueError(f"an invalid entry: {e}") from None
    return out


def sync_table(local: Table) -> Table:
    d = dist_group()
    if d is None:
        return local
    name = store_key("table", local.device.fingerprint)
    payload = lambda: [(e.result, e.layer) for e in local.entries.values()]  # noqa: E731
    try:
        published = exchange(d, name, payload, encode_results, decode_results)
    except Exception as e:
        warn_once("dist-table", f"flashtune: rank {d.rank} got no tuning table from rank 0 "
                   f"({type(e).__name__}: {e}); using its own")
        return local
    if d.rank == 0:
        return local
    entries: dict[ProblemKey, Entry] = {}
    index(entries, published)
    return Table(local.device, entries, local.database, local.error)


def records_misses() -> bool:
    """Whether this process records dispatcher misses: not with ``FLASHTUNE_RECORD_MISSES=0``
    (a read-only training job), and under torch.distributed on rank 0 only (one writer per
    job: the ranks share their decisions)."""
    if is_set("FLASHTUNE_RECORD_MISSES") and not flag("FLASHTUNE_RECORD_MISSES"):
        return False
    d = dist_group()
    return d is None or d.rank == 0
