"""Compile a grid of kernel configs on the GPU host and record what Triton allocated.

For every (kernel, head dim, tile, warps, stages) in the grid: shared memory bytes,
registers, spills, or the compile error. The feasibility model in
flashtune/kernels/config.py is checked against these numbers (see BENCHMARKS.md).

    python benchmarks/probe_resources.py --out probe.jsonl --workers 14
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys


def _compile(job: tuple) -> dict:
    import torch

    from flashtune.kernels.attn_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel
    from flashtune.kernels.attn_fwd import _attn_fwd_kernel

    kernel, d, bm, bn, warps, stages = job
    rec = {"kernel": kernel, "d": d, "bm": bm, "bn": bn, "warps": warps, "stages": stages}
    t = torch.empty(1, 2, 1024, d, device="cuda", dtype=torch.bfloat16)
    f = torch.empty(1, 2, 1024, device="cuda", dtype=torch.float32)
    common = dict(GQA=1, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, MASK_LEFT=False,
                  MASK_RIGHT=True, SOFTCAP=False, IS_VARLEN=False, num_warps=warps,
                  num_stages=stages, grid=(1,))
    try:
        if kernel == "fwd":
            ck = _attn_fwd_kernel.warmup(t, t, t, t, f, t, t, t, t, *t.stride() * 4, 2, 1024,
                                         1024, 0, 0, 0.1, 0.0, 0.0, USE_TMA=False, **common)
        elif kernel == "dkdv":
            ck = _attn_bwd_dkdv_kernel.warmup(t, t, t, t, f, f, t, t, t, t, *t.stride() * 6, 2,
                                              1024, 1024, 0, 0, 0.1, 0.1, 0.0, 0.0, **common)
        else:
            ck = _attn_bwd_dq_kernel.warmup(t, t, t, t, f, f, t, t, t, *t.stride() * 5, 2, 1024,
                                            1024, 0, 0, 0.1, 0.1, 0.0, 0.0, **common)
        rec["shared"] = ck.metadata.shared
        ck._init_handles()  # loads the binary: raises OutOfResources past the smem limit
        rec.update(regs=ck.n_regs, spills=ck.n_spills)
    except Exception as e:  # record, do not stop the probe
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe.jsonl")
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args()
    blocks = (16, 32, 64, 128)
    jobs = []
    for kernel, d in itertools.product(("fwd", "dkdv", "dq"), (64, 128, 256)):
        for bm, bn, warps, stages in itertools.product(blocks + (256,) if kernel == "fwd"
                                                       else blocks, blocks, (4, 8), (1, 2, 3, 4)):
            jobs.append((kernel, d, bm, bn, warps, stages))
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers) as pool, open(args.out, "w") as f:
        for n, rec in enumerate(pool.imap_unordered(_compile, jobs, chunksize=4)):
            f.write(json.dumps(rec) + "\n")
            if n % 100 == 0:
                print(n, "/", len(jobs), rec, flush=True, file=sys.stderr)


if __name__ == "__main__":
    main()
