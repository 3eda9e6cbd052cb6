"""The GQA causal backward two ways on an sm90 GPU, beside cuDNN's: the group's query
heads in one program (what the Hopper kernel does, dK and dV summed in registers), and K/V
expanded to the query heads (``repeat_interleave``, its cost included) through the MHA
kernel with dK and dV summed over the group afterwards (bf16 per head, as cuDNN's
``fmha_reduce_head`` does). Errors against an fp32 reference, reruns bit-identical in the
fixed order, and times in one interleaved loop (L2 flushed before each launch).

    FLASHTUNE_DB=/nonexistent/d/x.db timeout 300 python3 benchmarks/experiments/bwd_gqa_expand.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtune
from flashtune.timing import time_interleaved

B, HQ, HK, S, D = 4, 32, 8, 4096, 128


def main() -> None:
    g = HQ // HK
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (HQ, HK, HK))
    do = torch.randn_like(q)

    def grad(out, ins):
        return torch.autograd.grad(out, ins, do, retain_graph=True)

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oc = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    ref = torch.autograd.grad(o32, (q32, k32, v32), do.float())
    fns = {"cudnn": lambda: grad(oc, (q, k, v))}
    for det in (True, False):
        tag = "det" if det else "free"
        o = flashtune.flash_attention(q, k, v, causal=True, deterministic=det)
        fns[f"group:{tag}"] = lambda o=o: grad(o, (q, k, v))
        kx = k.detach().repeat_interleave(g, 1).requires_grad_()
        vx = v.detach().repeat_interleave(g, 1).requires_grad_()
        ox = flashtune.flash_attention(q, kx, vx, causal=True, deterministic=det)

        def expanded(ox=ox, kx=kx, vx=vx):
            k.detach().repeat_interleave(g, 1)  # the expansion's cost (result unused here)
            v.detach().repeat_interleave(g, 1)
            dq, dkx, dvx = grad(ox, (q, kx, vx))
            return dq, dkx.view(B, HK, g, S, D).sum(2), dvx.view(B, HK, g, S, D).sum(2)

        fns[f"expand:{tag}"] = expanded
    for name, fn in fns.items():
        out = fn()
        err = [(a.float() - r).abs().max().item() for a, r in zip(out, ref, strict=True)]
        same = (all(torch.equal(x, y) for x, y in zip(out, fn(), strict=True))
                if name.endswith(":det") else None)
        print(name, "max err dq dk dv", [f"{e:.4f}" for e in err], "bit-identical rerun",
              same, flush=True)
    names = list(fns)
    times = time_interleaved([fns[n] for n in names], rounds=3)
    for n, t in zip(names, times, strict=True):
        print(f"{n:14s} {t.median_ms:.3f} ms  cudnn/x {times[0].median_ms / t.median_ms:.3f}")


if __name__ == "__main__":
    main()
