"""One-off A/B of a forward-kernel variant against the previous kernel, on the H200.

Kept as the record of the third session's experiment (BENCHMARKS.md, "Third session").
It loads the previous kernel from a file and the variant from the package:

    git checkout 0918504        # the scale-folded (FMA) forward kernel
    mkdir -p .exp && git show 4f7e536:flashtune/kernels/attn_fwd.py > .exp/attn_fwd_old.py
    python3 benchmarks/experiments/fwd_variant_ab.py   # writes $OUT/ab_fwd.json

The run recorded in benchmarks/data/fwd_variant_ab_h200.json also had an uncommitted
``_ORDER`` hook in the variant (program order: 1 = query tiles reversed, 2 = heads
fastest, heaviest tiles first); without it the "rev"/"heavy" rows time the default order.
"""

import dataclasses
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, ".")
import flashtune.kernels.attn_fwd as NEW
from flashtune.timing import anchors, geomean, make_inputs, standard_matrix, time_fn
from flashtune.problem import Problem
from flashtune.kernels.config import FwdConfig, config_from_dict, default_fwd

spec = importlib.util.spec_from_file_location("attn_fwd_old", ".exp/attn_fwd_old.py")
OLD = importlib.util.module_from_spec(spec)
spec.loader.exec_module(OLD)

tuned = {}
for r in json.load(open("benchmarks/data/vs_default_fwd_h200.json"))["rows"]:
    tuned[json.dumps(r["problem"], sort_keys=True)] = config_from_dict("fwd", r["config"])


def run(mod, q, k, v, p, cfg, order=0):
    if mod is NEW:
        NEW._ORDER = order
    try:
        return mod.attn_fwd(
            q,
            k,
            v,
            causal=p.causal,
            sm_scale=p.head_dim**-0.5,
            window=(-1, -1),
            softcap=0.0,
            config=cfg,
        )
    finally:
        if mod is NEW:
            NEW._ORDER = 0


out = os.environ.get("OUT", "/tmp")
DEV = "cpu" if os.environ.get("SMOKE") else "cuda"
MATRIX = (
    [Problem(1, 2, 2, 40, 40, 64, causal=True), Problem(1, 2, 2, 33, 33, 64)]
    if os.environ.get("SMOKE")
    else standard_matrix()
)
rows = []
# device crash check: TMA stage 2 must crash ptxas on triton 3.6; TMA bn=128 stage 3 must build
chk = []
p = Problem(1, 2, 2, 256, 256, 128, causal=True)
q, k, v = make_inputs(p, DEV)
for cfg in (
    []
    if DEV == "cpu"
    else [
        FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, use_tma=1),
        FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, use_tma=1),
        FwdConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=1),
        FwdConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=1),
    ]
):
    try:
        o, _ = run(NEW, q, k, v, p, cfg)
        torch.cuda.synchronize()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=True
        )
        chk.append(
            {
                "config": dataclasses.asdict(cfg),
                "result": "ok",
                "err": float((o.float() - ref).abs().max()),
            }
        )
    except Exception as e:
        chk.append(
            {
                "config": dataclasses.asdict(cfg),
                "result": "crash" if "-11" in str(e) else type(e).__name__ + str(e)[:200],
            }
        )
    print(chk[-1], flush=True)

for i, p in enumerate(MATRIX):
    q, k, v = make_inputs(p, DEV)
    dflt = default_fwd(p)
    t_cfg = tuned.get(json.dumps(p.as_dict(), sort_keys=True))
    variants = {"old_default": (OLD, dflt, 0), "new_default": (NEW, dflt, 0)}
    if t_cfg is not None:
        variants["old_tuned"] = (OLD, t_cfg, 0)
        variants["new_tuned"] = (NEW, t_cfg, 0)
    if p.causal:
        variants["new_default_rev"] = (NEW, dflt, 1)
        variants["new_default_heavy"] = (NEW, dflt, 2)
    if p.head_dim == 64:
        variants["new_128x128_tma_s3"] = (
            NEW,
            FwdConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=1),
            0,
        )
        variants["new_128x128_s3"] = (
            NEW,
            FwdConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=0),
            0,
        )
    # correctness of every variant vs old default
    o_ref, l_ref = run(OLD, q, k, v, p, dflt)
    errs = {}
    for name, (mod, cfg, order) in list(variants.items()):
        try:
            o, l = run(mod, q, k, v, p, cfg, order)
            errs[name] = float((o.float() - o_ref.float()).abs().max())
        except Exception as e:
            errs[name] = str(e)[:100]
            variants.pop(name)
    an = anchors(p) if DEV == "cuda" else {}
    fns = {n: (lambda m=m, c=c, o=o: run(m, q, k, v, p, c, o)) for n, (m, c, o) in variants.items()}
    fns["cudnn"] = (lambda: an["cudnn"](q, k, v)) if "cudnn" in an else None
    fns = {n: f for n, f in fns.items() if f is not None}
    ts = {n: [] for n in fns}
    names = list(fns)
    for rnd in range(2):
        for n in names if rnd % 2 == 0 else names[::-1]:
            ts[n].append(time_fn(fns[n], warmup_ms=10, rep_ms=60).median_ms)
    med = {n: sum(x) / len(x) for n, x in ts.items()}
    row = {"i": i, "problem": p.as_dict(), "ms": med, "err": errs}
    rows.append(row)
    base = med["old_default"]
    print(
        i,
        f"B{p.batch} H{p.heads_q}/{p.heads_kv} S{p.seqlen_q} D{p.head_dim} {'causal' if p.causal else 'full'}",
        " ".join(f"{n}={base / t:.3f}" for n, t in med.items()),
        flush=True,
    )
    del q, k, v

json.dump({"check": chk, "rows": rows}, open(os.path.join(out, "ab_fwd.json"), "w"), indent=1)
names = sorted({n for r in rows for n in r["ms"]})
print("\ngeomean speedup over old_default (rows where present):")
for n in names:
    xs = [r["ms"]["old_default"] / r["ms"][n] for r in rows if n in r["ms"]]
    print(f"  {n:24s} {geomean(xs):.4f}  n={len(xs)}  min={min(xs):.3f} max={max(xs):.3f}")
