"""Validation of one tuning result, field by field: the rules an import and a write share.

:func:`from_entry` checks an export entry (types, ranges, known fields only) and builds
its :class:`~flashtune.db.storage.Result`; :func:`check_result` holds a result built in
Python to the same rules. A leaf of the database package: it imports no driver and no
other storage module but the contract.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, asdict, fields, replace
from datetime import datetime, timezone
from typing import Any

from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo, software_info
from flashtune.db.storage import Result
from flashtune.exceptions import ImportValidationError
from flashtune.kernels.config import CONFIG_TYPES, config_fields
from flashtune.problem import (
    DIRECTIONS,
    DTYPES,
    MAX_BUCKET,
    Problem,
    ProblemKey,
    head_dim_ok,
)

# Plausibility limits. Anything beyond them is a corrupt or hostile file, not a measurement.
_MAX_MS = 1e9
_MAX_TFLOPS = 1e6
_MAX_ERROR = 1e6
_MAX_SECONDS = 1e9
_MAX_COUNT = 10**9
_MAX_SM = 10**6
_MAX_GB = 10**6
_FLOATS = {"median_ms": _MAX_MS, "p20_ms": _MAX_MS, "p80_ms": _MAX_MS, "tflops": _MAX_TFLOPS,
           "max_error": _MAX_ERROR, "search_seconds": _MAX_SECONDS}
_ENTRY_FIELDS = frozenset(
    {"direction", "problem", "example", "config", "device", "software", "trials", "host",
     "created_at", "flashtune_version", *_FLOATS})
_KEY_FIELDS = tuple(f.name for f in fields(ProblemKey) if f.name != "direction")
# Key fields newer than the export format: an entry without them has their defaults
# (a deterministic, dense problem), and an export leaves them out where they have them.
_KEY_DEFAULTS = {f.name: f.default for f in fields(ProblemKey) if f.name != "direction"
                 and f.default is not MISSING}
# fwd_kernels_hash belongs to the running process's software, never to a result's.
_SOFTWARE_FIELDS = tuple(f.name for f in fields(SoftwareInfo) if f.name != "fwd_kernels_hash")
_SOFTWARE_DEFAULTS = {f.name: f.default for f in fields(SoftwareInfo)
                      if f.default is not MISSING and f.name in _SOFTWARE_FIELDS}
_EXAMPLE_FIELDS = tuple(f.name for f in fields(Problem))


_PLAIN = re.compile(r"[A-Za-z0-9_]{1,40}")


class Bad(Exception):
    """A field failed validation: ``field`` is its dotted path, ``what`` the reason."""

    def __init__(self, field: str, what: str) -> None:
        text = f"field {field}: {what}" if field else what
        super().__init__(" ".join(text.split()))  # always one line


def show(v: Any) -> str:
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


def expect_object(d: Any, name: str, known: tuple[str, ...] | frozenset[str],
         required: tuple[str, ...] | frozenset[str]) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise Bad(name, f"expected an object, got {show(d)}")
    unknown = sorted(set(d) - set(known))
    if unknown:
        field = unknown[0] if _PLAIN.fullmatch(unknown[0]) else show(unknown[0])
        raise Bad(f"{name}.{field}" if name else field,
                   f"unknown field; allowed: {', '.join(sorted(known))}")
    missing = [k for k in sorted(required) if k not in d]
    if missing:
        raise Bad(f"{name}.{missing[0]}" if name else missing[0], "missing")
    return d


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise Bad(name, f"expected an integer, got {show(v)}")
    if not lo <= v <= hi:
        raise Bad(name, f"{show(v)} is out of range; allowed: {lo} to {hi}")
    return v


def _num(v: Any, name: str, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Bad(name, f"expected a number, got {show(v)}")
    if isinstance(v, int) and v.bit_length() > 64:
        raise Bad(name, f"{show(v)} is out of range; allowed: 0 to {hi:g}")
    f = float(v)
    if not (math.isfinite(f) and 0.0 <= f <= hi):
        raise Bad(name, f"{show(v)} is out of range; allowed: 0 to {hi:g}")
    return f


def _str(v: Any, name: str, max_len: int, *, empty: bool = False) -> str:
    if not isinstance(v, str):
        raise Bad(name, f"expected a string, got {show(v)}")
    if not empty and not v:
        raise Bad(name, "must not be empty")
    if len(v) > max_len:
        raise Bad(name, f"is {len(v)} characters long; allowed: at most {max_len}")
    # C0, DEL, C1 (U+0080-U+009F: terminal escapes too) and lone surrogates.
    if any(ord(c) < 32 or 127 <= ord(c) <= 159 or 0xD800 <= ord(c) <= 0xDFFF for c in v):
        raise Bad(name, "contains control characters or invalid unicode; allowed: text")
    return v


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise Bad(name, f"expected true/false, got {show(v)}")
    return v


def _pow2(v: Any, name: str) -> int:
    n = _int(v, name, 1, MAX_BUCKET)
    if n & (n - 1):
        raise Bad(name, f"{n} is not a power of two; allowed: 1, 2, 4, ... {MAX_BUCKET}")
    return n


def _key(direction: Any, d: Any) -> ProblemKey:
    if direction not in DIRECTIONS:
        raise Bad("direction", f"{show(direction)} is not allowed; allowed: fwd, bwd")
    d = expect_object(d, "problem", _KEY_FIELDS,
                      tuple(f for f in _KEY_FIELDS if f not in _KEY_DEFAULTS))
    d = {**_KEY_DEFAULTS, **d}
    if d["dtype"] not in DTYPES:
        raise Bad("problem.dtype", f"{show(d['dtype'])} is not allowed; allowed: "
                   f"{', '.join(DTYPES)}")
    hd = _int(d["head_dim"], "problem.head_dim", 16, 256)
    if not head_dim_ok(hd):
        raise Bad("problem.head_dim", f"{hd} is not allowed; allowed: multiples of 8, 16 to 256")
    det = _bool(d["deterministic"], "problem.deterministic")
    if direction == "fwd" and not det:
        raise Bad("problem.deterministic", "false is not allowed for a forward problem; "
                  "allowed: true (the flag is the backward's)")
    packed = _bool(d["packed"], "problem.packed")
    if packed:
        tokens = _pow2(d["tokens_bucket"], "problem.tokens_bucket")
    elif d["tokens_bucket"] != 0 or isinstance(d["tokens_bucket"], bool):
        raise Bad("problem.tokens_bucket", f"{show(d['tokens_bucket'])} is not allowed for a "
                  "dense problem; allowed: 0 (packed: a power of two)")
    else:
        tokens = 0
    return ProblemKey(
        deterministic=det, packed=packed, tokens_bucket=tokens,
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
    d = expect_object(d, "example", _EXAMPLE_FIELDS, ("batch", "heads_q", "heads_kv", "seqlen_q",
                                             "seqlen_k", "head_dim"))
    for k in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim"):
        _int(d[k], f"example.{k}", 1, 1 << 40)
    if "softcap" in d:
        _num(d["softcap"], "example.softcap", 1e9)
    if "causal" in d:
        _bool(d["causal"], "example.causal")
    if "deterministic" in d:
        _bool(d["deterministic"], "example.deterministic")
    for k in ("total_q", "total_k"):
        if k in d:
            _int(d[k], f"example.{k}", 0, 1 << 40)
    if "dtype" in d and (not isinstance(d["dtype"], str) or d["dtype"] not in DTYPES):
        raise Bad("example.dtype", f"{show(d['dtype'])} is not allowed; allowed: "
                  f"{', '.join(DTYPES)}")
    w = d.get("window", [-1, -1])
    if not isinstance(w, list) or len(w) != 2:
        raise Bad("example.window", f"expected [left, right], got {show(w)}")
    for side in w:
        _int(side, "example.window", -1, 1 << 40)
    try:
        p = Problem.from_dict(d)
    except (ValueError, TypeError) as e:  # one short line, whatever the value was
        raise Bad("example", " ".join(str(e).split())[:200]) from None
    if p.key(key.direction) != key:
        raise Bad("example", f"its key ({p.key(key.direction).short()}) differs from the "
                   f"entry's problem ({key.short()})")
    return p


def _config(direction: str, d: Any) -> dict[str, Any]:
    allowed = config_fields(CONFIG_TYPES[direction])
    d = expect_object(d, "config", tuple(allowed), ())
    for name, val in d.items():
        choices = allowed[name]
        if isinstance(val, bool) or not isinstance(val, int) or val not in choices:
            raise Bad(f"config.{name}", f"{show(val)} is not allowed; allowed: "
                       f"{', '.join(str(c) for c in choices)}")
    full = asdict(CONFIG_TYPES[direction]())
    full.update(d)
    return full


def _created_at(v: Any) -> str:
    s = _str(v, "created_at", 64)
    try:
        t = datetime.fromisoformat(s)
    except ValueError:
        raise Bad("created_at", f"{show(s)} is not an ISO-8601 time") from None
    if t.tzinfo is None:
        raise Bad("created_at", f"{show(s)} has no time zone; allowed: ISO-8601 with offset")
    try:  # 0001-01-01T00:00:00+01:00 is before year 1 in UTC
        return t.astimezone(timezone.utc).isoformat(timespec="microseconds")
    except OverflowError:
        raise Bad("created_at", f"{show(s)} is out of range in UTC; allowed: years 1 to "
                  "9999") from None


def _device(d: Any) -> DeviceInfo:
    fields_ = ("name", "capability", "sm_count", "memory_gb")
    dev = expect_object(d, "device", fields_, fields_)
    return DeviceInfo(name=_str(dev["name"], "device.name", 200),
                      capability=_str(dev["capability"], "device.capability", 32),
                      sm_count=_int(dev["sm_count"], "device.sm_count", 0, _MAX_SM),
                      memory_gb=_int(dev["memory_gb"], "device.memory_gb", 0, _MAX_GB))


def from_entry(e: Any, software: SoftwareInfo | None = None) -> Result:
    """Validate one export entry and build its Result (raises ``Bad``)."""
    e = expect_object(e, "", _ENTRY_FIELDS, _ENTRY_FIELDS)
    key = _key(e["direction"], e["problem"])
    sw = expect_object(e["software"], "software", _SOFTWARE_FIELDS,
                       tuple(f for f in _SOFTWARE_FIELDS if f not in _SOFTWARE_DEFAULTS))
    sw = {**_SOFTWARE_DEFAULTS, **sw}
    nums = {k: _num(e[k], k, hi) for k, hi in _FLOATS.items()}
    if not nums["p20_ms"] <= nums["median_ms"] <= nums["p80_ms"]:
        raise Bad("median_ms", f"p20 {nums['p20_ms']!r} <= median {nums['median_ms']!r} <= "
                   f"p80 {nums['p80_ms']!r} does not hold")
    r = Result(
        median_ms=nums["median_ms"], p20_ms=nums["p20_ms"], p80_ms=nums["p80_ms"],
        tflops=nums["tflops"], max_error=nums["max_error"],
        search_seconds=nums["search_seconds"],
        device=_device(e["device"]),
        software=SoftwareInfo(**{k: _str(sw[k], f"software.{k}", 128, empty=k == "ptxas")
                                 for k in sw}),
        key=key, problem=_example(e["example"], key), config=_config(key.direction, e["config"]),
        trials=_int(e["trials"], "trials", 0, _MAX_COUNT),
        host=_str(e["host"], "host", 256, empty=True), created_at=_created_at(e["created_at"]),
        flashtune_version=_str(e["flashtune_version"], "flashtune_version", 64),
        origin="imported")
    return r.against(software or software_info())


def to_entry(r: Result) -> dict[str, Any]:
    """The export entry of a result (no fingerprints, no staleness, no origin or verify
    outcome, which belong to the database that holds it: pure content). Key and software
    fields at their defaults are left out, so older exports keep their bytes. A result
    built with the running process's software is exported under its direction's
    (:meth:`SoftwareInfo.for_direction`)."""
    key = {k: v for k, v in r.key.as_dict().items()
           if k != "direction" and not (k in _KEY_DEFAULTS and v == _KEY_DEFAULTS[k])}
    software = {k: v for k, v in r.software.for_direction(r.key.direction).as_dict().items()
                if not (k in _SOFTWARE_DEFAULTS and v == _SOFTWARE_DEFAULTS[k])}
    return {
        "direction": r.key.direction, "problem": key,
        "example": r.problem.as_dict() if r.problem is not None else None,
        "config": dict(r.config), "device": r.device.as_dict(), "software": software,
        "median_ms": r.median_ms, "p20_ms": r.p20_ms, "p80_ms": r.p80_ms, "tflops": r.tflops,
        "max_error": r.max_error, "trials": r.trials, "search_seconds": r.search_seconds,
        "host": r.host, "created_at": r.created_at, "flashtune_version": r.flashtune_version,
    }


def check_result(r: Result) -> Result:
    """Validate a result built in Python the way an import is validated; ValueError if bad."""
    try:
        checked = from_entry(to_entry(r), r.software)
    except Bad as e:
        raise ImportValidationError(f"{r.key.short()}: {e}") from None
    return replace(checked, origin=r.origin, verify=r.verify, verified_at=r.verified_at)


def check_miss(device: DeviceInfo, key: ProblemKey, count: Any, example: Any) -> Problem:
    """Validate one recorded miss as read back (its device, key, count and example, the
    example a dict); returns the example. ValueError naming the field."""
    try:
        _device(device.as_dict())
        k = _key(key.direction, {f: getattr(key, f) for f in _KEY_FIELDS})
        _int(count, "count", 0, 2**63 - 1)
        p = _example(example, k)
    except Bad as e:
        raise ImportValidationError(str(e)) from None
    if p is None:
        raise ImportValidationError("field example: missing")
    return p


def check_task(key: Any, problem: Any) -> tuple[ProblemKey, Problem]:
    """Validate a sweep task's key and problem (decoded JSON) as read back."""
    try:
        if not isinstance(key, dict):
            raise Bad("key", f"expected an object, got {show(key)}")
        k = _key(key.get("direction"), {f: v for f, v in key.items() if f != "direction"})
        p = _example(problem, k)
    except Bad as e:
        raise ImportValidationError(str(e)) from None
    if p is None:
        raise ImportValidationError("field problem: missing")
    return k, p


def sort_key(r: Result) -> tuple[Any, ...]:
    """A result's identity (device, problem key, software), in the order results are listed
    and exported: an entry keeps its place when only its software changes (a relabel, or a
    re-tune under new kernels of the same problem), so two exports of one layer diff line by
    line instead of moving whole blocks."""
    return (r.device.fingerprint, r.key, r.software.fingerprint)
