"""Per-shape forward, backward and training-step ratios of a bench file (issue 13's step target).

    python benchmarks/step_table.py bench.json [--anchor cudnn] [--min-seqlen 2048]

Reads the JSON that ``flashtune bench --json`` writes (or ``benchmarks/merge_bench.py``
merges) and prints, per shape, flashtune's speed over the anchor's for the training
forward, the backward and the training step (forward plus backward: the anchor's two
times over ours, the same rows' medians), then how many shapes from ``--min-seqlen``
query tokens reach 1.0x on the step, and the lowest backward row. A shape without both a
forward and a backward row (an inference-only file) has no step. A row whose training
forward or backward reading was mostly host time for ours or the anchor (the bench's
"host_bound", session 65 on) ends with the names: its ratios are not the kernels'.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def step_rows(bench: dict[str, Any], anchor: str = "cudnn") -> list[dict[str, Any]]:
    """One row per shape that has a training-forward and a backward timing with both
    ``tuned`` and ``anchor``: label, query length, and the three ratios (ours over the
    anchor's speed: above 1 is faster)."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in bench["rows"]:
        p = r["problem"]
        label = r["shape"]
        if p.get("causal") and "causal" not in label.split():
            label += " causal"
        by.setdefault(label, {})[r["timing"]] = r
    out = []
    for label, t in by.items():
        if "fwd" not in t or "bwd" not in t:
            continue
        f, b = t["fwd"]["ms"], t["bwd"]["ms"]
        if not all(k in m for m in (f, b) for k in ("tuned", anchor)):
            continue
        bound = {n for k in ("fwd", "bwd") for n in t[k].get("host", {}).get("host_bound", [])
                 if n in ("tuned", anchor)}
        out.append({"shape": label, "seqlen_q": t["bwd"]["problem"]["seqlen_q"],
                    "fwd": f[anchor] / f["tuned"], "bwd": b[anchor] / b["tuned"],
                    "step": (f[anchor] + b[anchor]) / (f["tuned"] + b["tuned"]),
                    "host_bound": sorted(bound)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", help="a bench JSON file")
    ap.add_argument("--anchor", default="cudnn", help="the implementation to compare with")
    ap.add_argument("--min-seqlen", type=int, default=2048,
                    help="count the step target over shapes with at least this many queries")
    args = ap.parse_args(argv)
    bench = json.loads(Path(args.bench).read_text())
    rows = step_rows(bench, args.anchor)
    if not rows:
        raise SystemExit(f"{args.bench}: no shape has forward and backward rows timed for "
                         f"both 'tuned' and {args.anchor!r}")
    geo = [f"{k} {v[f'tuned/{args.anchor}']:.3f}x"
           for k, v in bench.get("geomean_ratios", {}).items() if f"tuned/{args.anchor}" in v]
    if geo:
        print(f"geomean over {args.anchor}: " + ", ".join(geo))
    print(f"{'shape':44} {'fwd':>6} {'bwd':>6} {'step':>6}")
    for r in rows:
        bound = f"  host-bound: {', '.join(r['host_bound'])}" if r["host_bound"] else ""
        print(f"{r['shape']:44} {r['fwd']:6.3f} {r['bwd']:6.3f} {r['step']:6.3f}{bound}")
    long = [r for r in rows if r["seqlen_q"] >= args.min_seqlen]
    low = min(rows, key=lambda r: r["bwd"])
    print(f"step >= 1.0x at S >= {args.min_seqlen}: {sum(r['step'] >= 1.0 for r in long)} of "
          f"{len(long)}; lowest backward {low['bwd']:.3f}x ({low['shape']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
