"""Three launches of one backward, for ncu to profile the third (H100 profile of session 26:
``benchmarks/data/ncu_bwd_h100_s26.json``).

Workloads: ``det128`` / ``free128`` the Hopper backward in the fixed / free order at
4x16x4096x128 (64-row query tiles), ``det64`` the fixed order at 4x32x4096x64 with 128-row
tiles, ``cudnn128`` / ``cudnn64`` cuDNN's SDPA backward at those shapes; ``detgqa`` /
``freegqa`` / ``deth32`` the fixed / free order at 4x32/8x4096x128 (GQA 4) and the fixed
order at 4x32x4096x128, with 64-row query tiles and the walk in ascending order (issue 13's
GQA rows, session 34). On an sm90 GPU:

    ncu --metrics <list> --kernel-name regex:_attn_bwd_hopper_kernel --launch-skip 2 \
        --launch-count 1 --csv --page raw python3 benchmarks/experiments/ncu_bwd.py det128

(cuDNN's kernel: ``--kernel-name 'regex:.*(bprop|dgrad|bwd|backward).*'``.)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtune.kernels.attn_bwd import attn_bwd
from flashtune.kernels.attn_fwd import attn_fwd
from flashtune.kernels.config import BWD_HOPPER, BwdConfig, default_fwd
from flashtune.problem import Problem, default_scale

WORKLOADS = ("det128", "free128", "cudnn128", "det64", "cudnn64", "detgqa", "freegqa", "deth32")


def main(which: str) -> None:
    if which not in WORKLOADS:
        raise SystemExit(f"unknown workload {which!r}; allowed: {', '.join(WORKLOADS)}")
    torch.manual_seed(0)
    b, h, s, d, m = (4, 32, 4096, 64, 128) if which.endswith("64") else (4, 16, 4096, 128, 64)
    hk, order = h, 1
    if which in ("detgqa", "freegqa", "deth32"):
        h, hk, order = 32, 8 if which == "detgqa" else 32, 0
    q, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if which.startswith("cudnn"):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg)
            for _ in range(3):
                torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
        torch.cuda.synchronize()
        return
    p = Problem(b, h, hk, s, s, d, "bf16", False)
    kw = dict(causal=False, sm_scale=default_scale(d), window=(-1, -1), softcap=0.0)
    o, lse = attn_fwd(q, k, v, config=default_fwd(p), **kw)
    cfg = BwdConfig(variant=BWD_HOPPER, hopper_block_m=m, hopper_stagger=order)
    for _ in range(3):
        attn_bwd(do, q, k, v, o, lse, config=cfg, deterministic=which.startswith("det"), **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
