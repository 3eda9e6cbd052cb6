"""``FwdConfig.defer_o`` A/B: a tile's O store waited for behind the next tile's first
product, against at once (issue 12).

Session 20's arithmetic put about 5 us per tile on short rows into each tile's serial start
and end; one part of the end was the consumer waiting for its TMA store of O to finish
before it took the next tile. With ``defer_o=1`` the store completes while the next tile's
first QK^T runs. For each shape of the standard matrix (``--max-seq`` to narrow), the
shipped config for this GPU and the heuristic default, each where it runs a persistent
grid with two Q buffers, are timed with and without the knob in one interleaved loop beside
cuDNN (the inference forward, through ``flash_attention`` with the config forced; house
protocol), after checking that both give the same O and LSE bit for bit. Prints
cuDNN / ours for both and on / off, and writes JSON.

    timeout -k 10 400 python3 benchmarks/experiments/fwd_defer_o_ab.py --out $OUT/defer.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import _label, environment  # noqa: E402
from hopper_fwd_consumers import shipped_config  # noqa: E402

from flashtune.kernels.attention import flash_attention  # noqa: E402
from flashtune.kernels.config import HOPPER, default_fwd, is_feasible  # noqa: E402
from flashtune.problem import Problem  # noqa: E402
from flashtune.timing import anchors, make_inputs, standard_matrix, time_interleaved  # noqa: E402


def pairs(p: Problem) -> dict[str, tuple[Any, Any]]:
    """{name: (off, on)} for the shipped config and the default, where defer_o can run."""
    out = {}
    for name, c in (("shipped", shipped_config(p, torch.cuda.get_device_name())),
                    ("default", default_fwd(p))):
        if c is None or c.variant != HOPPER:
            continue
        off, on = dataclasses.replace(c, defer_o=0), dataclasses.replace(c, defer_o=1)
        if is_feasible(on, p)[0] and off not in [x for x, _ in out.values()]:
            out[name] = (off, on)
    return out


def scan(p: Problem, rep_ms: float) -> dict[str, Any]:
    row: dict[str, Any] = {"label": _label(p), "problem": p.as_dict(), "pairs": {}}
    got = pairs(p)
    if not got:
        row["skipped"] = "no config here runs a persistent grid with two Q buffers"
        return row
    q, k, v = make_inputs(p, "cuda")
    names: list[str] = []
    fns: list[Any] = []
    for name, (off, on) in got.items():
        o0, l0 = flash_attention(q, k, v, causal=p.causal, return_lse=True, config=off)
        o1, l1 = flash_attention(q, k, v, causal=p.causal, return_lse=True, config=on)
        same = bool(torch.equal(o0, o1) and torch.equal(l0, l1))
        row["pairs"][name] = {"config": dataclasses.asdict(off), "bit_identical": same}
        if not same:
            continue  # a wrong output is reported, never timed
        for tag, c in (("off", off), ("on", on)):
            names.append(f"{name}:{tag}")
            fns.append(lambda c=c: flash_attention(q, k, v, causal=p.causal, config=c))
    cudnn = anchors(p, ("cudnn",)).get("cudnn")
    if cudnn is not None:
        names.append("cudnn")
        fns.append(lambda: cudnn(q, k, v))
    with torch.no_grad():
        ts = time_interleaved(fns, rep_ms=rep_ms, rounds=3)
    row["ms"] = {n: t.median_ms for n, t in zip(names, ts, strict=True)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-seq", type=int, default=16384)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    args = ap.parse_args()
    rows = []
    for p in standard_matrix():
        if p.seqlen_q > args.max_seq:
            continue
        rows.append(scan(p, args.rep_ms))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        with open(args.out, "w") as f:  # after every shape: a run cut short keeps its rows
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    gains: dict[str, list[float]] = {}
    print(f"{'shape':34s} {'pair':8s} {'cuDNN/off':>10s} {'cuDNN/on':>10s} {'on/off':>8s}")
    for r in rows:
        ms = r.get("ms", {})
        for name, info in r["pairs"].items():
            if not info["bit_identical"]:
                print(f"{r['label']:34s} {name:8s} OUTPUTS DIFFER")
                continue
            off, on = ms[f"{name}:off"], ms[f"{name}:on"]
            c = ms.get("cudnn", math.nan)
            gains.setdefault(name, []).append(math.log(off / on))
            print(f"{r['label']:34s} {name:8s} {c / off:10.3f} {c / on:10.3f} {off / on:8.3f}")
        if "skipped" in r:
            print(f"{r['label']:34s} skipped: {r['skipped']}")
    for name, g in gains.items():
        print(f"{name}: defer_o=1 over 0, geomean {math.exp(sum(g) / len(g)):.3f} "
              f"over {len(g)} shapes (min {math.exp(min(g)):.3f}, max {math.exp(max(g)):.3f})")


if __name__ == "__main__":
    main()
