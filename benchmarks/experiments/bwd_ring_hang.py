"""Does a deterministic Hopper backward hang when its dQ staging ring holds fewer chunks
than a query tile has? (Session 31: a 25 s H100 search lost 120 s to such a config.)

One backward of a 1x2x1024x128 problem with ``hopper_block_m=64, hopper_block_n=128``
and ``--stages`` Q/dO stages, fixed dQ order, checked against an fp32 autograd reference.
With ``--base FILE`` the Hopper backward module is loaded from FILE instead (a copy of
``flashtune/kernels/attn_bwd_hopper.py`` from an older commit). Run it under ``timeout``:
a hang is the answer for the pre-fix module at four stages, and the lent GPU may stay
busy after the kill, so run it last on a machine.

    git show 1f3afc8:flashtune/kernels/attn_bwd_hopper.py > /tmp/base.py
    timeout 45 python3 benchmarks/experiments/bwd_ring_hang.py --stages 4 --base /tmp/base.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, required=True)
    ap.add_argument("--base", default=None, help="load the Hopper backward module from here")
    args = ap.parse_args()
    which = "base" if args.base else "head"
    if args.base:
        spec = importlib.util.spec_from_file_location("flashtune.kernels.attn_bwd_hopper",
                                                      args.base)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    from flashtune.kernels.attn_bwd import bwd_steps
    from flashtune.kernels.config import BwdConfig

    torch.manual_seed(0)
    b, h, s, d = 1, 2, 1024, 128
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    scale = d ** -0.5
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, -1)
    o = (torch.softmax(scores, -1) @ v.float()).to(q.dtype)
    cfg = BwdConfig(variant=3, pre_block_m=32, hopper_block_m=64, hopper_block_n=128,
                    hopper_stages=args.stages, hopper_regs=232, hopper_stagger=1)
    try:
        (dq, dk, dv), steps = bwd_steps(do, q, k, v, o, lse, causal=False, sm_scale=scale,
                                        window=(-1, -1), softcap=0.0, config=cfg,
                                        deterministic=True)
    except Exception as e:
        print(which, args.stages, "refused:", type(e).__name__, str(e)[:200], flush=True)
        return
    print(which, args.stages, "launching", flush=True)
    t0 = time.time()
    for _, launch in steps:
        launch()
    torch.cuda.synchronize()
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    (torch.softmax((qr @ kr.transpose(-1, -2)) * scale, -1) @ vr).backward(do.float())
    errs = [(g.float() - r.grad).abs().max().item() for g, r in ((dq, qr), (dk, kr), (dv, vr))]
    print(which, args.stages, f"ran in {time.time() - t0:.2f} s; max |error| dq {errs[0]:.4f} "
          f"dk {errs[1]:.4f} dv {errs[2]:.4f}", flush=True)


if __name__ == "__main__":
    main()
