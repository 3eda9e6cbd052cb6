"""Where one Hopper backward call's time goes, launch by launch, with the shipped configs,
beside cuDNN's backward, on an sm90 GPU.

``HopperBwdLaunch.run`` launches, per call: the accumulator's zeroing (all of it, or with
``hopper_dq_store_first`` only the query tiles no key tile visits; the memsets), the delta
preprocess, the semaphores' zeroing (fixed order), the main kernel and the dQ cast-back
(``_dq_finish_fragments`` with ``hopper_dq_frag``). This times each of them alone and the
whole call, in one interleaved loop with cuDNN (``flashtune.timing.time_interleaved``, L2
flushed before each launch), for each row's deterministic and ``deterministic=False``
shipped configs. ``main`` includes the semaphores' zeroing: the fixed order's first turn
waits for a zero, so the kernel cannot be launched twice without it. The parts' sum
exceeds the whole by the launch gaps the whole hides and the L2 the flush empties.

    timeout 300 python3 benchmarks/experiments/bwd_parts.py --shapes 0,1,7,8 --out parts.json

(``--shapes`` indexes ``bwd_shipped_variants.SHAPES``: 0-5 D=128 unmasked 512..16k, 6-11
causal, 12-17 D=64 unmasked, 18-23 causal.) Written in session 52; first run in session 53
(``benchmarks/data/bwd_parts_h200_s53.json``, BENCHMARKS.md issue 13).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parts(launch, do, q, k, v, o, bufs) -> dict:
    """The launches of ``launch.run(do, q, k, v, o, bufs)``, one callable each (the order
    and arguments of ``HopperBwdLaunch.run``)."""
    from flashtune.kernels._bound import descriptor_like

    dq, dk, dv, lse, delta, dq_acc, sem = bufs
    tq, tdo, tk, tv, tacc = launch.templates
    rows = ((descriptor_like(launch.rows, lse), descriptor_like(launch.rows, delta))
            if launch.rows is not None else (lse, delta))
    main_args = (descriptor_like(tq, q), descriptor_like(tdo, do), descriptor_like(tk, k),
                 descriptor_like(tv, v), *rows, descriptor_like(tacc, dq_acc), dk, dv, sem)
    out = {}
    if launch.frag:
        if launch.zero_blocks is None:
            out["zero"] = dq_acc.zero_
        elif launch.zero_blocks:
            out["zero"] = lambda: [dq_acc[:, a:z].zero_() for a, z in launch.zero_blocks]
    out["pre"] = lambda: launch.pre(o, do, delta, dq_acc)

    def main() -> None:
        if launch.deterministic:
            sem.zero_()
        launch.main(*main_args)
    out["main"] = main
    out["finish"] = lambda: launch.finish(dq_acc, dq)
    out["whole"] = lambda: launch.run(do, q, k, v, o, bufs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0-11", help="indices into bwd_shipped_variants.SHAPES")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from bwd_shipped_variants import dump, header, interleaved_ms, shape_rows
    from hopper_fwd_consumers import shipped_config

    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch
    from flashtune.kernels.attn_fwd import mask_params, score_scales
    from flashtune.kernels.config import BWD_HOPPER
    from flashtune.problem import effective_window

    out = header()
    dev = out["device"]
    try:
        for shape, fns, (do, q, k, v, o, lse), p, scale in shape_rows(args.shapes):
            mask = mask_params(shape[4], effective_window((-1, -1), shape[2], shape[2]))
            labels = ["cudnn"]
            configs = {}
            for kind, det in (("det", True), ("free", False)):
                cfg = shipped_config(dataclasses.replace(p, deterministic=det), dev, "bwd")
                if cfg is None or cfg.variant != BWD_HOPPER:
                    continue  # a portable entry: nothing of this kernel to split
                configs[kind] = repr(cfg)
                launch = HopperBwdLaunch(do, q, k, v, o, sm_scale=scale, mask=mask,
                                         scales=score_scales(scale, 0.0), softcap=0.0,
                                         config=cfg, deterministic=det)
                bufs = launch.buffers(q, k, v, lse)
                for name, fn in parts(launch, do, q, k, v, o, bufs).items():
                    fns[f"{kind}:{name}"] = fn
                    labels.append(f"{kind}:{name}")
            for label in labels:  # build and run each once before the timed loop
                fns[label]()
            torch.cuda.synchronize()
            ms = interleaved_ms(fns, labels, args.rounds)
            out["rows"].append(dict(shape=list(shape), configs=configs, ms=ms))
            b, h, s, d, causal = shape
            print(f"{b}x{h}x{s}x{d}{' causal' if causal else ''}: "
                  + "  ".join(f"{n} {t * 1000:.1f}us" for n, t in ms.items()), flush=True)
            dump(args.out, out)
    finally:
        dump(args.out, out)


if __name__ == "__main__":
    main()
