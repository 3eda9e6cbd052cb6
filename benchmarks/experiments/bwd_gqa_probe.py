"""Why the Hopper backward loses its rate under GQA (issue 13): one interleaved loop per shape.

Session 33 measured ours at 406 TFLOP/s on 4x32/8x4096x128 against 484 on 4x16x4096x128,
while cuDNN kept its rate (548 against 566). This script times, per shape, on the same
inputs and in one interleaved loop with L2 flushed before each launch
(``flashtune.timing.time_interleaved``):

- ``cudnn``: SDPA's cuDNN backward (``autograd.grad`` on a retained graph);
- ``det:NAME`` / ``free:NAME``: the Hopper backward of module NAME (``head``: the tree's;
  others: ``--variant NAME=path`` copies of ``attn_bwd_hopper.py``) at the shape's shipped
  Hopper tiles (or the defaults), fixed and free dQ order;
- ``expand`` (``--expand``): K/V repeated to the query heads, the tree's non-GQA fixed-order
  backward, and dK/dV summed over each group (a fixed order): what a GQA call would cost
  run as its non-GQA twin plus two copies and a reduction.

Every variant's gradients are compared with the first one's (``max_diff``): the fixed
orders of two correct modules agree to rounding.

    timeout -k 10 300 python3 benchmarks/experiments/bwd_gqa_probe.py \\
        --variant flat=scratch/attn_bwd_hopper.py --out $OUT/gqa.json

Shapes (``--shapes``, comma-separated ``BxHQxHKxSxD`` with an optional ``c`` for causal):
by default 4x16x16, 4x32x32, 4x32x16 and 4x32x8 at S=4096, D=128.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hopper_bwd_ab import load, prepared  # noqa: E402
from hopper_fwd_consumers import shipped_config  # noqa: E402

from flashtune.kernels import attn_bwd_hopper as head_mod  # noqa: E402
from flashtune.kernels.attn_fwd import attn_fwd  # noqa: E402
from flashtune.kernels.config import BWD_HOPPER, BwdConfig, default_fwd  # noqa: E402
from flashtune.problem import Problem  # noqa: E402
from flashtune.timing import time_interleaved  # noqa: E402

DEFAULT_SHAPES = "4x16x16x4096x128,4x32x32x4096x128,4x32x16x4096x128,4x32x8x4096x128"


def parse_shape(text: str) -> tuple[int, int, int, int, int, bool]:
    causal = text.endswith("c")
    b, hq, hk, s, d = (int(x) for x in text.rstrip("c").split("x"))
    return b, hq, hk, s, d, causal


def hopper_config(p: Problem) -> BwdConfig:
    ship = shipped_config(p, torch.cuda.get_device_name(), "bwd")
    if isinstance(ship, BwdConfig) and ship.variant == BWD_HOPPER:
        return ship
    return BwdConfig(variant=BWD_HOPPER, hopper_block_m=64 if p.head_dim == 128 else 128,
                     hopper_block_n=128, hopper_stages=2, hopper_regs=240)


def bench(shape: tuple[int, int, int, int, int, bool], mods: dict[str, Any], expand: bool,
          rounds: int) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, hq, hk, s, d, causal = shape
    torch.manual_seed(0)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    do = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oc = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hk)
    fns: dict[str, Any] = {
        "cudnn": lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)}
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    p = Problem(b, hq, hk, s, s, d, "bf16", causal)
    cfg = hopper_config(p)
    kw = dict(causal=causal, sm_scale=scale, window=(-1, -1), softcap=0.0)
    o, lse = attn_fwd(qd, kd, vd, config=default_fwd(p), **kw)
    grads = {}
    for det in (True, False):
        for name, mod in mods.items():
            label = f"{'det' if det else 'free'}:{name}"
            grads[label], fns[label] = prepared(mod, do, qd, kd, vd, o, lse, cfg, causal,
                                                (-1, -1), 0.0, scale, det)
    if expand and hq != hk:
        g = hq // hk
        ke = kd.repeat_interleave(g, dim=1)
        ve = vd.repeat_interleave(g, dim=1)
        ge, inner = prepared(head_mod, do, qd, ke, ve, o, lse, cfg, causal, (-1, -1), 0.0,
                             scale, True)

        def run_expanded() -> None:
            ke.copy_(kd.repeat_interleave(g, dim=1))
            ve.copy_(vd.repeat_interleave(g, dim=1))
            inner()
            ge[1].view(b, hk, g, s, d).sum(2)
            ge[2].view(b, hk, g, s, d).sum(2)
        fns["expand"] = run_expanded
    for f in fns.values():  # compile outside the timed loop
        f()
    torch.cuda.synchronize()
    first = next(iter(grads.values()))
    diff = {n: max(float((a.float() - r.float()).abs().max())
                   for a, r in zip(gr, first, strict=True)) for n, gr in grads.items()}
    names = list(fns)
    timings = time_interleaved([fns[n] for n in names], rounds=rounds)
    ms = {n: t.median_ms for n, t in zip(names, timings, strict=True)}
    flops = 4 * 2.5 * b * hq * s * s * d * (0.5 if causal else 1.0)
    return dict(shape=list(shape), config=dataclasses.asdict(cfg), ms=ms, max_diff=diff,
                tflops={n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=path of a copy of attn_bwd_hopper.py (timed beside head)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--expand", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    mods: dict[str, Any] = {"head": head_mod}
    for spec in args.variant:
        name, _, path = spec.partition("=")
        mods[name] = load(name, path)
    out: dict[str, Any] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                               date=time.strftime("%Y-%m-%d"), variants=args.variant, rows=[])
    try:
        for text in args.shapes.split(","):
            r = bench(parse_shape(text), mods, args.expand, args.rounds)
            out["rows"].append(r)
            cells = " ".join(f"{n}={t:.0f}" for n, t in r["tflops"].items())
            print(f"{text} TFLOP/s: {cells}", flush=True)
    finally:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
