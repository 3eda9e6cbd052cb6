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
import math
import re
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from importlib import resources
from typing import TYPE_CHECKING, Any

from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo, software_info
from flashtune.db.storage import PREFER, Result
from flashtune.exceptions import ImportValidationError
from flashtune.kernels.config import CONFIG_TYPES, config_fields
from flashtune.problem import DIRECTIONS, DTYPES, MAX_BUCKET, Problem, ProblemKey

if TYPE_CHECKING:
    from flashtune.db.storage import Storage

FORMAT = "flashtune-tuning-db"
FORMAT_VERSION = 1
Entry = Result
"""A validated export entry is a :class:`~flashtune.db.storage.Result`."""

log = logging.getLogger(__name__)

# Plausibility limits. Anything beyond them is a corrupt or hostile file, not a measurement.
_MAX_MS = 1e9
_MAX_TFLOPS = 1e6
_MAX_ERROR = 1e6
_MAX_SECONDS = 1e9
_MAX_COUNT = 10**9
_MAX_SM = 10**6
_MAX_GB = 10**6
_TIMINGS = ("median_ms", "p20_ms", "p80_ms")
_FLOATS = {"median_ms": _MAX_MS, "p20_ms": _MAX_MS, "p80_ms": _MAX_MS, "tflops": _MAX_TFLOPS,
           "max_error": _MAX_ERROR, "search_seconds": _MAX_SECONDS}
_ENTRY_FIELDS = frozenset(
    {"direction", "problem", "example", "config", "device", "software", "trials", "host",
     "created_at", "flashtune_version", *_FLOATS})
_KEY_FIELDS = tuple(f.name for f in fields(ProblemKey) if f.name != "direction")
_EXAMPLE_FIELDS = tuple(f.name for f in fields(Problem))


_PLAIN = re.compile(r"[A-Za-z0-9_]{1,40}")


class _Bad(Exception):
    """A field failed validation: ``field`` is its dotted path, ``what`` the reason."""

    def __init__(self, field: str, what: str) -> None:
        text = f"field {field}: {what}" if field else what
        super().__init__(" ".join(text.split()))  # always one line


def _show(v: Any) -> str:
    """A short, safe rendering of a value for an error message."""
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, int):
        return str(v) if v.bit_length() <= 64 else f"an integer of {v.bit_length()} bits"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v if len(v) <= 40 else v[:40] + "...")
    if isinstance(v, dict):
        return "an object"
    return "an array" if isinstance(v, list) else type(v).__name__


def _obj(d: Any, name: str, known: tuple[str, ...] | frozenset[str],
         required: tuple[str, ...] | frozenset[str]) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise _Bad(name, f"expected an object, got {_show(d)}")
    unknown = sorted(set(d) - set(known))
    if unknown:
        field = unknown[0] if _PLAIN.fullmatch(unknown[0]) else _show(unknown[0])
        raise _Bad(f"{name}.{field}" if name else field,
                   f"unknown field; allowed: {', '.join(sorted(known))}")
    missing = [k for k in sorted(required) if k not in d]
    if missing:
        raise _Bad(f"{name}.{missing[0]}" if name else missing[0], "missing")
    return d


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad(name, f"expected an integer, got {_show(v)}")
    if not lo <= v <= hi:
        raise _Bad(name, f"{_show(v)} is out of range; allowed: {lo} to {hi}")
    return v


def _num(v: Any, name: str, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(name, f"expected a number, got {_show(v)}")
    if isinstance(v, int) and v.bit_length() > 64:
        raise _Bad(name, f"{_show(v)} is out of range; allowed: 0 to {hi:g}")
    f = float(v)
    if not (math.isfinite(f) and 0.0 <= f <= hi):
        raise _Bad(name, f"{_show(v)} is out of range; allowed: 0 to {hi:g}")
    return f


def _str(v: Any, name: str, max_len: int, *, empty: bool = False) -> str:
    if not isinstance(v, str):
        raise _Bad(name, f"expected a string, got {_show(v)}")
    if not empty and not v:
        raise _Bad(name, "must not be empty")
    if len(v) > max_len:
        raise _Bad(name, f"is {len(v)} characters long; allowed: at most {max_len}")
    if any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in v):
        raise _Bad(name, "contains control characters or invalid unicode; allowed: text")
    return v


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise _Bad(name, f"expected true/false, got {_show(v)}")
    return v


def _pow2(v: Any, name: str) -> int:
    n = _int(v, name, 1, MAX_BUCKET)
    if n & (n - 1):
        raise _Bad(name, f"{n} is not a power of two; allowed: 1, 2, 4, ... {MAX_BUCKET}")
    return n


def _key(direction: Any, d: Any) -> ProblemKey:
    if direction not in DIRECTIONS:
        raise _Bad("direction", f"{_show(direction)} is not allowed; allowed: fwd, bwd")
    d = _obj(d, "problem", _KEY_FIELDS, _KEY_FIELDS)
    if d["dtype"] not in DTYPES:
        raise _Bad("problem.dtype", f"{_show(d['dtype'])} is not allowed; allowed: "
                   f"{', '.join(DTYPES)}")
    hd = _int(d["head_dim"], "problem.head_dim", 16, 256)
    if hd % 8:
        raise _Bad("problem.head_dim", f"{hd} is not allowed; allowed: multiples of 8, 16 to 256")
    return ProblemKey(
        direction=direction, dtype=d["dtype"], head_dim=hd,
        causal=_bool(d["causal"], "problem.causal"), window=_bool(d["window"], "problem.window"),
        softcap=_bool(d["softcap"], "problem.softcap"),
        gqa_ratio=_int(d["gqa_ratio"], "problem.gqa_ratio", 1, MAX_BUCKET),
        bh_bucket=_pow2(d["bh_bucket"], "problem.bh_bucket"),
        sq_bucket=_pow2(d["sq_bucket"], "problem.sq_bucket"),
        sk_bucket=_pow2(d["sk_bucket"], "problem.sk_bucket"))


def _example(d: Any, key: ProblemKey) -> Problem | None:
    if d is None:
        return None
    d = _obj(d, "example", _EXAMPLE_FIELDS, ("batch", "heads_q", "heads_kv", "seqlen_q",
                                             "seqlen_k", "head_dim"))
    for k in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim"):
        _int(d[k], f"example.{k}", 1, 1 << 40)
    if "softcap" in d:
        _num(d["softcap"], "example.softcap", 1e9)
    if "causal" in d:
        _bool(d["causal"], "example.causal")
    w = d.get("window", [-1, -1])
    if not isinstance(w, list) or len(w) != 2:
        raise _Bad("example.window", f"expected [left, right], got {_show(w)}")
    for side in w:
        _int(side, "example.window", -1, 1 << 40)
    try:
        p = Problem.from_dict(d)
    except (ValueError, TypeError) as e:
        raise _Bad("example", str(e)) from None
    if p.key(key.direction) != key:
        raise _Bad("example", f"its key ({p.key(key.direction).short()}) differs from the "
                   f"entry's problem ({key.short()})")
    return p


def _config(direction: str, d: Any) -> dict[str, Any]:
    allowed = config_fields(CONFIG_TYPES[direction])
    d = _obj(d, "config", tuple(allowed), ())
    for name, val in d.items():
        choices = allowed[name]
        if isinstance(val, bool) or not isinstance(val, int) or val not in choices:
            raise _Bad(f"config.{name}", f"{_show(val)} is not allowed; allowed: "
                       f"{', '.join(str(c) for c in choices)}")
    full = asdict(CONFIG_TYPES[direction]())
    full.update(d)
    return full


def _created_at(v: Any) -> str:
    s = _str(v, "created_at", 64)
    try:
        t = datetime.fromisoformat(s)
    except ValueError:
        raise _Bad("created_at", f"{_show(s)} is not an ISO-8601 time") from None
    if t.tzinfo is None:
        raise _Bad("created_at", f"{_show(s)} has no time zone; allowed: ISO-8601 with offset")
    return t.astimezone(timezone.utc).isoformat(timespec="microseconds")


def from_entry(e: Any, software: SoftwareInfo | None = None) -> Result:
    """Validate one export entry and build its Result (raises ``_Bad``)."""
    e = _obj(e, "", _ENTRY_FIELDS, _ENTRY_FIELDS)
    key = _key(e["direction"], e["problem"])
    dev = _obj(e["device"], "device", ("name", "capability", "sm_count", "memory_gb"),
               ("name", "capability", "sm_count", "memory_gb"))
    sw = _obj(e["software"], "software", ("torch", "triton", "cuda", "kernels_hash"),
              ("torch", "triton", "cuda", "kernels_hash"))
    nums = {k: _num(e[k], k, hi) for k, hi in _FLOATS.items()}
    if not nums["p20_ms"] <= nums["median_ms"] <= nums["p80_ms"]:
        raise _Bad("median_ms", f"p20 {nums['p20_ms']!r} <= median {nums['median_ms']!r} <= "
                   f"p80 {nums['p80_ms']!r} does not hold")
    r = Result(
        median_ms=nums["median_ms"], p20_ms=nums["p20_ms"], p80_ms=nums["p80_ms"],
        tflops=nums["tflops"], max_error=nums["max_error"],
        search_seconds=nums["search_seconds"],
        device=DeviceInfo(name=_str(dev["name"], "device.name", 200),
                          capability=_str(dev["capability"], "device.capability", 32),
                          sm_count=_int(dev["sm_count"], "device.sm_count", 0, _MAX_SM),
                          memory_gb=_int(dev["memory_gb"], "device.memory_gb", 0, _MAX_GB)),
        software=SoftwareInfo(**{k: _str(sw[k], f"software.{k}", 128) for k in sw}),
        key=key, problem=_example(e["example"], key), config=_config(key.direction, e["config"]),
        trials=_int(e["trials"], "trials", 0, _MAX_COUNT),
        host=_str(e["host"], "host", 256, empty=True), created_at=_created_at(e["created_at"]),
        flashtune_version=_str(e["flashtune_version"], "flashtune_version", 64))
    return r.against(software or software_info())


def to_entry(r: Result) -> dict[str, Any]:
    """The export entry of a result (no fingerprints, no staleness: pure content)."""
    key = r.key.as_dict()
    del key["direction"]
    return {
        "direction": r.key.direction, "problem": key,
        "example": r.problem.as_dict() if r.problem is not None else None,
        "config": dict(r.config), "device": r.device.as_dict(), "software": r.software.as_dict(),
        "median_ms": r.median_ms, "p20_ms": r.p20_ms, "p80_ms": r.p80_ms, "tflops": r.tflops,
        "max_error": r.max_error, "trials": r.trials, "search_seconds": r.search_seconds,
        "host": r.host, "created_at": r.created_at, "flashtune_version": r.flashtune_version,
    }


def check_result(r: Result) -> Result:
    """Validate a result built in Python the way an import is validated; ValueError if bad."""
    try:
        return from_entry(to_entry(r), r.software)
    except _Bad as e:
        raise ImportValidationError(f"{r.key.short()}: {e}") from None


def sort_key(r: Result) -> tuple[Any, ...]:
    return (r.device.fingerprint, r.software.fingerprint, r.key)


def _dump(doc: Any) -> bytes:
    return (json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False,
                       allow_nan=False) + "\n").encode()


def export_json(storage: Storage, device: str | None = None) -> bytes:
    """The export document of ``storage`` (all results, or those of ``device``: a
    fingerprint or part of a device name). Identical content gives identical bytes."""
    entries = [to_entry(r) for r in sorted(storage.results(device=device), key=sort_key)]
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
        doc = _obj(doc, "", ("format", "format_version", "entries"),
                   ("format", "format_version", "entries"))
        if doc["format"] != FORMAT:
            raise _Bad("format", f"{_show(doc['format'])} is not allowed; allowed: {FORMAT}")
        if doc["format_version"] != FORMAT_VERSION or isinstance(doc["format_version"], bool):
            raise _Bad("format_version", f"{_show(doc['format_version'])} is not supported; "
                       f"allowed: {FORMAT_VERSION}")
        if not isinstance(doc["entries"], list):
            raise _Bad("entries", f"expected an array, got {_show(doc['entries'])}")
    except _Bad as e:
        raise ImportValidationError(str(e)) from None
    out: list[Entry] = []
    seen: dict[tuple[Any, ...], int] = {}
    for i, entry in enumerate(doc["entries"]):
        try:
            r = from_entry(entry)
        except _Bad as bad:
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
        return tuple(validate_export(data))
    except (OSError, ImportValidationError) as e:
        log.warning("flashtune: ignoring the shipped tuning data: %s", e)
        return ()


def shipped_results(software: SoftwareInfo | None = None) -> list[Result]:
    """The tuned results shipped inside the package (read-only, the lowest layer),
    with ``stale`` computed against ``software`` (default: current)."""
    sw = software or software_info()
    return [r.against(sw) for r in _shipped()]
