"""How far the backward's prior points sit from the shipped winners (CPU only, no kernel runs).

    python benchmarks/prior_coverage.py [--device "NVIDIA H200"] [--capability 9.0] [--min 2]

For every shipped backward entry of the device (dense calls), the prior points of its
example problem (:func:`flashtune.autotune.priors.prior_points`, Hopper support assumed)
of the winner's kernel variant, and the fewest fields by which one of them differs from the
winner (the fields that variant uses; the delta preprocess's tile, the stagger and the GQA
walk order left out: a search's polish moves them in one step each and they are rarely the
difference). A short search starts from these points and polishes one field at a time, so
a winner two or more fields from every point is one it may not reach in its budget: the
rows printed (``--min``) are where a new prior point would pay, to be measured on the GPU.
Prints a histogram of the distances last.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Fields a search's polish moves cheaply and that rarely separate two configs' speed.
MINOR = ("pre_block_m", "hopper_stagger", "hopper_walk")


def distances(entries: list[dict[str, Any]], device: str, capability: str
              ) -> list[tuple[int, str, int | None, int | None, dict[str, tuple[Any, Any]]]]:
    """(entry index, problem label, nearest prior point's index or None, its distance in
    fields or None, the fields that differ as (point, winner)) per dense backward entry of
    ``device``; None where no prior point has the winner's variant."""
    from flashtune.autotune.priors import prior_points
    from flashtune.kernels import config
    from flashtune.kernels.config import BwdConfig, active_fields
    from flashtune.problem import Problem

    config.hopper_support = lambda: ""  # the points a Hopper GPU would get
    out = []
    for index, e in enumerate(entries):
        if e["device"]["name"] != device or e["direction"] != "bwd" \
                or e["problem"].get("packed"):
            continue
        ex = e["example"]
        p = Problem(batch=ex["batch"], heads_q=ex["heads_q"], heads_kv=ex["heads_kv"],
                    seqlen_q=ex["seqlen_q"], seqlen_k=ex["seqlen_k"], head_dim=ex["head_dim"],
                    dtype=ex["dtype"], causal=ex["causal"], window=tuple(ex["window"]),
                    softcap=ex["softcap"],
                    deterministic=e["problem"].get("deterministic", True))
        win = e["config"]
        used = [f for f in active_fields(BwdConfig, win["variant"]) if f not in MINOR]
        best: tuple[int, dict[str, tuple[Any, Any]]] | None = None
        for j, pt in enumerate(prior_points("bwd", p, capability)):
            if pt["variant"] != win["variant"]:
                continue
            diff = {f: (pt.get(f), win.get(f)) for f in used if pt.get(f) != win.get(f)}
            if best is None or len(diff) < len(best[1]):
                best = (j, diff)
        label = p.label() + ("" if p.deterministic else " deterministic=False")
        out.append((index, label, best[0] if best else None, len(best[1]) if best else None,
                    best[1] if best else {}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="NVIDIA H200", help="the shipped entries' GPU name")
    ap.add_argument("--capability", default="9.0", help="the architecture whose priors apply")
    ap.add_argument("--min", type=int, default=2,
                    help="print entries at least this many fields from every point")
    ap.add_argument("--shipped", default=str(ROOT / "flashtune" / "data" / "shipped.json"))
    args = ap.parse_args()
    rows = distances(json.loads(Path(args.shipped).read_text())["entries"], args.device,
                     args.capability)
    if not rows:
        raise SystemExit(f"no shipped backward entries for {args.device!r}")
    for index, label, point, dist, diff in rows:
        if dist is None or dist >= args.min:
            where = "no point of its variant" if point is None else f"point {point}"
            print(f"{index:4} {label:48} {where}: " + ", ".join(
                f"{f} {a} -> {b}" for f, (a, b) in diff.items()))
    hist = Counter("none" if d is None else str(d) for *_x, d, _diff in rows)
    print("fields from the nearest point: " + ", ".join(
        f"{k}: {hist[k]}" for k in sorted(hist, key=lambda k: (k == "none", k))))


if __name__ == "__main__":
    main()
