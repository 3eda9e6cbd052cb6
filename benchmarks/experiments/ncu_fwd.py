"""Three inference forwards of one shape, for ncu to profile the third (session 40's profile
of the D=64 forward: ``benchmarks/data/ncu_fwd_d64_h200_s40.json``).

Workloads: ``ours`` the Hopper forward with this GPU's shipped config, ``pp`` the same with
``pingpong=1``, ``cudnn`` cuDNN's SDPA forward. The shape is BxHxSxD (default
1x32x16384x64, non-causal). On an sm90 GPU:

    ncu --metrics <list> --kernel-name regex:_attn_fwd_hopper_kernel --launch-skip 2 \\
        --launch-count 1 --csv --page raw python3 benchmarks/experiments/ncu_fwd.py ours

(cuDNN's kernel: ``--kernel-name 'regex:.*(fprop|fwd|forward).*'``.)
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hopper_fwd_consumers import shipped_config  # noqa: E402

from flashtune.kernels.attention import flash_attention  # noqa: E402
from flashtune.problem import Problem  # noqa: E402

WORKLOADS = ("ours", "pp", "cudnn")


def main(which: str, shape: str = "1x32x16384x64") -> None:
    if which not in WORKLOADS:
        raise SystemExit(f"unknown workload {which!r}; allowed: {', '.join(WORKLOADS)}")
    b, h, s, d = (int(x) for x in shape.split("x"))
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        if which == "cudnn":
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                for _ in range(3):
                    F.scaled_dot_product_attention(q, k, v)
        else:
            cfg = shipped_config(Problem(b, h, h, s, s, d, "bf16", False),
                                 torch.cuda.get_device_name())
            if cfg is None:
                raise SystemExit(f"no shipped forward config for {shape} on this GPU")
            if which == "pp":
                cfg = dataclasses.replace(cfg, pingpong=1)
            for _ in range(3):
                flash_attention(q, k, v, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(*sys.argv[1:])
