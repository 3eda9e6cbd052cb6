"""``autotune bench``'s tuned figures against the figures the shipped entries were stored
with (issue 17: "within 3% of the sweep's own figures"). CPU only: it reads two files.

    python3 benchmarks/compare_shipped.py bench_shipped.json \
        [--shipped flashtune/data/shipped.json] [--out compare.json]

For each bench row timed "fwd" or "bwd" whose config came from the shipped layer (or the
layers ``--layers`` names: ``shipped,user`` where the bench ran beside a sweep database
that was then merged into ``--shipped``), it finds the shipped entry of that device,
direction and problem key, and reports bench's ``tuned`` ms over the entry's
``median_ms``. ``same shape`` says whether the row's problem
is the entry's own example (the shape the sweep timed) or only shares its key (bucketed
lengths or batch-heads), where the two figures time different work and are listed apart.
The two figures are not one measurement: the sweep times the kernels alone; bench times
the public call, and its backward is (forward + backward) - forward.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from flashtune.problem import Problem, ProblemKey


def _entries(path: str, device: str) -> dict[ProblemKey, dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    return {ProblemKey.from_dict({**e["problem"], "direction": e["direction"]}): e
            for e in data["entries"] if e["device"]["name"] == device}


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def compare(bench: dict[str, Any], shipped: str,
            layers: tuple[str, ...] = ("shipped",)) -> dict[str, Any]:
    device = bench["device"]["name"] if isinstance(bench["device"], dict) else bench["device"]
    entries = _entries(shipped, device)
    rows = []
    for r in bench["rows"]:
        direction = r["timing"]
        layer = r.get("tuned_layers", {}).get(direction)
        if direction not in ("fwd", "bwd") or layer not in layers:
            continue
        p = Problem.from_dict(r["problem"])
        e = entries.get(p.key(direction))
        if e is None or "tuned" not in r["ms"]:
            continue
        same = Problem.from_dict(e["example"]) == p
        rows.append({"direction": direction, "shape": r["shape"], "same_shape": same,
                     "bench_ms": r["ms"]["tuned"], "sweep_ms": e["median_ms"],
                     "ratio": r["ms"]["tuned"] / e["median_ms"]})
    summary = {}
    for direction in ("fwd", "bwd"):
        for same in (True, False):
            rs = [x["ratio"] for x in rows if x["direction"] == direction
                  and x["same_shape"] == same]
            if rs:
                summary[f"{direction} {'same shape' if same else 'shared key'}"] = {
                    "rows": len(rs), "geomean": _geomean(rs),
                    "within_3pct": sum(abs(x - 1) <= 0.03 for x in rs),
                    "min": min(rs), "max": max(rs)}
    return {"device": device, "rows": rows, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", help="autotune bench --json output")
    ap.add_argument("--shipped", default="flashtune/data/shipped.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", default="shipped",
                    help="comma-separated layers whose rows to take (default: shipped; add "
                         "'user' where the bench ran beside a sweep database that was then "
                         "merged into --shipped)")
    args = ap.parse_args()
    with open(args.bench) as f:
        result = compare(json.load(f), args.shipped, tuple(args.layers.split(",")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['device']}: bench tuned ms / stored sweep median ms")
    for r in result["rows"]:
        mark = "" if r["same_shape"] else "  (shares the key)"
        print(f"{r['direction']} {r['shape']:<30} {r['bench_ms']:9.4f} {r['sweep_ms']:9.4f} "
              f"{r['ratio']:6.3f}{mark}")
    print("| rows | n | geomean | within 3% | min | max |\n|---|---|---|---|---|---|")
    for name, s in result["summary"].items():
        print(f"| {name} | {s['rows']} | {s['geomean']:.3f} | {s['within_3pct']} | "
              f"{s['min']:.3f} | {s['max']:.3f} |")


if __name__ == "__main__":
    main()
