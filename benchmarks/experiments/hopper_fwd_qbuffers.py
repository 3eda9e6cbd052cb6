"""The Hopper forward's persistent grid on short rows: double-buffered Q and the L2-chunked
tile order, against the kernel before them.

For each shape of the standard matrix up to ``--max-seq`` (short rows: a tile has few key
tiles), times the inference forward of a few persistent Hopper configs (and the shipped
tuned config for this GPU, whatever its kernels hash) with:
- ``new``: this tree's kernel (``flashtune/kernels/attn_fwd_hopper.py``), which loads the
  next tile's Q and first K/V tiles while the consumers finish this one;
- ``base``: a copy of the module from an earlier commit (``--baseline``), one Q buffer;
and, on this tree's kernel only, configs with tile order 3 (heaviest first within chunks
of heads whose K/V fit in L2; the earlier kernel has no such order), beside cuDNN, in one
process under the house protocol (DESIGN.md). Both kernels launch through their own
``HopperLaunch`` (the same host path). Every output is checked against cuDNN's first
(max |diff| <= 2e-2); a wrong one is reported, never timed.

    git show 299faf4:flashtune/kernels/attn_fwd_hopper.py > base_fwd_hopper.py
    python benchmarks/experiments/hopper_fwd_qbuffers.py --baseline base_fwd_hopper.py \\
        --out $OUT/qbuffers.json

A baseline that already has tile order 3 (a module from a650e01 on) runs every config, so
the script also serves as a plain A/B of two versions of the kernel (session 22's
``fwd_hopper_nospill.patch``); ``--configs`` and ``--shapes`` narrow the scan.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import _label, environment  # noqa: E402
from fwd_default_scan import check_and_time, make_inputs  # noqa: E402
from hopper_fwd_consumers import shipped_config  # noqa: E402

from flashtune.kernels import attn_fwd_hopper  # noqa: E402
from flashtune.kernels.attn_fwd import mask_params, score_scales  # noqa: E402
from flashtune.kernels.config import HOPPER, FwdConfig, is_feasible  # noqa: E402
from flashtune.problem import Problem  # noqa: E402
from flashtune.timing import anchors, standard_matrix  # noqa: E402

HOP = FwdConfig(variant=HOPPER, block_m=128, block_n=128, num_stages=2, persistent=1)
CANDIDATES = {
    "128x128_o2": dataclasses.replace(HOP, tile_order=2),
    "128x128_o1_pp": dataclasses.replace(HOP, tile_order=1, pingpong=1),
    "128x64_s4_o2": dataclasses.replace(HOP, block_n=64, num_stages=4, tile_order=2),
    "192x128_s3_o2": dataclasses.replace(HOP, block_m=192, num_stages=3, tile_order=2,
                                         consumer_regs=160),
}
# Timed on this tree's kernel only.
NEW_ONLY = {
    "128x128_o3": dataclasses.replace(HOP, tile_order=3),
    "128x128_o3_pp": dataclasses.replace(HOP, tile_order=3, pingpong=1),
    "128x128_o3_plain": dataclasses.replace(HOP, tile_order=3, persistent=0),
    "128x64_s4_o3": dataclasses.replace(HOP, block_n=64, num_stages=4, tile_order=3),
    # At D=128 a ring of three 128-key stages leaves room for one Q buffer only.
    "128x128_s3_o3": dataclasses.replace(HOP, num_stages=3, tile_order=3),
    "192x128_s3_o3": dataclasses.replace(HOP, block_m=192, num_stages=3, tile_order=3,
                                         consumer_regs=160),
}


def load_baseline(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("flashtune_baseline_fwd_hopper", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def has_order3(base: Any) -> bool:
    """A baseline with tile order 3 (a650e01 on, ``l2_chunk``) runs every config."""
    return hasattr(base, "l2_chunk")


def scan(p: Problem, base: Any, warmup: float, rep: float,
         only: list[str] | None = None) -> dict[str, Any]:
    configs = {n: c for n, c in {**CANDIDATES, **NEW_ONLY}.items() if not only or n in only}
    base_all = has_order3(base)
    shipped = shipped_config(p, torch.cuda.get_device_name())
    if shipped is not None and shipped.variant == HOPPER and shipped.persistent:
        configs = {"shipped": shipped, **configs}
    q, k, v = make_inputs(p)
    sm_scale = p.head_dim ** -0.5
    kw = dict(mask=mask_params(p.causal, p.window), scales=score_scales(sm_scale, 0.0),
              softcap=0.0)
    cudnn = anchors(p)["cudnn"]
    row: dict[str, Any] = {"label": _label(p), "problem": p.as_dict(), "ms": {}, "errors": {},
                           "configs": {n: dataclasses.asdict(c) for n, c in configs.items()}}
    builds: dict[str, Any] = {"cudnn": lambda: (lambda: cudnn(q, k, v))}
    for name, c in configs.items():
        ok, why = is_feasible(c, p)
        if not ok:
            row["errors"][name] = f"infeasible: {why}"
            continue
        kernels = (("new", attn_fwd_hopper),) if name in NEW_ONLY and not base_all \
            else (("base", base), ("new", attn_fwd_hopper))
        for tag, mod in kernels:
            def build(mod: Any = mod, c: FwdConfig = c) -> Any:
                launch = mod.HopperLaunch(q, k, v, config=c, **kw)
                return lambda: launch(q, k, v)[0]
            builds[f"{tag}:{name}"] = build
    with torch.no_grad():
        check_and_time(builds, cudnn(q, k, v).float(), warmup, rep, row)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True,
                    help="a copy of attn_fwd_hopper.py from an earlier commit")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--warmup", type=float, default=25.0)
    ap.add_argument("--rep", type=float, default=100.0)
    ap.add_argument("--configs", default="",
                    help="comma-separated candidate names to time (default: all, and shipped)")
    ap.add_argument("--shapes", default="", help="comma-separated labels (default: all)")
    args = ap.parse_args()
    only = [n for n in args.configs.split(",") if n]
    shapes = [n for n in args.shapes.split(",") if n]
    base = load_baseline(args.baseline)
    rows = []
    for p in standard_matrix():
        if p.seqlen_q > args.max_seq or (shapes and _label(p) not in shapes):
            continue
        row = scan(p, base, args.warmup, args.rep, only)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "command": " ".join(sys.argv),
                   "candidates": {k: dataclasses.asdict(c)
                                  for k, c in {**CANDIDATES, **NEW_ONLY}.items()},
                   "rows": rows}, f, indent=1)
    names = ["shipped", *CANDIDATES, *(NEW_ONLY if has_order3(base) else [])]
    print(f"{'shape':30s}" + "".join(f"{n[:14]:>30s}" for n in names))
    print(f"{'':30s}" + f"{'base/cuDNN new/cuDNN new/base':>30s}" * len(names))
    gains: dict[str, list[float]] = {n: [] for n in names}
    best: list[float] = []
    for r in rows:
        ms = r["ms"]
        cells = []
        for n in names:
            b, x = ms.get(f"base:{n}"), ms.get(f"new:{n}")
            if b is None or x is None:
                cells.append(f"{'-':>30s}")
                continue
            gains[n].append(math.log(b / x))
            cells.append(f"{ms['cudnn'] / b:10.3f}{ms['cudnn'] / x:10.3f}{b / x:10.3f}")
        by_tag = {t: [v for k, v in ms.items() if k.startswith(t + ":")] for t in ("base", "new")}
        if by_tag["base"] and by_tag["new"]:
            best.append(math.log(min(by_tag["base"]) / min(by_tag["new"])))
        print(f"{r['label']:30s}" + "".join(cells))
    for n, g in gains.items():
        if g:
            print(f"new/base {n}: geomean {math.exp(sum(g) / len(g)):.3f} over {len(g)} shapes, "
                  f"min {math.exp(min(g)):.3f}, max {math.exp(max(g)):.3f}")
    if best:
        print(f"best new / best base, geomean over {len(best)} shapes: "
              f"{math.exp(sum(best) / len(best)):.3f}")
    print(f"\n{'shape':30s}" + "".join(f"{n[:16]:>17s}" for n in NEW_ONLY)
          + f"{'o3 gain':>12s}  (cuDNN ms / new ms)")
    for r in rows:
        ms = r["ms"]
        cells = [f"{ms['cudnn'] / ms[f'new:{n}']:17.3f}" if f"new:{n}" in ms else f"{'-':>17s}"
                 for n in NEW_ONLY]
        o3 = [v for k, v in ms.items() if k.startswith("new:") and k[4:] in NEW_ONLY]
        o2 = [v for k, v in ms.items() if k.startswith("new:") and k[4:] not in NEW_ONLY]
        rel = f"{min(o2) / min(o3):12.3f}" if o2 and o3 else f"{'-':>12s}"
        print(f"{r['label']:30s}" + "".join(cells) + rel)


if __name__ == "__main__":
    main()
