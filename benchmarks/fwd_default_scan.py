"""Candidate heuristic defaults for the Hopper forward, on the standard matrix.

For every shape of the standard matrix, times the inference forward (no grad) of the
current heuristic default and of a few Hopper configs that differ from it only in the
grid's knobs (persistent grid, tile order, ping-pong), beside cuDNN (SDPA's default
backend on Hopper), all in one process under the house protocol (DESIGN.md). Each
candidate's output is checked against cuDNN's first (max |diff| <= 2e-2); a wrong one is
reported, never timed. Prints each candidate's geomean ratio to cuDNN by (D, causal)
group; writes JSON with the GPU, versions and date.

It is for choosing the heuristic default (``flashtune.kernels.config.default_fwd``); the
tuner is what picks a config per problem.

    python benchmarks/fwd_default_scan.py --out $OUT/fwd_default_scan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

# Run as a script, this file's folder is on sys.path.
from bench_attention import _label, environment

from flashtune.kernels.attention import flash_attention
from flashtune.kernels.config import HOPPER, FwdConfig, default_bwd, default_fwd, is_feasible
from flashtune.problem import Problem
from flashtune.timing import anchors, standard_matrix, time_fn

HOP = FwdConfig(variant=HOPPER, block_m=128, block_n=128, num_stages=2)
CANDIDATES = {
    "one_tile": HOP,
    "one_tile_pp": dataclasses.replace(HOP, pingpong=1),
    "pers_o1_pp": dataclasses.replace(HOP, persistent=1, tile_order=1, pingpong=1),
    "pers_o2": dataclasses.replace(HOP, persistent=1, tile_order=2),
    "pers_o2_pp": dataclasses.replace(HOP, persistent=1, tile_order=2, pingpong=1),
}


def make_inputs(p: Problem) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(p.batch, h, s, p.head_dim, generator=g).to("cuda", torch.bfloat16)
                 for h, s in ((p.heads_q, p.seqlen_q), (p.heads_kv, p.seqlen_k),
                              (p.heads_kv, p.seqlen_k)))


def check_and_time(builds: dict[str, Callable[[], Callable[[], torch.Tensor]]],
                   ref: torch.Tensor, warmup: float, rep: float,
                   out: dict[str, Any]) -> None:
    """Build each named candidate (``builds[name]()`` returns the call that computes its
    output), check that output against ``ref`` (max |diff| <= 2e-2), then time the ones
    that pass into ``out["ms"][name]``; a build failure or a wrong output goes to
    ``out["errors"][name]`` instead, never timed."""
    fns = {}
    for name, build in builds.items():
        try:
            fn = build()
            diff = (fn().float() - ref).abs().max().item()
        except Exception as e:  # a build failure is a finding, not a crash of the scan
            out["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        if not diff <= 2e-2:
            out["errors"][name] = f"differs from cuDNN by {diff:.3g}"
            continue
        fns[name] = fn
    for name, fn in fns.items():
        out["ms"][name] = time_fn(fn, warmup_ms=warmup, rep_ms=rep).median_ms


def time_configs(p: Problem, configs: dict[str, FwdConfig], warmup: float,
                 rep: float) -> dict[str, Any]:
    """The inference forward of each named config on ``p``, beside cuDNN: ``{"ms": {name:
    median ms, "cudnn": ...}, "errors": {name: why not timed}}``. A config is timed only if
    it is feasible, builds, and its output is within 2e-2 of cuDNN's."""
    q, k, v = make_inputs(p)
    cudnn = anchors(p)["cudnn"]
    out: dict[str, Any] = {"ms": {}, "errors": {}}
    builds: dict[str, Callable[[], Callable[[], torch.Tensor]]] = {
        "cudnn": lambda: (lambda: cudnn(q, k, v))}
    for name, c in configs.items():
        ok, why = is_feasible(c, p)
        if not ok:
            out["errors"][name] = f"infeasible: {why}"
            continue
        cfg = (c, default_bwd(p))
        builds[name] = lambda cfg=cfg: (
            lambda: flash_attention(q, k, v, causal=p.causal, config=cfg))
    with torch.no_grad():
        check_and_time(builds, cudnn(q, k, v).float(), warmup, rep, out)
    return out


def scan(p: Problem, warmup: float, rep: float) -> dict[str, Any]:
    row: dict[str, Any] = {"label": _label(p), "problem": p.as_dict(),
                           "default": dataclasses.asdict(default_fwd(p))}
    row.update(time_configs(p, {"default": default_fwd(p), **CANDIDATES}, warmup, rep))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--warmup", type=float, default=25.0)
    ap.add_argument("--rep", type=float, default=100.0)
    args = ap.parse_args()
    rows = []
    for p in standard_matrix():
        row = scan(p, args.warmup, args.rep)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "command": " ".join(sys.argv),
                   "candidates": {k: dataclasses.asdict(c) for k, c in CANDIDATES.items()},
                   "rows": rows}, f, indent=1)
    names = ["default", *CANDIDATES]
    print(f"{'shape':34s}" + "".join(f"{n:>12s}" for n in names) + "   (cuDNN ms / ms)")
    groups: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        ms = r["ms"]
        ratios = {n: ms["cudnn"] / ms[n] for n in names if n in ms}
        print(f"{r['label']:34s}" + "".join(f"{ratios[n]:12.3f}" if n in ratios else
                                            f"{'-':>12s}" for n in names))
        g = f"d{r['problem']['head_dim']} {'causal' if r['problem']['causal'] else 'full'}"
        for n, x in ratios.items():
            groups[g][n].append(x)
            groups["all"][n].append(x)
    for g, by in groups.items():
        print(f"geomean {g:26s}" + "".join(
            f"{math.exp(sum(map(math.log, by[n])) / len(by[n])):12.3f}"
            if len(by.get(n, [])) == len(by["default"]) else f"{'-':>12s}" for n in names))


if __name__ == "__main__":
    main()
