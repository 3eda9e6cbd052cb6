"""Merge the ``--json`` outputs of ``autotune bench --part 1/N`` .. ``N/N`` into one bench
document: rows in order, geomeans recomputed over all rows (``merge_parts`` in
``flashtune/cli/bench.py``). Refuses parts of different devices, software or timing
orders, and a shape measured twice. CPU only: it reads files.

    autotune bench --preset standard --part 1/2 --json > a.json   # one job
    autotune bench --preset standard --part 2/2 --json > b.json   # another
    python3 benchmarks/merge_bench.py a.json b.json --out bench.json

On a host with two GPUs the parts can run at once, one per GPU: each row's
implementations are still timed side by side on one GPU (session 48, 264 s and 304 s
for the standard preset on an H200 pair):

    for i in 1 2; do CUDA_VISIBLE_DEVICES=$((i - 1)) autotune bench --preset standard \
        --part $i/2 --json > p$i.json & done; wait

A part cut by a time limit keeps the shapes it measured whole; a later run finishes the
set without measuring those again, and merges the same way:

    autotune bench --preset standard --skip-measured a.json --skip-measured b.json \
        --json > c.json
    python3 benchmarks/merge_bench.py a.json b.json c.json --out bench.json
"""

from __future__ import annotations

import argparse
import json
import sys

from flashtune.cli.bench import merge_parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="+")
    ap.add_argument("--out", default="-")
    args = ap.parse_args()
    docs = []
    for path in args.parts:
        with open(path) as f:
            docs.append(json.load(f))
    try:
        merged = merge_parts(docs)
    except ValueError as e:
        sys.exit(f"merge_bench.py: {e}")
    text = json.dumps(merged, indent=2, sort_keys=True)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for kind, ratios in merged["geomean_ratios"].items():
        shown = "  ".join(f"{n} {v:.3f}x" for n, v in ratios.items() if v == v)
        print(f"geomean {kind}: {shown}", file=sys.stderr)


if __name__ == "__main__":
    main()
