"""The export format: one JSON document that people carry, diff and review.

::

    {"entries": [ENTRY, ...], "format": "flashtune-tuning-db", "format_version": 1}

    ENTRY = {"direction": "fwd" | "bwd",
             "problem": {dtype, head_dim, causal, window, softcap, gqa_ratio,
                         bh_bucket, sq_bucket, sk_bucket},        # the ProblemKey
             "example": {batch, heads_q, ...} | null,             # one concrete Problem
             "config": {knob: value, ...},                        # every knob of the kernel
             "device": {name, capability, sm_count, memory_gb},
             "software": {torch, triton, cuda, kernels_hash},
             "median_ms", "p20_ms", "p80_ms", "tflops", "max_error", "search_seconds",
             "trials", "host", "created_at", "flashtune_version"}

Entries are sorted and keys are sorted, so identical content gives identical bytes.
:func:`validate_export` checks everything (types, ranges, known fields only) before
:func:`import_json` writes anything, and names the entry and field of the first error.
Nothing here imports a database driver: the shipped layer is read with it too.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, replace
from importlib import resources
from typing import TYPE_CHECKING, Any

from flashtune.db import plausibility
from flashtune.db.fingerprint import SoftwareInfo, software_info
from flashtune.db.storage import PREFER, Result
from flashtune.db.validation import (
    Bad,
    expect_object,
    from_entry,
    show,
    sort_key,
    to_entry,
)
from flashtune.exceptions import ImportValidationError

if TYPE_CHECKING:
    from flashtune.db.storage import Storage

FORMAT = "flashtune-tuning-db"
FORMAT_VERSION = 1
Entry = Result
"""A validated export entry is a :class:`~flashtune.db.storage.Result`."""

__all__ = ["FORMAT", "FORMAT_VERSION", "Entry", "ImportReport", "export_json", "from_entry",
           "import_json", "shipped_results", "to_entry", "validate_export"]

log = logging.getLogger(__name__)

def _dump(doc: Any) -> bytes:
    return (json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False,
                       allow_nan=False) + "\n").encode()


def export_json(storage: Storage, device: str | None = None, *, fresh: bool = False) -> bytes:
    """The export document of ``storage`` (all results, or those of ``device``: a
    fingerprint or part of a device name; with ``fresh``, only results fresh under this
    machine's software). Identical content gives identical bytes, in the order of
    :func:`~flashtune.db.validation.sort_key`."""
    rs = storage.results(device=device, include_stale=not fresh)
    entries = [to_entry(r) for r in sorted(rs, key=sort_key)]
    return _dump({"format": FORMAT, "format_version": FORMAT_VERSION, "entries": entries})


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def validate_export(data: bytes) -> list[Entry]:
    """Parse and validate a whole export document before anything is written.

    Raises :class:`ImportValidationError` with one line: ``entry N: field X: what is
    wrong; allowed: ...`` (N indexes the ``entries`` array), or what is wrong with the
    document itself.
    """
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise ImportValidationError(f"not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise ImportValidationError("not valid JSON: nested too deeply") from None
    except ValueError as e:
        what = str(e).splitlines()[0] if str(e) else "unreadable"
        if what.startswith("Exceeds the limit"):
            what = "a number has too many digits"
        raise ImportValidationError(f"not valid JSON: {what}") from None
    try:
        doc = expect_object(doc, "", ("format", "format_version", "entries"),
                   ("format", "format_version", "entries"))
        if doc["format"] != FORMAT:
            raise Bad("format", f"{show(doc['format'])} is not allowed; allowed: {FORMAT}")
        if doc["format_version"] != FORMAT_VERSION or isinstance(doc["format_version"], bool):
            raise Bad("format_version", f"{show(doc['format_version'])} is not supported; "
                       f"allowed: {FORMAT_VERSION}")
        if not isinstance(doc["entries"], list):
            raise Bad("entries", f"expected an array, got {show(doc['entries'])}")
    except Bad as e:
        raise ImportValidationError(str(e)) from None
    out: list[Entry] = []
    seen: dict[tuple[Any, ...], int] = {}
    for i, entry in enumerate(doc["entries"]):
        try:
            r = from_entry(entry)
            # Types and ranges are not enough: a claim no measurement can make (0 ms, a
            # TFLOP/s past the device's peak) would outrank every real result.
            for name, why in plausibility.problems(r)[:1]:
                raise Bad(name, f"{why}; implausible for a measurement")
        except Bad as bad:
            raise ImportValidationError(f"entry {i}: {bad}") from None
        k = sort_key(r)
        if k in seen:
            raise ImportValidationError(
                f"entry {i}: duplicates entry {seen[k]} (same device, software and problem)")
        seen[k] = i
        out.append(r)
    return out


@dataclass(frozen=True)
class ImportReport:
    """What an import did: counts per outcome."""

    added: int
    replaced: int
    kept: int

    @property
    def total(self) -> int:
        return self.added + self.replaced + self.kept


def import_json(storage: Storage, data: bytes, prefer: str = "faster") -> ImportReport:
    """Validate ``data`` completely, then write every entry in one transaction.

    Conflicts with stored results are settled by ``prefer`` (see :class:`Storage`).
    Provenance (host, time, version) is kept as it is in the file.
    """
    if prefer not in PREFER:
        raise ValueError(f"prefer must be one of {PREFER}, got {prefer!r}")
    entries = validate_export(data)
    outcomes = storage.put_results(entries, prefer=prefer)
    return ImportReport(added=outcomes.count("added"), replaced=outcomes.count("replaced"),
                        kept=outcomes.count("kept"))


@functools.lru_cache(maxsize=1)
def _shipped() -> tuple[Result, ...]:
    try:
        data = resources.files("flashtune").joinpath("data").joinpath("shipped.json").read_bytes()
        return tuple(replace(r, origin="shipped") for r in validate_export(data))
    except (OSError, ImportValidationError) as e:
        log.warning("flashtune: ignoring the shipped tuning data: %s", e)
        return ()


def shipped_results(software: SoftwareInfo | None = None) -> list[Result]:
    """The tuned results shipped inside the package (read-only, the lowest layer),
    with ``stale`` computed against ``software`` (default: current)."""
    sw = software or software_info()
    return [r.against(sw) for r in _shipped()]
