"""Why `autotune bench` reads some short Hopper backwards slower than their sweep did.

The H200 bench of session 30 (shipped layer a703171cb9fe) timed 32x16x512x128 causal's
backward at 0.817 ms, where the sweep that stored the entry timed 0.477 ms; the same config
at 1024 causal read 0.757 against 0.638. The sweep times the backward's launches with their
buffers and descriptors made once (``Bench.launch``); the bench times a whole
``torch.autograd.grad`` step (forward + backward) less the forward, which also prepares the
Hopper launch per call (``hopper_bwd_launch``: buffers, seven TMA descriptors) and runs the
autograd machinery. If the host takes longer per step than the GPU, the stream runs dry and
do_bench's events time the host.

Per shape, with the shipped config the dispatcher serves (``FLASHTUNE_DB`` unset to a
missing file, so only the shipped layer), for the staged rows on and off:

- ``gpu_ms``: the sweep's timing of the launches (``Bench.time_with_parts`` protocol);
- ``steps_ms``: ``attn_bwd`` per call (prepare + launch), do_bench;
- ``host_us``: host time per call behind a queue of matmuls (pure host cost) of
  ``hopper_bwd_launch`` (prepare only), ``launch()`` (the three launches), ``attn_bwd`` and a
  whole fwd+bwd ``autograd.grad`` step through ``flash_attention``;
- ``step_ms`` / ``fwd_ms``: the bench's own two timings and their difference.

    python3 benchmarks/experiments/bwd_host_gap.py --out gap.json [--profile]

``--profile`` prints cProfile's top functions of 200 ``attn_bwd`` calls (host only).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
from collections.abc import Callable
from typing import Any

import torch
from bench_overhead import _busy

import flashtune
import flashtune.kernels.attn_bwd_hopper as H
from flashtune.kernels.attn_bwd import attn_bwd, bwd_steps
from flashtune.kernels.attn_fwd import attn_fwd
from flashtune.kernels.config import default_fwd
from flashtune.problem import Problem, default_scale
from flashtune.timing import time_fn, time_parts

SHAPES = ((32, 16, 512, 128, True), (16, 16, 1024, 128, True), (32, 16, 512, 128, False),
          (4, 16, 4096, 128, True))


def _busy_host_us(call: Callable[[], Any], n: int = 30) -> float:
    """Host time per call of ``n`` calls queued behind 0.3 s of matmuls, after a warm-up
    (few enough calls that the launch queue never fills)."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    return _busy(call, n, 0.3)


def one(b: int, h: int, s: int, d: int, causal: bool, profile: bool,
        stages: tuple[bool, ...]) -> dict[str, Any]:
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    p = Problem(b, h, h, s, s, d, "bf16", causal)
    kw = dict(causal=causal, sm_scale=default_scale(d), window=(-1, -1), softcap=0.0)
    from flashtune.dispatch import resolve  # the served config, as the dispatcher picks

    cfg = resolve("bwd", q, k, causal, (-1, -1), 0.0, True)
    o, lse = attn_fwd(q, k, v, config=default_fwd(p), **kw)
    row: dict[str, Any] = {"shape": f"{b}x{h}x{s}x{d}{' causal' if causal else ''}",
                           "variant": cfg.variant, "config": str(cfg)}
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def step() -> None:
        out = flashtune.flash_attention(qg, kg, vg, causal=causal)
        torch.autograd.grad(out, (qg, kg, vg), do)

    def fwd() -> None:
        flashtune.flash_attention(qg, kg, vg, causal=causal)

    for stage in stages:
        H.STAGE_LSE = stage
        _, steps = bwd_steps(do, q, k, v, o, lse, config=cfg, deterministic=True, **kw)
        gpu = time_parts([f for _, f in steps])[0]
        call = lambda: attn_bwd(do, q, k, v, o, lse, config=cfg, deterministic=True, **kw)  # noqa: E731
        steps_t = time_fn(call)
        launch = steps[0][1]
        prep = lambda: bwd_steps(do, q, k, v, o, lse, config=cfg, deterministic=True, **kw)  # noqa: E731
        st, fw = time_fn(step), time_fn(fwd)
        row[f"stage_{int(stage)}"] = {
            "gpu_ms": gpu.median_ms, "steps_ms": steps_t.median_ms,
            "host_us": {"prepare": _busy_host_us(prep), "launch": _busy_host_us(launch),
                        "attn_bwd": _busy_host_us(call), "fwd": _busy_host_us(fwd),
                        "fwd_bwd_step": _busy_host_us(step)},
            "step_ms": st.median_ms, "fwd_ms": fw.median_ms,
            "bench_bwd_ms": st.median_ms - fw.median_ms}
        if profile and stage:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                call()
            pr.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
            print(buf.getvalue()[-4000:])
    H.STAGE_LSE = True
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--unstaged", action="store_true",
                    help="also with STAGE_LSE off (the sweep-path figures only: the "
                         "flash_attention plan keeps the launch it prepared first)")
    args = ap.parse_args()
    rows = []
    for i, shp in enumerate(SHAPES):
        rows.append(one(*shp, profile=args.profile and i == 0,
                        stages=(True, False) if args.unstaged else (True,)))
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1,
                      default=str)
    print(f"{'shape':<22} st  gpu    steps  bench  | host us: prep launch bwd fwd step")
    for r in rows:
        for st in (1, 0):
            x = r.get(f"stage_{st}")
            if x is None:
                continue
            hu = x["host_us"]
            print(f"{r['shape']:<22} {st} {x['gpu_ms']:.3f} {x['steps_ms']:.3f} "
                  f"{x['bench_bwd_ms']:.3f} | {hu['prepare']:.0f} {hu['launch']:.0f} "
                  f"{hu['attn_bwd']:.0f} {hu['fwd']:.0f} {hu['fwd_bwd_step']:.0f}")


if __name__ == "__main__":
    main()
