"""One-off A/B: did the packed-batch support (19d3dcf) slow the Hopper forward on dense
batches? Kept as the record of session 14's check (BENCHMARKS.md, issue 17).

Times ``flash_attention`` (no grad) with two fixed Hopper configs (the plain grid, and a
persistent grid in tile order 2) and cuDNN in the same process, on six dense shapes, and
prints one JSON line per shape: ms per implementation and the max |diff| to cuDNN. Run it
once per tree, alternating, with the tree under test first on the path:

    git archive 19d3dcf^ flashtune | tar -x -C .stage_old
    PYTHONPATH=.stage_old python3 benchmarks/experiments/hopper_fwd_dense_ab.py old >> ab.jsonl
    PYTHONPATH=. python3 benchmarks/experiments/hopper_fwd_dense_ab.py new >> ab.jsonl

Compare cuDNN ms / ours ms between the tags: the cuDNN column is the same-run anchor that
takes the machine's drift out. Data: benchmarks/data/hopper_fwd_dense_ab_h200.jsonl.
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtune
from flashtune.kernels.config import HOPPER, FwdConfig, default_bwd
from flashtune.problem import Problem
from flashtune.timing import time_fn

SHAPES = [(16, 16, 2048, 128, True), (8, 16, 4096, 128, True), (4, 16, 8192, 128, False),
          (16, 16, 2048, 128, False), (8, 32, 4096, 64, True), (32, 16, 1024, 128, True)]
CONFIGS = {"np": FwdConfig(variant=HOPPER, block_m=128, block_n=128, num_stages=2),
           "pers2": FwdConfig(variant=HOPPER, block_m=128, block_n=128, num_stages=2,
                              persistent=1, tile_order=2)}


def main(tag: str) -> None:
    with torch.no_grad():
        for b, h, s, d, causal in SHAPES:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, generator=g).to("cuda", torch.bfloat16)
                       for _ in range(3))
            p = Problem(b, h, h, s, s, d, "bf16", causal)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                t = time_fn(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                            warmup_ms=25, rep_ms=100)
            row = {"tag": tag, "shape": [b, h, s, d, causal], "cudnn_ms": t.median_ms}
            for name, c in CONFIGS.items():
                cfg = (c, default_bwd(p))
                o = flashtune.flash_attention(q, k, v, causal=causal, config=cfg)
                row[name + "_err"] = (o.float() - ref.float()).abs().max().item()
                row[name + "_ms"] = time_fn(
                    lambda cfg=cfg: flashtune.flash_attention(q, k, v, causal=causal, config=cfg),
                    warmup_ms=25, rep_ms=100).median_ms
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
