"""Side-by-side attention benchmark under the house protocol (DESIGN.md).

For every shape of the standard matrix (or a subset): training forward, backward
((fwd+bwd) - fwd) and inference forward of flashtune (heuristic default config, which is
the Hopper kernel on sm90; the portable kernel's default with ``portable``; the
dispatcher's choice with --tuned) against SDPA's cuDNN, FA2 and efficient backends and
compiled FlexAttention, all timed in the same process, side by side (``--in-turn``: one
after another). Prints a table of TFLOP/s and
flashtune/anchor ratios, and the bf16 matmul ceiling measured in the same run; writes
full JSON with GPU, versions and date.

``--bwd-variants 0,1,2,3`` also times the backward of each backward variant
(``BwdConfig.variant``: 0 two kernels, 1 atomic dQ with ``deterministic=False``, 2 one
launch, with the portable default's tiles; 3 the Hopper kernel's default config, fixed dQ
order; same forward) as impls ``bwd0`` to ``bwd3``, and prints each one's backward against
the anchors. A variant a shape cannot run (3 off sm90, say) is reported as its error.
``--seqlens 512,1000 --bwd-variants 0,3`` times the Hopper backward below the default's
rule (1024 queries and keys), beside the portable one that those shapes are served.

    python benchmarks/bench_attention.py --out bench.json
    python benchmarks/bench_attention.py --impls cudnn,fa2,flex --bwd-variants 0,1,2
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import sys
import traceback
from typing import Any

import torch

from flashtune.exceptions import InfeasibleConfigError
from flashtune.kernels.attention import flash_attention
from flashtune.kernels.config import (
    BWD_ATOMIC,
    BWD_HOPPER,
    BWD_ONE_LAUNCH,
    BWD_TWO_KERNEL,
    FwdConfig,
    default_bwd,
    default_fwd,
    default_portable_fwd,
)
from flashtune.problem import Problem
from flashtune.timing import (
    anchors,
    geomean,
    standard_matrix,
    three_timings,
    three_timings_interleaved,
)


def _label(p: Problem) -> str:
    g = f" gqa{p.heads_q}/{p.heads_kv}" if p.heads_q != p.heads_kv else ""
    return f"d{p.head_dim} {'causal' if p.causal else 'full'} S={p.seqlen_q} B={p.batch}{g}"


def environment() -> dict[str, Any]:
    import triton

    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def bwd_variant_fn(p: Problem, fcfg: FwdConfig, variant: int) -> Any:
    """flash_attention with the default tiles run as backward ``variant`` (the atomic one
    with deterministic=False, as it requires)."""
    det = variant != BWD_ATOMIC
    cfg = default_bwd(dataclasses.replace(p, deterministic=det), variant)
    return lambda q, k, v: flash_attention(q, k, v, causal=p.causal, config=(fcfg, cfg),
                                           deterministic=det)


def bench_problem(p: Problem, impls: list[str], flex: bool, warmup: float, rep: float,
                  bwd_variants: tuple[int, ...] = (), interleave: bool = True,
                  ) -> dict[str, Any]:
    fcfg, bcfg = default_fwd(p), default_bwd(p)
    fns: dict[str, Any] = {}
    if "default" in impls:
        fns["default"] = lambda q, k, v: flash_attention(q, k, v, causal=p.causal,
                                                         config=(fcfg, bcfg))
    unavailable: dict[str, str] = {}
    for variant in bwd_variants:
        try:
            fns[f"bwd{variant}"] = bwd_variant_fn(p, fcfg, variant)
        except InfeasibleConfigError as e:  # e.g. the Hopper kernel off sm90
            unavailable[f"bwd{variant}"] = f"InfeasibleConfigError: {e}"[:200]
    if "portable" in impls:
        pcfg = default_portable_fwd(p)
        fns["portable"] = lambda q, k, v: flash_attention(q, k, v, causal=p.causal,
                                                          config=(pcfg, bcfg))
    if "tuned" in impls:
        import flashtune

        fns["tuned"] = lambda q, k, v: flashtune.flash_attention(q, k, v, causal=p.causal)
    for name, fn in anchors(p).items():
        if name in impls and (name != "flex" or flex):
            fns[name] = fn
    row: dict[str, Any] = {"problem": p.as_dict(), "label": _label(p),
                           "fwd_config": repr(fcfg),
                           "flops": {"fwd": p.flops("fwd"), "bwd": p.flops("bwd")},
                           "impls": {name: {"error": e} for name, e in unavailable.items()}}
    def entry(t: dict[str, Any]) -> dict[str, Any]:
        return {"fwd_tflops": t["fwd"].tflops(p.flops("fwd")),
                "bwd_tflops": t["bwd"].tflops(p.flops("bwd")),
                "infer_tflops": t["infer"].tflops(p.flops("fwd")),
                **{f"{k}_ms": v.median_ms for k, v in t.items()}}

    if interleave:  # side by side: every implementation meets the same clocks
        errors: dict[str, str] = {}
        for name, t in three_timings_interleaved(fns, p, "cuda", warmup_ms=warmup,
                                                 rep_ms=rep, errors=errors).items():
            row["impls"][name] = entry(t)
        for name, e in errors.items():  # an anchor that does not support this shape
            row["impls"][name] = {"error": e[:200]}
        torch.cuda.empty_cache()
        return row
    for name, fn in fns.items():
        try:
            row["impls"][name] = entry(three_timings(fn, p, "cuda", warmup_ms=warmup,
                                                     rep_ms=rep))
        except Exception as e:  # an anchor that does not support this shape is reported
            row["impls"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            traceback.print_exc(limit=1, file=sys.stderr)
        torch.cuda.empty_cache()
    return row


def matmul_ceiling() -> float:
    """bf16 8192^3 matrix product on random data, TFLOP/s (the ceiling fractions use it)."""
    import triton

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_attention.json")
    ap.add_argument("--impls", default="default,portable,cudnn,fa2,efficient,flex",
                    help="comma list among default,portable,tuned,cudnn,fa2,efficient,flex")
    ap.add_argument("--flex-seqlens", default="1024,4096,16384",
                    help="FlexAttention compiles per shape: time it only at these S")
    ap.add_argument("--seqlens", default="", help="restrict the matrix to these S")
    ap.add_argument("--bwd-variants", default="",
                    help="also time these backward variants (comma list among 0,1,2,3)")
    ap.add_argument("--warmup", type=float, default=25.0)
    ap.add_argument("--rep", type=float, default=100.0)
    ap.add_argument("--in-turn", action="store_true",
                    help="time the implementations one after another (default: side by "
                         "side, as `autotune bench`)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU (interpreter timings are not performance)")
    impls = args.impls.split(",")
    flex_s = {int(s) for s in args.flex_seqlens.split(",") if s}
    only = {int(s) for s in args.seqlens.split(",") if s}
    variants = tuple(int(x) for x in args.bwd_variants.split(",") if x)
    bad = [x for x in variants
           if x not in (BWD_TWO_KERNEL, BWD_ATOMIC, BWD_ONE_LAUNCH, BWD_HOPPER)]
    if bad:
        sys.exit(f"--bwd-variants: {bad} are not backward variants (allowed: 0,1,2,3)")
    rows = []
    for p in standard_matrix():
        if only and p.seqlen_q not in only:
            continue
        row = bench_problem(p, impls, p.seqlen_q in flex_s, args.warmup, args.rep, variants,
                            interleave=not args.in_turn)
        rows.append(row)
        print(json.dumps({"label": row["label"], **{k: {m: round(x, 1) for m, x in v.items()
                                                         if m.endswith("tflops")}
                                                     for k, v in row["impls"].items()}}),
              flush=True)
    doc = {"environment": environment(), "command": " ".join(sys.argv), "rows": rows,
           "matmul_tflops": matmul_ceiling()}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print_table(doc)
    for variant in variants:
        print_table(doc, me=f"bwd{variant}", kinds=("bwd",))


def print_table(doc: dict[str, Any], me: str = "", kinds: tuple[str, ...] = ("fwd", "bwd",
                                                                              "infer")) -> None:
    """Per shape TFLOP/s and ``me`` / anchor ratios (``me``: tuned, else default)."""
    rows = doc["rows"]
    names = [n for n in ("tuned", "default", "portable", "cudnn", "fa2", "efficient", "flex",
                         me) if n and any(n in r["impls"] for r in rows)]
    names = list(dict.fromkeys(names))
    me = me or ("tuned" if "tuned" in names else "default")
    if me not in names:
        return
    print(f"\n{doc['environment']}")
    ceil = doc.get("matmul_tflops")
    if ceil:
        print(f"bf16 matmul ceiling: {ceil:.0f} TFLOP/s")
    for kind in kinds:
        print(f"\n## {kind} TFLOP/s (ratio = {me} / anchor)")
        print("| shape | " + " | ".join(names) + " | " +
              " | ".join(f"{me}/{n}" for n in names if n != me) + " |")
        ratios: dict[str, list[float]] = {n: [] for n in names}
        for r in rows:
            vals = {n: r["impls"].get(n, {}).get(f"{kind}_tflops") for n in names}
            cells = [f"{vals[n]:.0f}" if vals[n] else "-" for n in names]
            rcells = []
            for n in names:
                if n == me:
                    continue
                if vals[n] and vals[me]:
                    ratios[n].append(vals[me] / vals[n])
                    rcells.append(f"{vals[me] / vals[n]:.2f}")
                else:
                    rcells.append("-")
            frac = f" {vals[me] / ceil:.2f}" if ceil and vals[me] else ""
            print(f"| {r['label']} | " + " | ".join(cells) + " | " + " | ".join(rcells)
                  + f" |{frac}")
        print("| geomean ratio | " + " | ".join("" for _ in names) + " | " +
              " | ".join(f"{geomean(ratios[n]):.2f}" for n in names if n != me) + " |")


if __name__ == "__main__":
    main()
