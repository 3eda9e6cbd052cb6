"""One backward call of ours (the dispatcher's config) and one of cuDNN's, inside a CUDA
profiler range, for Nsight Compute on an sm90 GPU: the main kernels' counters side by side
(the tensor pipe's activity over the elapsed time and over the SMs' active time: their
ratio is the time an SM sat idle; stall reasons; grid and shared memory).

    FLASHTUNE_DB=/nonexistent/d/x.db ncu --profile-from-start off --clock-control none \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \\
        --csv --page raw python3 benchmarks/experiments/bwd_ncu_calls.py c16k det > c16k.csv

ncu serializes kernels: the two halves of a ``hopper_split=2`` config, which overlap in a
real call, are profiled one after the other (each half's idle time is then its own).
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtune

SHAPES = {"c16k": (1, 16, 16, 16384, 128, True), "u16k": (1, 16, 16, 16384, 128, False),
          "gqa": (4, 32, 8, 4096, 128, True), "c4k": (4, 16, 16, 4096, 128, True),
          # the standard rows where deterministic=False is furthest from 1.1x (session 68)
          "u4k": (4, 16, 16, 4096, 128, False), "u4k64": (4, 32, 32, 4096, 64, False)}


def main(shape: str, det: bool) -> None:
    b, hq, hk, s, d, causal = SHAPES[shape]
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (hq, hk, hk))
    do = torch.randn_like(q)
    ours = flashtune.flash_attention(q, k, v, causal=causal, deterministic=det)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hk)

    def grads(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    for _ in range(3):  # compile and warm up outside the profiled range
        grads(ours), grads(theirs)
    a, c = grads(ours), grads(theirs)
    print("max |dq - dq_cudnn|", (a[0] - c[0]).abs().max().item(), flush=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    grads(ours)
    grads(theirs)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "det")
