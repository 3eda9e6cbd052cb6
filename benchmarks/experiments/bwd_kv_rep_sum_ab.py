"""A/B of the virtual-KV-heads tail (``hopper_kv_rep``), on an sm90 GPU: the tree's
``HopperBwdLaunch.run`` (each gradient summed from its partials by one ``torch.sum`` into
it) against the same method with session 61's tail (an fp32 sum, then ``copy_``), built
from its source, both with the dispatcher's (shipped) configs of four GQA causal rows, in
one interleaved loop with cuDNN's backward; the two tails' gradients compared bit for bit.

    FLASHTUNE_DB=/tmp/x.db timeout 200 python3 \\
        benchmarks/experiments/bwd_kv_rep_sum_ab.py out.json
"""

from __future__ import annotations

import inspect
import json
import sys
import textwrap

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtune
import flashtune.kernels.attn_bwd_hopper as H
from flashtune.timing import time_interleaved

NEW_TAIL = "torch.sum(part.view(b, hk, self.kv_rep, sk, d), dim=2, out=out)"
OLD_TAIL = "out.copy_(part.view(b, hk, self.kv_rep, sk, d).sum(2, dtype=torch.float32))"
# (batch, query heads, KV heads, sequence, deterministic), causal, head dim 128.
SHAPES = [(4, 32, 8, 4096, True), (4, 32, 8, 4096, False), (2, 32, 8, 8192, True),
          (8, 28, 4, 2048, True)]


def old_run():
    """``HopperBwdLaunch.run`` with the old tail, compiled in the module's namespace."""
    src = textwrap.dedent(inspect.getsource(H.HopperBwdLaunch.run))
    if NEW_TAIL not in src:
        sys.exit("the tree's run() has no torch.sum tail: nothing to compare")
    ns: dict = {}
    exec(compile(src.replace(NEW_TAIL, OLD_TAIL), "old_run", "exec"), H.__dict__, ns)
    return ns["run"]


def main() -> None:
    new, old = H.HopperBwdLaunch.run, old_run()
    rows = []
    for b, hq, hk, s, det in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(b, hq, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, hk, s, 128, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        o = flashtune.flash_attention(q, k, v, causal=True, deterministic=det)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def ours(run, o=o, q=q, k=k, v=v, do=do):
            def f():
                H.HopperBwdLaunch.run = run
                return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            return f

        def cudnn(oc=oc, q=q, k=k, v=v, do=do):
            return torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)

        g_new, g_old = ours(new)(), ours(old)()
        same = all(torch.equal(a, c) for a, c in zip(g_new, g_old, strict=True))
        t = time_interleaved([ours(new), ours(old), cudnn], rounds=5)
        H.HopperBwdLaunch.run = new
        ms = [x.median_ms for x in t]
        rows.append(dict(shape=f"{b}x{hq}/{hk}x{s}x128 causal", deterministic=det,
                         new_ms=ms[0], old_ms=ms[1], cudnn_ms=ms[2], new_over_old=ms[1] / ms[0],
                         new_vs_cudnn=ms[2] / ms[0], old_vs_cudnn=ms[2] / ms[1],
                         bit_identical=same))
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['shape']:26s} det={r['deterministic']!s:5s} new {r['new_ms']:.3f} "
              f"old {r['old_ms']:.3f} cudnn {r['cudnn_ms']:.3f}  new/old "
              f"{r['new_over_old']:.3f}  cudnn/new {r['new_vs_cudnn']:.3f}  cudnn/old "
              f"{r['old_vs_cudnn']:.3f}  same bits {r['bit_identical']}")


if __name__ == "__main__":
    main()
