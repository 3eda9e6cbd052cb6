"""``hopper_dq_frag`` on an sm90 GPU: dQ staged in the wgmma's register order (16-byte
stores, no swizzle, the fp32 accumulator kept in that order) against the staging it
replaces, in both dQ orders, beside cuDNN.

1. ``--check``: the correctness grid of ``hopper_bwd_ab.check`` (odd lengths, Sq != Sk,
   GQA/MQA, window, softcap, one row, one key; free and fixed order, the fixed order three
   times and bit for bit) with the knob on in every config.
2. Timing, per shape, one interleaved loop with L2 flushed before each launch
   (``flashtune.timing.time_interleaved``): cuDNN's backward; the shipped config for the
   call (deterministic) and the same with the knob on (column groups off: one layout per
   buffer); the free order at the default tiles with and without it.

Session 48's ablations (``bwd_ablate.py``) seemed to find the dQ staging stores alone worth
1.39x (fixed order) to 1.56x (free order) of the D=128 backward's time; session 50 found
that ablation had lost dQ's product as well, and measured the stores at 5-9% (fixed) and
30-40% (free).

    timeout 560 python3 benchmarks/experiments/bwd_frag_ab.py --check --shapes 7,10,8 \\
        --out $OUT/frag.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hopper_bwd_ab as ab  # noqa: E402
from hopper_fwd_consumers import shipped_config  # noqa: E402

from flashtune.kernels.config import BWD_HOPPER, BwdConfig  # noqa: E402
from flashtune.timing import time_interleaved  # noqa: E402


def frag(c: BwdConfig) -> BwdConfig:
    return dataclasses.replace(c, hopper_dq_frag=1, hopper_dq_groups=0)


def bench_shape(shape, rounds: int) -> dict[str, Any]:
    d, causal = shape[3], shape[4]
    fns, (do, qd, kd, vd, o, lse), p, scale = ab.shape_inputs(shape)
    ship = shipped_config(p, torch.cuda.get_device_name(), "bwd")
    cfgs: dict[str, tuple[BwdConfig, bool]] = {}
    if ship is not None and ship.variant == BWD_HOPPER:
        cfgs["shipped"] = (ship, True)
        cfgs["shipped+frag"] = (frag(ship), True)
    tiles = BwdConfig(variant=BWD_HOPPER, hopper_block_m=64 if d == 128 else 128)
    cfgs["free"] = (tiles, False)
    cfgs["free+frag"] = (frag(tiles), False)
    cfgs["det"] = (dataclasses.replace(tiles, hopper_dq_groups=int(d == 128)), True)
    cfgs["det+frag"] = (frag(tiles), True)
    errors = {}
    grads = {}
    for name, (cfg, det) in cfgs.items():
        try:
            g, fns[name] = ab.prepared(ab.head_mod, do, qd, kd, vd, o, lse, cfg, causal,
                                       (-1, -1), 0.0, scale, det)
            fns[name]()
            torch.cuda.synchronize()
            grads[name] = g
        except Exception as e:  # reported, not timed
            fns.pop(name, None)
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{name}: {errors[name]}", flush=True)
    # The knob changes where the sums go, not their order: the fixed order's gradients
    # must be the same bits with and without it.
    same = {a: all(torch.equal(x, y) for x, y in zip(grads[a], grads[a + "+frag"], strict=True))
            for a in ("shipped", "det") if a in grads and a + "+frag" in grads}
    names = list(fns)
    timings = time_interleaved([fns[n] for n in names], rounds=rounds)
    ms = {n: t.median_ms for n, t in zip(names, timings, strict=True)}
    return dict(shape=list(shape), ms=ms, configs={n: repr(c) for n, (c, _) in cfgs.items()},
                errors=errors, det_bitwise_same=same)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shapes", default="7,10,8", help="indices into hopper_bwd_ab.SHAPES")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out: dict[str, Any] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                               date=time.strftime("%Y-%m-%d"), check=None, bench=[])
    try:
        if args.check:
            plain = ab.hopper_cfg
            ab.hopper_cfg = lambda m, n, s: frag(plain(m, n, s))
            rows: list = []
            t0 = time.time()
            ok = ab.check(ab.head_mod, rows)
            ab.hopper_cfg = plain
            out["check"] = dict(ok=ok, rows=rows, seconds=time.time() - t0)
            print(f"check frag: {'all OK' if ok else 'FAILED'} ({len(rows)} cases, "
                  f"{time.time() - t0:.0f} s)", flush=True)
        for i in map(int, args.shapes.split(",")):
            r = bench_shape(ab.SHAPES[i], args.rounds)
            out["bench"].append(r)
            print(f"{ab.row_line(ab.SHAPES[i], r['ms'])} | bitwise {r['det_bitwise_same']}",
                  flush=True)
    finally:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
