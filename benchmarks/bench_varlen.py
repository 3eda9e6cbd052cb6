"""Packed (varlen) attention under the house protocol (DESIGN.md), issue 15's comparison.

A packed batch of 64 sequences, lengths drawn log-uniformly from 128 to 8192 and scaled to
about 64k tokens, Hq=32, Hkv=8, D=128, causal, bf16. Times, in one process, the training
forward and the backward ((fwd+bwd) - fwd) of:

- ``varlen``: ``flashtune.flash_attn_varlen_func`` (the dispatcher's config; on sm90
  untuned, the Hopper forward); ``varlen_portable``: the same on the portable kernels'
  default configs;
- ``flex``: compiled FlexAttention with a document mask (causal within each sequence);
- ``sdpa_per_seq``: ``F.scaled_dot_product_attention`` (torch's default backend) run
  sequence by sequence on per-sequence tensors;
- ``dense``: ``flashtune.flash_attention`` on a dense batch of the same total tokens, each
  row as long as the FLOP-weighted mean length (sum L^2 / sum L), so the FLOPs match too;
  ``dense_portable``: the same on the portable kernels' default configs (the like-for-like
  comparison for ``varlen_portable``).

TFLOP/s count each sequence's own causal FLOPs (4·Hq·L²·D / 2 forward, 2.5x backward).
Targets: varlen >= 1.25x flex, varlen >= 0.9x dense. Prints a short table; writes JSON
(GPU, versions, date, lengths, timings, ratios) to --out.

    python benchmarks/bench_varlen.py --out benchmarks/data/varlen_h200.json
    TRITON_INTERPRET=1 python benchmarks/bench_varlen.py --tiny --out tiny.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F

# Run as a script, this file's folder is on sys.path: the shared environment record.
from bench_attention import environment

import flashtune
from flashtune.kernels.config import default_bwd, default_portable_fwd
from flashtune.problem import Problem
from flashtune.timing import Timing, time_fn


def draw_lengths(n: int, lo: int, hi: int, tokens: int, seed: int) -> list[int]:
    """``n`` lengths, log-uniform in [lo, hi], scaled (and clamped) to about ``tokens``."""
    rng = random.Random(seed)
    lens = [math.exp(rng.uniform(math.log(lo), math.log(hi))) for _ in range(n)]
    for _ in range(20):
        scale = tokens / sum(lens)
        lens = [min(max(x * scale, lo), hi) for x in lens]
    return [int(round(x)) for x in lens]


def causal_flops(lens: list[int], hq: int, d: int) -> float:
    """Forward FLOPs counted per sequence: 4·Hq·L²·D, halved for causal."""
    return sum(4.0 * hq * n * n * d / 2 for n in lens)


def fwd_bwd_timings(run: Callable[[], torch.Tensor], do: torch.Tensor, warmup: float,
                    rep: float, leaves: list[torch.Tensor]) -> dict[str, Timing]:
    """Training forward, and backward as (forward+backward) - forward, the ``leaves``'
    grads reset before each call (stored, not accumulated)."""
    t_fwd = time_fn(run, warmup_ms=warmup, rep_ms=rep)

    def fwd_bwd() -> None:
        torch.autograd.backward(run(), do)

    t_fb = time_fn(fwd_bwd, warmup_ms=warmup, rep_ms=rep, grad_to_none=leaves)
    bwd = Timing(max(t_fb.median_ms - t_fwd.median_ms, 1e-6),
                 max(t_fb.p20_ms - t_fwd.p20_ms, 1e-6), max(t_fb.p80_ms - t_fwd.p80_ms, 1e-6),
                 t_fb.interpreter)
    return {"fwd": t_fwd, "bwd": bwd}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where to write the JSON results")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=25.0, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=float, default=100.0, help="do_bench repetitions (ms)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--tiny", action="store_true",
                    help="a few short sequences, small heads (a CPU-interpreter smoke run)")
    args = ap.parse_args()
    if args.tiny:
        args.seqs, args.min_len, args.max_len, args.tokens = 4, 16, 64, 128
        args.heads_q, args.heads_kv, args.head_dim, args.no_flex = 4, 2, 32, True
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ("cache_size_limit", "recompile_limit"):  # else Flex silently runs eager
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))

    lens = draw_lengths(args.seqs, args.min_len, args.max_len, args.tokens, args.seed)
    total, hq, hk, d = sum(lens), args.heads_q, args.heads_kv, args.head_dim
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    g = torch.Generator().manual_seed(args.seed)

    leaves: list[torch.Tensor] = []  # their grads are reset before each timed backward

    def leaf(*shape: int) -> torch.Tensor:
        leaves.append(torch.randn(*shape, generator=g).to(device, torch.bfloat16)
                      .requires_grad_())
        return leaves[-1]

    q, k, v = leaf(total, hq, d), leaf(total, hk, d), leaf(total, hk, d)
    do = torch.randn(total, hq, d, generator=g).to(device, torch.bfloat16)
    flops = causal_flops(lens, hq, d)
    runs: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor, float]] = {}

    def varlen() -> torch.Tensor:
        out = flashtune.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        assert isinstance(out, torch.Tensor)
        return out

    runs["varlen"] = (varlen, do, flops)
    pv = Problem(len(lens), hq, hk, max(lens), max(lens), d, "bf16", True, total_q=total,
                 total_k=total)
    portable_v = (default_portable_fwd(pv), default_bwd(pv))

    def varlen_portable() -> torch.Tensor:
        out = flashtune.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                               causal=True, config=portable_v)
        assert isinstance(out, torch.Tensor)
        return out

    runs["varlen_portable"] = (varlen_portable, do, flops)

    # SDPA sequence by sequence, on per-sequence (1, H, L, D) tensors (no copies timed).
    bounds = cu.tolist()
    per_seq = [[leaf(1, h, n, d) for h in (hq, hk, hk)] for n in lens]
    do_seq = torch.cat([torch.randn(1, hq, n, d, generator=g).to(device, torch.bfloat16)
                        .flatten() for n in lens])

    def sdpa_per_seq() -> torch.Tensor:
        return torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True,
                                                         enable_gqa=hq != hk).flatten()
                          for a, b, c in per_seq])

    runs["sdpa_per_seq"] = (sdpa_per_seq, do_seq, flops)

    if not args.no_flex and device == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lens), device=device),
                                      torch.tensor(lens, device=device))

        def document_causal(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            return (doc[qi] == doc[ki]) & (ki <= qi)

        mask = create_block_mask(document_causal, None, None, total, total, device=device)
        flex = torch.compile(flex_attention, dynamic=False)

        def flex_run() -> torch.Tensor:
            out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                       v.transpose(0, 1)[None], block_mask=mask, enable_gqa=hq != hk)
            return out[0].transpose(0, 1)

        runs["flex"] = (flex_run, do, flops)

    # Dense at the same total tokens and the same FLOPs: rows of the FLOP-weighted mean length.
    s_dense = max(16, int(round(sum(n * n for n in lens) / total / 16)) * 16)
    b_dense = max(1, total // s_dense)
    qd, kd, vd = leaf(b_dense, hq, s_dense, d), leaf(b_dense, hk, s_dense, d), \
        leaf(b_dense, hk, s_dense, d)
    do_d = torch.randn(b_dense, hq, s_dense, d, generator=g).to(device, torch.bfloat16)
    flops_d = 4.0 * b_dense * hq * s_dense * s_dense * d / 2

    def dense() -> torch.Tensor:
        out = flashtune.flash_attention(qd, kd, vd, causal=True)
        assert isinstance(out, torch.Tensor)
        return out

    runs["dense"] = (dense, do_d, flops_d)
    # The same dense batch on the portable kernels, against varlen_portable.
    pd = Problem(b_dense, hq, hk, s_dense, s_dense, d, "bf16", True)
    portable = (default_portable_fwd(pd), default_bwd(pd))

    def dense_portable() -> torch.Tensor:
        out = flashtune.flash_attention(qd, kd, vd, causal=True, config=portable)
        assert isinstance(out, torch.Tensor)
        return out

    runs["dense_portable"] = (dense_portable, do_d, flops_d)

    # Sanity: packed output against SDPA per sequence (max abs difference, bf16).
    with torch.no_grad():
        got = varlen()
        ref = torch.cat([F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
            v[a:b].transpose(0, 1)[None], is_causal=True, enable_gqa=hq != hk)[0]
            .transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    max_diff = (got.float() - ref.float()).abs().max().item()

    results: dict[str, Any] = {}
    for name, (run, grad, fl) in runs.items():
        try:
            t = fwd_bwd_timings(run, grad, args.warmup, args.rep, leaves)
        except Exception as e:  # record, keep the others
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        results[name] = {part: {**tm.as_dict(), "tflops": tm.tflops(fl * (2.5 if part == "bwd"
                                                                         else 1.0))}
                         for part, tm in t.items()}

    def ratio(a: str, b: str, part: str) -> float | None:
        ra, rb = results.get(a, {}).get(part), results.get(b, {}).get(part)
        return ra["tflops"] / rb["tflops"] if ra and rb else None

    ratios = {f"varlen/{b} {part}": ratio("varlen", b, part)
              for b in ("flex", "sdpa_per_seq", "dense", "dense_portable", "varlen_portable")
              for part in ("fwd", "bwd")}
    ratios.update({f"varlen_portable/dense_portable {part}":
                   ratio("varlen_portable", "dense_portable", part) for part in ("fwd", "bwd")})
    doc_out = {"env": environment(), "command": " ".join(sys.argv),
               "shape": {"sequences": len(lens), "tokens": total, "heads_q": hq,
                         "heads_kv": hk, "head_dim": d, "causal": True, "dtype": "bf16",
                         "lengths": lens, "dense_batch": b_dense, "dense_seqlen": s_dense},
               "max_abs_diff_vs_sdpa": max_diff, "results": results, "ratios": ratios,
               "targets": {"varlen/flex": 1.25, "varlen/dense": 0.9}}
    with open(args.out, "w") as f:
        json.dump(doc_out, f, indent=1)

    print(f"{len(lens)} sequences, {total} tokens (lengths {min(lens)}..{max(lens)}), "
          f"Hq={hq} Hkv={hk} D={d} causal bf16; dense rows B={b_dense} S={s_dense}; "
          f"varlen vs SDPA max |diff| {max_diff:.3g}")
    print(f"{'impl':16s} {'fwd TFLOP/s':>12s} {'bwd TFLOP/s':>12s}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:16s} error: {r['error'][:80]}")
            continue
        print(f"{name:16s} {r['fwd']['tflops']:12.1f} {r['bwd']['tflops']:12.1f}")
    for name, x in ratios.items():
        if x is not None:
            print(f"{name:28s} {x:6.2f}x")


if __name__ == "__main__":
    main()
