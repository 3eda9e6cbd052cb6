"""Read an `autotune bench --json` file for signs that timing order moved its figures.

A training forward (inputs that require grad, the LSE saved) does at least the work of an
inference forward of the same implementation and shape, so it should never read faster.
In a bench timed in turn, each implementation's training forward is its first timing,
taken right after the previous implementation's timings or an idle GPU (a compile), and
its inference forward its last. Counts the pairs where the training forward reads more
than ``--margin`` faster than the inference forward, per implementation, and lists the
largest. CPU only: it reads committed JSON.

    python3 benchmarks/experiments/bench_order_artifacts.py \
        benchmarks/data/bench_shipped_h200_s31.json \
        --compare benchmarks/data/compare_shipped_h200_s31.json
    python3 benchmarks/experiments/bench_order_artifacts.py --table benchmarks/data/bench_*.json

Benches made since the bench samples the GPU clocks (rows with ``"clocks"``) also get,
per implementation (in turn) or for the shared loop (side by side), the median SM clock
of its training forward, forward+backward and inference forward timings over the shapes,
and the pairs above with the clocks they ran at: whether a fast training forward ran at a
higher clock than its inference forward is then read, not inferred.
"""

from __future__ import annotations

import argparse
import collections
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json", nargs="+")
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--compare", default=None,
                    help="a compare_shipped.py JSON of the (one) bench file: the correlation "
                         "of the tuned forward's inference/training time ratio with its "
                         "bench/sweep ratio over the same-shape forward rows")
    ap.add_argument("--table", action="store_true",
                    help="one Markdown row per file: the counts per implementation")
    args = ap.parse_args()
    for path in args.bench_json:
        with open(path) as f:
            doc = json.load(f)
        by_shape: dict[str, dict[str, dict]] = collections.defaultdict(dict)
        for row in doc["rows"]:
            by_shape[row["shape"]][row["timing"]] = row
        over: collections.Counter[str] = collections.Counter()
        pairs: collections.Counter[str] = collections.Counter()
        worst = []
        for shape, rows in by_shape.items():
            if "fwd" not in rows or "infer" not in rows:
                continue
            for impl, train_ms in rows["fwd"]["ms"].items():
                infer_ms = rows["infer"]["ms"].get(impl)
                if not infer_ms or not train_ms:
                    continue
                pairs[impl] += 1
                ratio = infer_ms / train_ms  # > 1: the training forward read faster
                if ratio > 1 + args.margin:
                    over[impl] += 1
                    worst.append((ratio, impl, shape))
        if args.table:
            if path == args.bench_json[0]:
                print("| file | " + " | ".join(sorted(pairs)) + " | largest |")
                print("|---" * (len(pairs) + 2) + "|")
            ratio, impl, shape = max(worst, default=(1.0, "-", "-"))
            print(f"| {path.rsplit('/', 1)[-1]} | "
                  + " | ".join(f"{over[i]}/{pairs[i]}" for i in sorted(pairs))
                  + f" | {ratio:.3f} {impl} {shape} |")
            continue
        print(f"{path}: order {doc.get('order', 'in turn')}, "
              f"{doc.get('device', {}).get('name', '?')}")
        print(f"  training forward > {args.margin:.0%} faster than inference, per impl:")
        for impl in sorted(pairs):
            print(f"    {impl:10s} {over[impl]:3d} of {pairs[impl]}")
        print(f"  total {sum(over.values())} of {sum(pairs.values())}; largest:")
        for ratio, impl, shape in sorted(worst, reverse=True)[:args.top]:
            print(f"    {ratio:.3f}  {impl:10s} {shape}")
        if args.compare:
            _correlate(by_shape, args.compare)
        _clocks(by_shape, worst, args.top)


def _mhz(row: dict, name: str) -> float | None:
    s = (row.get("clocks") or {}).get(name)
    return s["sm_mhz"]["median"] if s else None


def _clocks(by_shape: dict[str, dict[str, dict]], worst: list, top: int) -> None:
    """The median SM clock of each timing, over the shapes, per clock log ("all" or an
    implementation), and the largest training-faster pairs with their clocks."""
    import statistics

    logs: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for rows in by_shape.values():
        for timing, row in rows.items():
            for name in row.get("clocks") or {}:
                mhz = _mhz(row, name)
                if mhz is not None:
                    logs[name][timing].append(mhz)
    if not logs:
        return
    print("  median SM clock (MHz) over the shapes, per timing (bwd: the fwd+bwd loop):")
    for name, per in sorted(logs.items()):
        shown = "  ".join(f"{t} {statistics.median(v):.0f}" for t, v in sorted(per.items()))
        print(f"    {name:10s} {shown}")
    for ratio, impl, shape in sorted(worst, reverse=True)[:top]:
        rows = by_shape[shape]
        name = impl if impl in (rows["fwd"].get("clocks") or {}) else "all"
        print(f"    {ratio:.3f} {impl:10s} {shape}: training at {_mhz(rows['fwd'], name)} MHz, "
              f"inference at {_mhz(rows['infer'], name)} MHz")


def _correlate(by_shape: dict[str, dict[str, dict]], compare_path: str) -> None:
    """Whether the rows whose tuned training forward read fast (against its own inference)
    are the rows where the bench read faster than the sweep's stored figure."""
    import statistics

    with open(compare_path) as f:
        compare = json.load(f)
    xs, ys = [], []
    for row in compare["rows"]:
        rows = by_shape.get(row["shape"], {})
        if row["direction"] != "fwd" or not row["same_shape"] or "infer" not in rows:
            continue
        train, infer = rows["fwd"]["ms"].get("tuned"), rows["infer"]["ms"].get("tuned")
        if train and infer:
            xs.append(infer / train)
            ys.append(row["ratio"])  # the bench's ms over the sweep's
    if len(xs) > 2:
        print(f"  {compare_path}: {len(xs)} forward rows; correlation of the tuned "
              f"inference/training ratio with bench/sweep: "
              f"{statistics.correlation(xs, ys):+.2f}")


if __name__ == "__main__":
    main()
