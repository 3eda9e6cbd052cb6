"""Run one forward shape many times, for a profiler to pick a launch (issue 12, short rows).

    ncu --clock-control none -k regex:attn_fwd --launch-skip 5 --launch-count 1 \
        python3 benchmarks/experiments/profile_fwd_rows.py --shape 32,16,512,128 --causal

``--impl flashtune`` (the heuristic default, or ``--config`` as FwdConfig keyword=value
pairs) or ``--impl cudnn`` (SDPA's cuDNN backend): 20 plain launches (the profiler's pick
lies among them: cuDNN gets no kernel filter), then the house protocol's median
(``flashtune.timing.time_fn``: do_bench, L2 flushed), printed, so the profiled kernel can
be read beside its unprofiled time.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32,16,512,128", help="B,H,S,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--impl", choices=["flashtune", "cudnn"], default="flashtune")
    ap.add_argument("--config", default="", help="FwdConfig fields, e.g. block_m=128,persistent=1")
    a = ap.parse_args()
    b, h, s, d = (int(x) for x in a.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    if a.impl == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=a.causal)
    else:
        import flashtune
        from flashtune.kernels.config import FwdConfig, default_fwd
        from flashtune.problem import Problem

        if a.config:
            kw = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in a.config.split(",")}
            cfg = FwdConfig(**kw)
        else:
            cfg = default_fwd(Problem.from_tensors(q, k, causal=a.causal))
        print("config", cfg)

        def run() -> torch.Tensor:
            return flashtune.flash_attention(q, k, v, causal=a.causal, config=cfg)
    from flashtune.timing import time_fn

    with torch.no_grad():
        for _ in range(20):
            run()
        torch.cuda.synchronize()
        median = time_fn(run).median_ms
    print(f"{a.impl} {a.shape} causal={a.causal} median_ms={median:.4f}")


if __name__ == "__main__":
    main()
