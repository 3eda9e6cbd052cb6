"""Import fuzzing: every mutated export file either imports validly or is rejected with
one clear line; never a traceback, and a rejection leaves the database file untouched.

The seed is fixed (replay another with FLASHTUNE_FUZZ_SEED=...)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from flashtune.cli import main
from flashtune.db import open_storage
from flashtune.db.exchange import (
    FORMAT_VERSION,
    export_json,
    import_json,
    to_entry,
    validate_export,
)
from flashtune.exceptions import ImportValidationError
from tests.db import _data

SEED = int(os.environ.get("FLASHTUNE_FUZZ_SEED", "20261121"))
N_CASES = 650
HOLE = "\u0000hole\u0000"  # replaced in the serialized text by raw JSON (huge numbers, ...)


def base_doc() -> dict[str, Any]:
    rng = random.Random(SEED)
    entries = []
    for _ in range(4):
        p = _data.problem(rng)
        entries.append(to_entry(_data.result(rng, p=p, problem=p)))
    return {"format": "flashtune-tuning-db", "format_version": FORMAT_VERSION,
            "entries": entries}


def _slots(node: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) in the document, the root's children included."""
    out: list[tuple[Any, Any]] = []
    keys = node.keys() if isinstance(node, dict) else range(len(node))
    for k in keys:
        out.append((node, k))
        if isinstance(node[k], (dict, list)):
            out.extend(_slots(node[k]))
    return out


def _numeric_slots(d: Any) -> list[tuple[Any, Any]]:
    return [(c, k) for c, k in _slots(d)
            if isinstance(c[k], (int, float)) and not isinstance(c[k], bool)]


def _with_hole(rng: random.Random, d: dict[str, Any], raw: str, numeric: bool = False) -> bytes:
    c, k = rng.choice(_numeric_slots(d) if numeric else _slots(d))
    c[k] = HOLE
    return json.dumps(d).replace(json.dumps(HOLE), raw).encode()


# Each mutation takes (rng, a fresh copy of the base document) and returns file bytes.
def random_bytes(rng: random.Random, d: dict[str, Any]) -> bytes:
    return rng.randbytes(rng.randint(0, 3000))


def truncated(rng: random.Random, d: dict[str, Any]) -> bytes:
    data = json.dumps(d, indent=rng.choice([None, 2])).encode()
    return data[:rng.randrange(len(data))]


def flipped_bytes(rng: random.Random, d: dict[str, Any]) -> bytes:
    data = bytearray(json.dumps(d).encode())
    for _ in range(rng.randint(1, 6)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def wrong_type(rng: random.Random, d: dict[str, Any]) -> bytes:
    c, k = rng.choice(_slots(d))
    pool = [None, True, False, 0, -7, 1.5, "x", "", [], {}, [1, 2], {"a": 1}, "64"]
    c[k] = rng.choice([v for v in pool if type(v) is not type(c[k])])
    return json.dumps(d).encode()


def out_of_range(rng: random.Random, d: dict[str, Any]) -> bytes:
    c, k = rng.choice(_numeric_slots(d))
    c[k] = rng.choice([-1, 0, 3, 7, 48, 100, 257, 2**31, 2**63, 2**64 + 1, -1e-9, 0.5, 1e12,
                       1e300, -5.5])
    return json.dumps(d).encode()


def unknown_field(rng: random.Random, d: dict[str, Any]) -> bytes:
    dicts = [d] + [c[k] for c, k in _slots(d) if isinstance(c[k], dict)]
    rng.choice(dicts)[rng.choice(["tma", "fingerprint", "stale", "block_k", "zz", "x" * 300])] \
        = rng.choice([1, "on", None])
    return json.dumps(d).encode()


def huge_number(rng: random.Random, d: dict[str, Any]) -> bytes:
    raw = rng.choice(["1" + "0" * rng.randint(19, 400), "9" * 5000, "1e999", "-1e999",
                      "123456789012345678901234567890.5"])
    return _with_hole(rng, d, raw, numeric=True)


def deep_nesting(rng: random.Random, d: dict[str, Any]) -> bytes:
    n = rng.choice([30, 900, 5000, 200000])
    raw = rng.choice(["[" * n + "]" * n, '{"a":' * n + "1" + "}" * n, "[" * n])
    return _with_hole(rng, d, raw)


def non_finite(rng: random.Random, d: dict[str, Any]) -> bytes:
    return _with_hole(rng, d, rng.choice(["NaN", "Infinity", "-Infinity"]), numeric=True)


def deleted_field(rng: random.Random, d: dict[str, Any]) -> bytes:
    c, k = rng.choice(_slots(d))
    del c[k]
    return json.dumps(d).encode()


def duplicated_entry(rng: random.Random, d: dict[str, Any]) -> bytes:
    e = copy.deepcopy(rng.choice(d["entries"]))
    e["median_ms"] = e["p20_ms"]
    d["entries"].insert(rng.randrange(len(d["entries"]) + 1), e)
    return json.dumps(d).encode()


def valid_change(rng: random.Random, d: dict[str, Any]) -> bytes:
    """A change that keeps the document valid: other knobs, times, devices, order."""
    e = rng.choice(d["entries"])
    what = rng.randrange(4)
    if what == 0:
        e["config"] = _data.config(rng, e["direction"])
    elif what == 1:  # slower, with the TFLOP/s that implies (a faster one may be past peak)
        median = round(e["median_ms"] * rng.uniform(1, 20), 4)
        e["tflops"] *= e["median_ms"] / median
        e["p20_ms"] = e["median_ms"] = e["p80_ms"] = median
    elif what == 2:
        e["device"]["name"] = f"GPU {rng.randrange(10**6)}"
    else:
        rng.shuffle(d["entries"])
    return json.dumps(d, indent=rng.choice([None, 1])).encode()


def implausible(rng: random.Random, d: dict[str, Any]) -> bytes:
    """Well-typed, in range, and no measurement: the claims that would poison a database."""
    e = rng.choice(d["entries"])
    what = rng.randrange(7)
    if what == 0:  # 0 ms or a denormal, p20 and p80 alike
        e["p20_ms"] = e["median_ms"] = e["p80_ms"] = rng.choice([0.0, 1e-300, 1e-9, 5e-4])
    elif what == 1:  # 0 ms for the median alone
        e["p20_ms"] = e["median_ms"] = 0.0
    elif what == 2:  # a TFLOP/s past any device's peak
        e["tflops"] = rng.choice([1e6, 99999.0, 5001.0])
    elif what == 3:  # a TFLOP/s that contradicts the median and the problem
        e["tflops"] *= rng.choice([0.1, 0.5, 1.5, 10.0])
    elif what == 4:  # faster by 10^4 (or more: to 5000 TFLOP/s at least) with a consistent
        # TFLOP/s: past the device's peak
        f = max(1e4, 5000.0 / e["tflops"])
        e["p20_ms"], e["median_ms"], e["p80_ms"] = (e[k] / f for k in
                                                    ("p20_ms", "median_ms", "p80_ms"))
        e["tflops"] *= f
    elif what == 5:  # an error the correctness gate never passes
        e["max_error"] = rng.choice([1e5, 3.0, 1.5])
    else:  # quantiles out of order
        e["p20_ms"], e["p80_ms"] = e["p80_ms"], e["p20_ms"]
    return json.dumps(d).encode()


MUTATIONS: list[Callable[[random.Random, dict[str, Any]], bytes]] = [
    random_bytes, truncated, flipped_bytes, wrong_type, out_of_range, unknown_field,
    huge_number, deep_nesting, non_finite, deleted_field, duplicated_entry, valid_change,
    implausible]


def checksum(path: Path) -> str:
    h = hashlib.sha256()
    for p in (path, path.with_name(path.name + "-wal")):
        h.update(p.read_bytes() if p.exists() else b"-")
    return h.hexdigest()


def cases(n: int) -> list[tuple[str, bytes]]:
    rng = random.Random(SEED)
    base = base_doc()
    return [(m.__name__, m(rng, copy.deepcopy(base)))
            for m in (MUTATIONS[i % len(MUTATIONS)] for i in range(n))]


def test_fuzzed_imports_are_valid_or_cleanly_rejected(tmp_path: Path) -> None:
    path = tmp_path / "fuzz.db"
    storage = open_storage(str(path))
    storage.put_results(_data.results(SEED, 10))
    before = checksum(path)
    seen: Counter[tuple[str, str]] = Counter()
    prefs = ["faster", "ours", "theirs"]
    for i, (kind, data) in enumerate(cases(N_CASES)):
        where = f"case {i} ({kind}, FLASHTUNE_FUZZ_SEED={SEED})"
        try:
            import_json(storage, data, prefer=prefs[i % 3])
        except ImportValidationError as e:
            msg = str(e)
            assert msg and "\n" not in msg and len(msg) < 500, f"{where}: {msg!r}"
            assert checksum(path) == before, f"{where}: rejected, yet the file changed"
            seen[kind, "rejected"] += 1
        else:
            before = checksum(path)
            seen[kind, "imported"] += 1
    storage.close()
    # The fuzzer really exercised both sides, and every hostile kind was always refused.
    assert sum(v for (_, o), v in seen.items() if o == "rejected") >= 400
    assert seen["valid_change", "imported"] == N_CASES // len(MUTATIONS)
    for kind in ("random_bytes", "huge_number", "non_finite", "duplicated_entry", "implausible"):
        assert seen[kind, "imported"] == 0, kind
    with open_storage(str(path), read_only=True) as s:
        assert validate_export(export_json(s))  # what was imported is still a valid export


def test_cli_import_never_prints_a_traceback(tmp_path: Path) -> None:
    db = tmp_path / "cli.db"
    open_storage(str(db)).close()
    runner = CliRunner()
    for i, (kind, data) in enumerate(cases(36)):
        f = tmp_path / f"case{i}.json"
        f.write_bytes(data)
        before = checksum(db)
        r = runner.invoke(main, ["import", str(f), "--db", str(db)])
        assert r.exit_code in (0, 1), (kind, r.output)
        assert "Traceback" not in r.output and not isinstance(r.exception, Exception) \
            or isinstance(r.exception, SystemExit), (kind, r.output)
        if r.exit_code == 1:
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"Error: {f}: "), (kind, r.stderr)
            assert checksum(db) == before
