"""What a fresh install serves: ``flashtune.explain`` for every problem of the shipped
presets, in a fresh process with no user database (only the shipped layer).

    PYTHONPATH=. FLASHTUNE_DB=/nonexistent/dir/x.db python3 benchmarks/shipped_check.py \
        --out shipped_check.json [--presets standard,llama3-8b,...]

For each problem it builds the tensors a user would pass (a packed batch as
``flash_attn_varlen_func`` takes it, with the preset's representative lengths) and
records the source of the forward and backward configs ("tuned", "nearest",
"default") and the layer they came from. Prints one line per preset and the number of
problems served "tuned" in both directions. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

import flashtune
from flashtune.autotune.presets import preset
from flashtune.problem import Problem

PRESETS = "standard,llama3-8b,llama3-70b,mistral-7b,qwen2.5-7b,gpt2,llama3-8b-packed"


def explain_problem(p: Problem) -> Any:
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[p.dtype]
    kw: dict[str, Any] = dict(causal=p.causal, window_size=p.window, softcap=p.softcap,
                              deterministic=p.deterministic)
    if p.packed:
        lq, lk = p.packed_lengths()
        cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                           device="cuda") for x in (lq, lk)]
        q = torch.empty(p.total_q, p.heads_q, p.head_dim, device="cuda", dtype=dt)
        k = torch.empty(p.total_k, p.heads_kv, p.head_dim, device="cuda", dtype=dt)
        return flashtune.explain(q, k, k, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
                                 max_seqlen_q=max(lq), max_seqlen_k=max(lk), **kw)
    q = torch.empty(p.batch, p.heads_q, p.seqlen_q, p.head_dim, device="cuda", dtype=dt)
    k = torch.empty(p.batch, p.heads_kv, p.seqlen_k, p.head_dim, device="cuda", dtype=dt)
    return flashtune.explain(q, k, k, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="shipped_check.json")
    ap.add_argument("--presets", default=PRESETS)
    args = ap.parse_args()
    rows = []
    for name in args.presets.split(","):
        for p in preset(name):
            e = explain_problem(p)
            rows.append({"preset": name, "key": e.key.short(), "source": e.source,
                         "fwd": e.fwd.source, "bwd": e.bwd.source,
                         "fwd_layer": getattr(e.fwd, "layer", None),
                         "bwd_layer": getattr(e.bwd, "layer", None)})
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "database": e.database,
                   "FLASHTUNE_DB": os.environ.get("FLASHTUNE_DB"), "rows": rows}, f, indent=1)
    for name in args.presets.split(","):
        mine = [r for r in rows if r["preset"] == name]
        tuned = sum(r["source"] == "tuned" for r in mine)
        others = sorted({r["source"] for r in mine} - {"tuned"})
        print(f"{name:18} {tuned:>3}/{len(mine)} tuned" + (f"  (also: {', '.join(others)})"
                                                           if others else ""))
    print(f"all: {sum(r['source'] == 'tuned' for r in rows)}/{len(rows)} problems tuned in "
          "both directions")


if __name__ == "__main__":
    main()
