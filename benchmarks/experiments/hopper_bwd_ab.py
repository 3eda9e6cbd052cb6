"""A/B of Hopper backward kernel modules on an sm90 GPU, beside cuDNN and the shipped backward.

Each ``--variant name=path`` is a copy of ``flashtune/kernels/attn_bwd_hopper.py`` (``head``:
the tree's own module). For each variant the script swaps it in as the package's Hopper
backward and goes through ``flashtune.kernels.attn_bwd.bwd_steps``, so the variant is
launched exactly as the product launches it. Then:

1. ``--check NAME``: the correctness grid of ``benchmarks/gpu_hopper_bwd.py`` (odd lengths,
   Sq != Sk, GQA/MQA, window, softcap, one row, one key) for that variant, free and fixed
   order, against the fp32 reference under the 2x rule; fixed-order runs three times and
   must match bit for bit.
2. Timing: per shape, every variant's launch prepared once (free and fixed order), cuDNN's
   backward (``autograd.grad`` on a retained graph) and the shipped backward for this GPU
   (what a deterministic call is served), all in one interleaved loop with L2 flushed before
   each launch (``flashtune.timing.time_interleaved``).

    timeout 560 python benchmarks/experiments/hopper_bwd_ab.py --variant base=.stage_main/x.py \\
        --variant head --check head --out $OUT/bwd_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_hopper_bwd import CASES, case_inputs, forward, problem_of  # noqa: E402
from hopper_fwd_consumers import shipped_config  # noqa: E402

import flashtune.kernels as kpkg  # noqa: E402
from flashtune.kernels import attn_bwd_hopper as head_mod  # noqa: E402
from flashtune.kernels.attn_bwd import bwd_steps  # noqa: E402
from flashtune.kernels.config import BWD_HOPPER, BwdConfig, default_bwd  # noqa: E402
from flashtune.kernels.reference import reference_errors, within_rule  # noqa: E402
from flashtune.problem import effective_window  # noqa: E402
from flashtune.timing import time_interleaved  # noqa: E402

KEY = "flashtune.kernels.attn_bwd_hopper"
DET_KNOBS: dict[str, Any] = {}  # --det-knobs
FREE_KNOBS: dict[str, Any] = {}  # --free-knobs


def load(name: str, path: str | None) -> Any:
    if path is None:
        return head_mod
    spec = importlib.util.spec_from_file_location(f"_bwd_variant_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def use(mod: Any) -> None:
    """Make ``mod`` the module that ``bwd_steps`` imports as the Hopper backward."""
    sys.modules[KEY] = mod
    kpkg.attn_bwd_hopper = mod


def prepared(mod: Any, do, q, k, v, o, lse, cfg: BwdConfig, causal: bool, window, softcap,
             scale: float, det: bool):
    """(grads, launch): the backward's buffers and its launches, built once."""
    use(mod)
    try:
        grads, steps = bwd_steps(do, q, k, v, o, lse, causal=causal, sm_scale=scale,
                                 window=effective_window(window, q.shape[2], k.shape[2]),
                                 softcap=softcap, config=cfg, deterministic=det)
    finally:
        use(head_mod)
    fns = [f for _, f in steps]

    def launch() -> None:
        for f in fns:
            f()
    return grads, launch


def hopper_cfg(block_m: int, block_n: int, stages: int) -> BwdConfig:
    return BwdConfig(variant=BWD_HOPPER, hopper_block_m=block_m, hopper_block_n=block_n,
                     hopper_stages=stages)


CHECK_CFGS = {128: [(64, 128, 2), (64, 64, 2)], 64: [(64, 128, 2), (128, 128, 2)]}


def check(mod: Any, rows: list) -> bool:
    torch.manual_seed(1)
    all_ok = True
    for case in CASES:
        _, _, _, _, _, d, causal, window, softcap = case
        q, k, v, do, o, lse, scale = case_inputs(case)
        for m, n, s in CHECK_CFGS[d]:
            for det in (False, True):
                cfg = hopper_cfg(m, n, s)
                runs = []
                for _ in range(3 if det else 1):
                    g, launch = prepared(mod, do, q, k, v, o, lse, cfg, causal, window,
                                         softcap, scale, det)
                    launch()
                    torch.cuda.synchronize()
                    runs.append(tuple(t.clone() for t in g))
                errs, terrs = reference_errors(q, k, v, do, o, lse, runs[0], causal=causal,
                                               softmax_scale=scale, window_size=window,
                                               softcap=softcap)
                ok, ratio, detail = within_rule(errs, terrs)
                same = all(torch.equal(a, c)
                           for r in runs[1:] for a, c in zip(runs[0], r, strict=True))
                ok = ok and same
                all_ok &= ok
                rows.append(dict(case=list(map(str, case)), cfg=[m, n, s], det=det, ok=ok,
                                 ratio=ratio, bitwise=same if det else None, detail=detail))
                print(f"{'OK ' if ok else 'BAD'} {case} {m}x{n}s{s} det={det} "
                      f"ratio={ratio:.3f} bitwise={same if det else '-'} {detail}", flush=True)
    return all_ok


SHAPES = [(b, 2048 // d, s, d, c) for d in (64, 128) for c in (False, True)
          for s, b in ((1024, 16), (4096, 4), (16384, 1))]


def call_inputs(b: int, hq: int, hk: int, s: int, d: int, causal: bool,
                gen: torch.Generator | None = None) -> tuple[dict[str, Any], tuple, Any, float]:
    """For a dense bf16 call of ``b`` x ``hq``/``hk`` heads x ``s`` x ``d`` (random inputs,
    from ``gen`` if given): cuDNN's backward as the first entry of the timed callables (on
    a retained graph), the backward's inputs (dO, Q, K, V, O and the LSE of our forward),
    the problem and the softmax scale."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen
                           ).requires_grad_() for h in (hq, hk, hk))
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 1.0 / math.sqrt(d)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oc = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hk)
    fns: dict[str, Any] = {
        "cudnn": lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)}
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse = forward(qd, kd, vd, causal, (-1, -1), 0.0, scale)
    return fns, (do, qd, kd, vd, o, lse), problem_of(qd, kd, causal, (-1, -1), 0.0), scale


def shape_inputs(shape) -> tuple[dict[str, Any], tuple, Any, float]:
    """:func:`call_inputs` for one of SHAPES (``b, h, s, d, causal``)."""
    b, h, s, d, causal = shape
    return call_inputs(b, h, h, s, d, causal)


def bench_shape(mods: dict[str, Any], shape, rounds: int) -> dict:
    b, h, s, d, causal = shape
    fns, (do, qd, kd, vd, o, lse), p, scale = shape_inputs(shape)
    ship = shipped_config(p, torch.cuda.get_device_name(), "bwd")
    cfgs = {"shipped": ship} if ship is not None else {}
    cfgs["portable_default"] = default_bwd(p)
    for name, cfg in cfgs.items():
        fns[name] = prepared(head_mod, do, qd, kd, vd, o, lse, cfg, causal, (-1, -1), 0.0,
                             scale, True)[1]
    tiles = [(64, 128, 2)] if d == 128 else [(64, 128, 2), (128, 128, 2)]
    errors = {}
    for vname, mod in mods.items():
        for m, n, st in tiles:
            for det in (False, True):
                label = f"{vname}:{m}x{n}s{st}{':det' if det else ''}"
                cfg = hopper_cfg(m, n, st)
                if det and DET_KNOBS:
                    cfg = dataclasses.replace(cfg, **DET_KNOBS)
                if not det and FREE_KNOBS:
                    cfg = dataclasses.replace(cfg, **FREE_KNOBS)
                try:
                    fns[label] = prepared(mod, do, qd, kd, vd, o, lse, cfg, causal, (-1, -1),
                                          0.0, scale, det)[1]
                    fns[label]()  # compile (and fail) here, not in the timed loop
                except Exception as e:  # a variant that does not build is reported, not timed
                    fns.pop(label, None)
                    errors[label] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{label}: {errors[label]}", flush=True)
    for f in fns.values():  # compile outside the timed loop
        f()
    torch.cuda.synchronize()
    names = list(fns)
    timings = time_interleaved([fns[n] for n in names], rounds=rounds)
    ms = {n: t.median_ms for n, t in zip(names, timings, strict=True)}
    flops = 4 * 2.5 * b * h * s * s * d * (0.5 if causal else 1.0)
    return dict(shape=list(shape), ms=ms, shipped=repr(ship), errors=errors,
                det_knobs=DET_KNOBS, free_knobs=FREE_KNOBS,
                tflops={n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()})


def row_line(shape, ms: dict[str, float]) -> str:
    """One shape's timings as cuDNN's time over each other's."""
    c = ms["cudnn"]
    cells = " ".join(f"{n}={c / t:.3f}" for n, t in ms.items() if n != "cudnn")
    return (f"{'x'.join(map(str, shape[:4]))}{' causal' if shape[4] else ''} cudnn {c:.3f} ms "
            f"| cudnn/x: {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="name=path of a module copy, or 'head' for the tree's own")
    ap.add_argument("--check", action="append", default=[], help="variant names to check")
    ap.add_argument("--shapes", default="all", help="'all' or comma-separated indices")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--det-knobs", default="{}",
                    help="JSON of BwdConfig fields for the timed fixed-order configs, e.g. "
                         "'{\"hopper_dq_groups\": 1}' (the shipped D=128 entries' choice)")
    ap.add_argument("--free-knobs", default="{}",
                    help="JSON of BwdConfig fields for the timed free-order configs (without "
                         "it they run the defaults of hopper_cfg: hopper_dq_frag off)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    DET_KNOBS.update(json.loads(args.det_knobs))
    FREE_KNOBS.update(json.loads(args.free_knobs))
    mods = {}
    for spec in args.variant:
        name, _, path = spec.partition("=")
        mods[name] = load(name, path or None)
    out: dict[str, Any] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                               date=time.strftime("%Y-%m-%d"), variants=args.variant,
                               check={}, bench=[])
    try:
        for name in args.check:
            rows: list = []
            t0 = time.time()
            ok = check(mods[name], rows)
            out["check"][name] = dict(ok=ok, rows=rows, seconds=time.time() - t0)
            print(f"check {name}: {'all OK' if ok else 'FAILED'} ({len(rows)} cases, "
                  f"{time.time() - t0:.0f} s)", flush=True)
        idx = range(len(SHAPES)) if args.shapes == "all" else map(int, args.shapes.split(","))
        for i in idx:
            r = bench_shape(mods, SHAPES[i], args.rounds)
            out["bench"].append(r)
            print(row_line(SHAPES[i], r["ms"]), flush=True)
    finally:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
