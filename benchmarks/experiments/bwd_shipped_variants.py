"""Copies of the Hopper backward timed with the shipped configs, beside cuDNN, on an sm90 GPU.

``hopper_bwd_ab.py`` times its variants at fixed default tiles; a change that helps there
may not help the tuned configs the product serves. Here, for each shape, every
``--variant name=path`` (``head``: the tree's module) runs with the shipped layer's
backward config for that shape's deterministic key (``name:det``) and for its
``deterministic=False`` key (``name:free``), all in one interleaved loop with cuDNN's
backward (``flashtune.timing.time_interleaved``, L2 flushed before each launch). A variant
listed in ``--det-only`` runs only with the deterministic config (an ablation that changes
only the fixed order); ``--knobs name=JSON`` sets config fields in that variant's configs
(one module may be listed twice, under two names, with and without a knob). Each variant's
gradients are compared with the tree's (max abs difference, same config and order), so a
copy that is wrong shows up beside its time.

    timeout 500 python3 benchmarks/experiments/bwd_shipped_variants.py --variant head \\
        $(python3 benchmarks/experiments/bwd_exp_poly.py --dir D) --shapes 0-6 --out o.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from retime_knob import parse_range  # noqa: E402

# The standard preset's backward rows (its first 24, no GQA).
SHAPES = [(b, h, s, d, c) for d, h in ((128, 16), (64, 32)) for c in (False, True)
          for s, b in ((512, 32), (1024, 16), (2048, 8), (4096, 4), (8192, 2), (16384, 1))]


def interleaved_ms(fns: dict, names: list[str], rounds: int) -> dict[str, float]:
    """The median ms of each of ``fns[name]`` for ``names``, in one interleaved loop."""
    from flashtune.timing import time_interleaved

    return {n: t.median_ms for n, t in zip(
        names, time_interleaved([fns[n] for n in names], rounds=rounds), strict=True)}


def header() -> dict:
    """The output's head: this GPU, torch, the date; ``rows`` to fill."""
    import torch

    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"), rows=[])


def shape_rows(spec: str):
    """For each index of ``spec`` into SHAPES: (shape, the callables to time with cuDNN's
    first, the backward's inputs, the problem, the softmax scale) (``hopper_bwd_ab``)."""
    import hopper_bwd_ab as hab

    for i in parse_range(spec):
        yield (SHAPES[i], *hab.shape_inputs(SHAPES[i]))


def dump(path: str, out: dict) -> None:
    """Write ``out`` (after every row, so that a timeout keeps the rows done)."""
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="name=path of a module copy, or 'head' for the tree's")
    ap.add_argument("--det-only", default="", help="variants timed only deterministic")
    ap.add_argument("--knobs", action="append", default=[], metavar="NAME=JSON",
                    help="config fields to set in variant NAME's configs, e.g. "
                         "'sf={\"hopper_dq_store_first\": 1}'")
    ap.add_argument("--shapes", default=f"0-{len(SHAPES) - 1}", help="indices into SHAPES")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import hopper_bwd_ab as hab
    import torch
    from hopper_fwd_consumers import shipped_config

    mods = {}
    for spec in args.variant:
        name, _, path = spec.partition("=")
        mods[name] = hab.load(name, path or None)
    det_only = {n for n in args.det_only.split(",") if n}
    knobs = {}
    for spec in args.knobs:
        name, _, text = spec.partition("=")
        knobs[name] = json.loads(text)
    out = header()
    dev = out["device"]
    try:
        for shape, fns, (do, q, k, v, o, lse), p, scale in shape_rows(args.shapes):
            causal = shape[4]
            cfgs = {"det": shipped_config(p, dev, "bwd"),
                    "free": shipped_config(dataclasses.replace(p, deterministic=False), dev,
                                           "bwd")}
            grads: dict = {}
            errors: dict = {}
            for name, mod in mods.items():
                for kind, cfg in cfgs.items():
                    if cfg is None or (kind == "free" and name in det_only):
                        continue
                    label = f"{name}:{kind}"
                    if name in knobs:
                        cfg = dataclasses.replace(cfg, **knobs[name])
                    try:
                        g, fns[label] = hab.prepared(mod, do, q, k, v, o, lse, cfg, causal,
                                                     (-1, -1), 0.0, scale, kind == "det")
                        fns[label]()
                        torch.cuda.synchronize()
                        grads[label] = tuple(t.clone() for t in g)
                    except Exception as e:  # reported, not timed
                        fns.pop(label, None)
                        errors[label] = f"{type(e).__name__}: {str(e)[:300]}"
                        print(f"{label}: {errors[label]}", flush=True)
            diff = {}
            for label, g in grads.items():
                ref = grads.get("head:" + label.split(":")[1])
                if ref is not None and not label.startswith("head:"):
                    diff[label] = max(float((a.float() - b.float()).abs().max())
                                      for a, b in zip(g, ref, strict=True))
            ms = interleaved_ms(fns, list(fns), args.rounds)
            out["rows"].append(dict(shape=list(shape), configs={k: repr(c) for k, c in
                                                                cfgs.items()},
                                    ms=ms, max_abs_diff_vs_head=diff, errors=errors))
            print(hab.row_line(shape, ms) + f" | diff {diff}", flush=True)
            dump(args.out, out)
    finally:
        dump(args.out, out)


if __name__ == "__main__":
    main()
