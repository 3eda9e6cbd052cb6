"""The free-order (``deterministic=False``) Hopper backward of the tree beside a copy
of ``attn_bwd_hopper.py``, each with the shipped free config of the shape, interleaved with
cuDNN's backward (``flashtune.timing.time_interleaved``, L2 flushed before each launch), on
an sm90 GPU, on the standard preset's causal shapes (``--unmasked``: the same shapes without
the mask). Prints cuDNN's time over each and the copy's speedup over the tree, and the
largest gradient difference between the two (0 where the config runs the fixed order, whose
launch the copy may leave unchanged).

Session 58 timed ``bwd_free_rank_major.patch`` and ``bwd_free_no_turns.patch`` this way
(the patched module saved as the copy, the tree left as it is):

    git apply benchmarks/experiments/bwd_free_rank_major.patch
    cp flashtune/kernels/attn_bwd_hopper.py /tmp/rank_major.py && git checkout flashtune
    FLASHTUNE_DB=/nonexistent/d/x.db PYTHONPATH=$PWD:$PWD/benchmarks:$PWD/benchmarks/experiments \\
        python3 benchmarks/experiments/bwd_free_order_ab.py /tmp/rank_major.py out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

# (batch, query heads, KV heads, seqlen, head dim): the standard preset's causal rows
SHAPES = [(b, h, h, s, d) for d, h in ((128, 16), (64, 32))
          for s, b in ((2048, 8), (4096, 4), (8192, 2), (16384, 1), (1024, 16))]
SHAPES += [(4, 32, 8, 4096, 128), (5, 16, 16, 3000, 128), (16, 16, 16, 1000, 128)]


def main(copy_path: str, out_path: str, causal: bool) -> None:
    import hopper_bwd_ab as hab
    import torch
    from hopper_fwd_consumers import shipped_config

    from flashtune.timing import time_interleaved

    mods = {"head": hab.load("head", None), "copy": hab.load("copy", copy_path)}
    dev = torch.cuda.get_device_name()
    out = {"device": dev, "torch": torch.__version__, "copy": copy_path, "rows": []}
    for b, hq, hk, s, d in SHAPES:
        fns, (do, qd, kd, vd, o, lse), p, scale = hab.call_inputs(b, hq, hk, s, d, causal)
        p = dataclasses.replace(p, deterministic=False)
        cfg = shipped_config(p, dev, "bwd")
        label = f"{b}x{hq}/{hk}x{s}x{d}{' causal' if causal else ''} free"
        if cfg is None or cfg.variant != 3:
            print(f"{label}: no shipped Hopper config", flush=True)
            continue
        grads = {}
        for name, mod in mods.items():
            g, fns[name] = hab.prepared(mod, do, qd, kd, vd, o, lse, cfg, causal, (-1, -1),
                                        0.0, scale, False)
            fns[name]()
            torch.cuda.synchronize()
            grads[name] = [t.float().clone() for t in g]
        diff = max(float((a - c).abs().max())
                   for a, c in zip(grads["head"], grads["copy"], strict=True))
        ms = {n: t.median_ms for n, t in zip(fns, time_interleaved(list(fns.values()),
                                                                    rounds=3), strict=True)}
        out["rows"].append(dict(shape=[b, hq, hk, s, d], causal=causal, ms=ms, max_abs_diff=diff,
                                split=cfg.hopper_split))
        print(f"{label} split {cfg.hopper_split}: cuDNN {ms['cudnn']:.3f} ms, cudnn/x head "
              f"{ms['cudnn'] / ms['head']:.3f} copy {ms['cudnn'] / ms['copy']:.3f}, copy "
              f"{ms['head'] / ms['copy']:.3f}x the tree, max |diff| {diff:.2e}", flush=True)
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("copy", help="the module copy to time beside the tree's")
    ap.add_argument("out", help="JSON to write")
    ap.add_argument("--unmasked", action="store_true", help="the shapes without a causal mask")
    args = ap.parse_args()
    main(args.copy, args.out, not args.unmasked)
