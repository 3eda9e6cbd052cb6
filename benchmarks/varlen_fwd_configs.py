"""The Hopper forward's configs on bench_varlen.py's packed batch and on its dense twin.

Times the forward (no grad) under the house protocol (DESIGN.md) for a small grid of Hopper
configs (key-tile width and ring depth, persistent grid and tile order, ping-pong) and the
portable default, on:

- the packed batch of ``bench_varlen.py`` (64 sequences, lengths log-uniform in 128..8192
  scaled to about 64k tokens, Hq=32, Hkv=8, D=128, causal, bf16), through
  ``flash_attn_varlen_func``;
- the dense batch of the same total tokens and FLOPs, through ``flash_attention``.

TFLOP/s count each sequence's own causal FLOPs. Every config is checked against the
default config's output first (max |diff| <= 2e-2 after bf16 rounding of both), so a wrong
config is reported, never timed. It is for choosing defaults; the tuner is what picks a
config per problem.

    python benchmarks/varlen_fwd_configs.py --out $OUT/varlen_configs.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

import torch

# Run as a script, this file's folder is on sys.path.
from bench_attention import environment
from bench_varlen import causal_flops, draw_lengths

import flashtune
from flashtune.kernels.config import (
    HOPPER,
    FwdConfig,
    config_to_dict,
    default_bwd,
    default_fwd,
    default_portable_fwd,
    is_feasible,
)
from flashtune.problem import Problem
from flashtune.timing import time_fn


def hopper_grid(p: Problem) -> list[FwdConfig]:
    """The Hopper configs scanned: feasible ones only."""
    out = []
    for (bn, st), (pers, order), pp in itertools.product(
            ((128, 2), (64, 3)), ((0, 0), (0, 2), (1, 1), (1, 2)), (0, 1)):
        c = FwdConfig(variant=HOPPER, block_m=128, block_n=bn, num_stages=st, persistent=pers,
                      tile_order=order, pingpong=pp)
        if is_feasible(c, p)[0]:
            out.append(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=25.0)
    ap.add_argument("--rep", type=float, default=100.0)
    args = ap.parse_args()
    hq, hk, d, device = 32, 8, 128, "cuda"
    lens = draw_lengths(64, 128, 8192, 65536, args.seed)
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    g = torch.Generator().manual_seed(args.seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, torch.bfloat16)

    q, k, v = rnd(total, hq, d), rnd(total, hk, d), rnd(total, hk, d)
    s_dense = max(16, int(round(sum(n * n for n in lens) / total / 16)) * 16)
    b_dense = max(1, total // s_dense)
    qd, kd, vd = rnd(b_dense, hq, s_dense, d), rnd(b_dense, hk, s_dense, d), \
        rnd(b_dense, hk, s_dense, d)
    pv = Problem(len(lens), hq, hk, max(lens), max(lens), d, "bf16", True, total_q=total,
                 total_k=total)
    pd = Problem(b_dense, hq, hk, s_dense, s_dense, d, "bf16", True)
    cases: list[tuple[str, Problem, float, Any]] = [
        ("packed", pv, causal_flops(lens, hq, d),
         lambda cfg: flashtune.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                                      causal=True, config=cfg)),
        ("dense", pd, 4.0 * b_dense * hq * s_dense * s_dense * d / 2,
         lambda cfg: flashtune.flash_attention(qd, kd, vd, causal=True, config=cfg)),
    ]
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for name, p, flops, call in cases:
            default = default_fwd(p)
            ref = call((default, default_bwd(p))).float()
            configs = [("default", default), ("portable", default_portable_fwd(p))]
            configs += [("hopper", c) for c in hopper_grid(p) if c != default]
            for label, c in configs:
                cfg = (c, default_bwd(p))
                row: dict[str, Any] = {"batch": name, "label": label,
                                       "config": config_to_dict(c)}
                try:
                    diff = (call(cfg).float() - ref).abs().max().item()
                    row["max_diff_vs_default"] = diff
                    if not diff <= 2e-2:
                        row["error"] = f"differs from the default config by {diff:.3g}"
                    else:
                        t = time_fn(lambda cfg=cfg, call=call: call(cfg), warmup_ms=args.warmup,
                                    rep_ms=args.rep)
                        row.update(ms=t.median_ms, tflops=t.tflops(flops))
                except Exception as e:  # record, keep the others
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "command": " ".join(sys.argv), "lengths": lens,
                   "dense": [b_dense, s_dense], "rows": rows}, f, indent=1)
    best = {}
    for r in rows:
        if "tflops" in r and r["tflops"] > best.get(r["batch"], {}).get("tflops", 0):
            best[r["batch"]] = r
    print(f"{'batch':7s} {'label':9s} {'bn':>3s} {'st':>2s} {'pers':>4s} {'ord':>3s} "
          f"{'pp':>2s} {'TFLOP/s':>8s}")
    for r in rows:
        c = r["config"]
        val = f"{r['tflops']:8.1f}" if "tflops" in r else r.get("error", "")[:40]
        print(f"{r['batch']:7s} {r['label']:9s} {c['block_n']:3d} {c['num_stages']:2d} "
              f"{c['persistent']:4d} {c['tile_order']:3d} {c['pingpong']:2d} {val}")
    for name, r in best.items():
        print(f"best {name}: {r['tflops']:.1f} TFLOP/s {r['config']}")


if __name__ == "__main__":
    main()
