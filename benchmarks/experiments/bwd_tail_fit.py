"""How much of the Hopper backward's main kernel is a tail: its time at one sequence for
several numbers of heads, with one config, fitted to ``a + b * heads`` (on an sm90 GPU).

``causal_tail_sim.py`` (a model, session 54) puts the causal grid's end 7.4-8.2% past the
ideal at the standard causal D=128 shapes: each head launches its key tiles lightest
first, so the last head's heaviest tiles (key tile 0 visits every query tile) run with
the GPU emptying around them. A tail that does not grow with the heads shows as the
fit's intercept ``a``: here, measured, for the causal grid and the unmasked one (whose
key tiles all do the same work) side by side. For each ``--heads`` count the main kernel
alone (``bwd_parts.parts``: with the semaphores' zeroing) of the shipped deterministic
config of the ``--base-heads`` row runs on fresh inputs, all counts timed in one
interleaved loop (L2 flushed before each launch); the model's figure for each count is
printed beside it.

    timeout 300 python3 benchmarks/experiments/bwd_tail_fit.py --seqlen 16384 \\
        --heads 2,4,8,16,32,48 --out tail.json

Written in session 54 (no GPU left to run it); not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b * x``: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", default="2,4,8,16,32,48")
    ap.add_argument("--base-heads", type=int, default=16,
                    help="heads of the shipped row whose config every count runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from bwd_parts import parts
    from bwd_shipped_variants import dump, header, interleaved_ms
    from causal_tail_sim import makespan, orders
    from hopper_fwd_consumers import shipped_config

    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch
    from flashtune.kernels.attn_fwd import attn_fwd, mask_params, score_scales
    from flashtune.kernels.config import BWD_HOPPER, default_bwd, default_fwd
    from flashtune.problem import Problem, default_scale, effective_window

    out = header()
    out["command"] = " ".join(["bwd_tail_fit.py", *sys.argv[1:]])
    s, d = args.seqlen, args.head_dim
    counts = [int(x) for x in args.heads.split(",") if x]
    scale = default_scale(d)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:
        for causal in (True, False):
            base = Problem(1, args.base_heads, args.base_heads, s, s, d, "bf16", causal,
                           deterministic=True)
            cfg = shipped_config(base, out["device"], "bwd")
            if cfg is None or cfg.variant != BWD_HOPPER:
                cfg = default_bwd(base, BWD_HOPPER)
            window = effective_window((-1, -1), s, s)
            mask = mask_params(causal, window)
            fns, keep = {}, []
            for h in counts:
                q, k, v, do = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16,
                                           generator=gen) for _ in range(4))
                p = dataclasses.replace(base, heads_q=h, heads_kv=h)
                o, lse = attn_fwd(q, k, v, config=default_fwd(p), causal=causal,
                                  sm_scale=scale, window=window, softcap=0.0)
                launch = HopperBwdLaunch(do, q, k, v, o, sm_scale=scale, mask=mask,
                                         scales=score_scales(scale, 0.0), softcap=0.0,
                                         config=cfg, deterministic=True)
                bufs = launch.buffers(q, k, v, lse)
                fns[str(h)] = parts(launch, do, q, k, v, o, bufs)["main"]
                keep.append((q, k, v, do, o, bufs))
                fns[str(h)]()
            torch.cuda.synchronize()
            ms = interleaved_ms(fns, list(fns), args.rounds)
            a, b = fit([float(h) for h in counts], [ms[str(h)] for h in counts])
            model = {}
            for h in counts:
                works = orders(s, h, cfg.hopper_block_n, cfg.hopper_block_m)["head-major"]
                if not causal:
                    works = [s // cfg.hopper_block_m] * len(works)
                model[str(h)] = makespan(works, sms) / (sum(works) / sms)
            out["rows"].append(dict(causal=causal, config=repr(cfg), ms=ms, fit=[a, b],
                                    model_over_ideal=model))
            print(f"{'causal' if causal else 'unmasked'} 1xHx{s}x{d}: per head {b * 1000:.1f} us, "
                  f"intercept {a * 1000:.1f} us", flush=True)
            for h in counts:
                t = ms[str(h)]
                print(f"  H={h:3}: {t * 1000:9.1f} us  over a+b*H {t / (a + b * h):.3f}  over "
                      f"b*H {t / (b * h):.3f}  model {model[str(h)]:.3f}", flush=True)
            dump(args.out, out)
            del keep, fns
            torch.cuda.empty_cache()
    finally:
        dump(args.out, out)


if __name__ == "__main__":
    main()
