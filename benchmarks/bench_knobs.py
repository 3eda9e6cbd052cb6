"""Time the forward kernel over a list of tile configs, each with a knob off and on
(default: ``use_tma``), on standard-matrix shapes: does a knob earn its place in the space?

    python benchmarks/bench_knobs.py --knob use_tma --out knobs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from flashtune.kernels.attention import flash_attention
from flashtune.kernels.config import FwdConfig, is_feasible
from flashtune.timing import make_inputs, standard_matrix, time_fn

TILES = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 4),
         (64, 128, 4, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--knob", default="use_tma")
    ap.add_argument("--out", default="knobs.json")
    args = ap.parse_args()
    shapes = [p for p in standard_matrix()
              if p.seqlen_q in (1024, 4096) and p.heads_q == p.heads_kv]
    rows = []
    for p in shapes:
        q, k, v = make_inputs(p, "cuda")
        for bm, bn, w, st in TILES:
            base = FwdConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            rec = {"problem": p.as_dict(), "config": dataclasses.asdict(base)}
            for val in (0, 1):
                cfg = dataclasses.replace(base, **{args.knob: val})
                if not is_feasible(cfg, p)[0]:
                    continue
                try:
                    t = time_fn(lambda c=cfg, q=q, k=k, v=v, p=p: flash_attention(
                        q, k, v, causal=p.causal, config=c))
                    rec[f"{args.knob}={val}"] = t.tflops(p.flops("fwd"))
                except Exception as e:  # a knob value that does not build is data too
                    rec[f"{args.knob}={val}"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(rec)
            print(p.head_dim, p.causal, p.seqlen_q, (bm, bn, w, st),
                  {k_: (round(v_, 1) if isinstance(v_, float) else v_) for k_, v_ in rec.items()
                   if k_.startswith(args.knob)}, flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
