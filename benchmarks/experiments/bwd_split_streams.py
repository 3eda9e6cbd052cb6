"""A Hopper backward call split by batch into parts on side streams, so that one part's
bandwidth-bound launches overlap another part's main kernel, beside the whole call and
cuDNN, with the shipped configs, on an sm90 GPU.

Session 53 (``bwd_parts.py``, BENCHMARKS.md issue 13) measured the delta preprocess at
42 us and the dQ cast at 55 us per call at every standard row (B * S = 16k, H = 16 at
D=128), about 97 us of 554 at 32x16x512x128, where the main kernel alone (463 us) beats
cuDNN's whole backward (498 us); five ways to cast dQ inside the main kernel were all
slower. Host-side instead: the batch's parts are independent problems (their own dQ
accumulator blocks and semaphores, so the fixed order's sums and bits are unchanged), and
a part's preprocess can run while an earlier part's main kernel drains, its cast while a
later one runs. Whether the block scheduler interleaves them usefully (the main kernel
holds one CTA per SM: all its shared memory and registers) is what this measures.

- ``streams{S}``: S parts, each ``HopperBwdLaunch.run`` (zeroing, preprocess, main, cast)
  on a stream of its own;
- ``prio{S}``: as ``streams{S}``, each part's preprocess and cast on a high-priority stream
  of its own, its main kernel on a normal one;
- ``pipe{S}``: every part's zeroing and preprocess on one high-priority stream, the main
  kernels in order on a second, the casts on a third (high priority), chained by events.

Each is timed as one call (``flashtune.timing.time_interleaved``, L2 flushed before each
call, the side streams waiting for it), beside the whole call and cuDNN's backward, and
each part's gradients must equal the whole call's slice bit for bit (deterministic) or to
the rounding of a reordered sum (``deterministic=False``: max abs difference reported).

    timeout 300 python3 benchmarks/experiments/bwd_split_streams.py --shapes 0,1,7,8 \\
        --out split.json

Written in session 53; run in session 54 (H200, ``bwd_split_streams_h200_s54{a,b}.json``,
BENCHMARKS.md issue 13): ``streams2`` ran 1.01-1.03x the whole call at the D=128 rows of
512 to 4k keys, ``prio`` and ``pipe`` slower than the whole call. Landed as
``BwdConfig.hopper_split`` (``SplitHopperBwdLaunch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


class Part:
    """One batch slice's prepared backward: its launch, its buffers, its inputs."""

    def __init__(self, sl: slice, inputs: tuple, lse: Any, kw: dict[str, Any]) -> None:
        from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch

        self.inputs = tuple(t[sl] for t in inputs)  # do, q, k, v, o
        do, q, k, v, o = self.inputs
        self.launch = HopperBwdLaunch(do, q, k, v, o, **kw)
        self.bufs = self.launch.buffers(q, k, v, lse[sl])

    def run(self) -> None:
        self.launch.run(*self.inputs, self.bufs)

    def steps(self) -> dict[str, Any]:
        """(zeroing and preprocess, main, cast) as callables (``bwd_parts.parts``)."""
        from bwd_parts import parts

        fns = parts(self.launch, *self.inputs, self.bufs)
        head = [fns[n] for n in ("zero", "pre") if n in fns]
        return {"pre": lambda: [f() for f in head], "main": fns["main"],
                "finish": fns.get("finish", lambda: None)}


def split(b: int, n: int) -> list[slice]:
    """``n`` batch slices of near-equal size (fewer where ``b < n``)."""
    n = min(n, b)
    return [slice(i * b // n, (i + 1) * b // n) for i in range(n)]


def on_streams(parts: list[Part], streams: list[Any]) -> Any:
    """The call: each part's whole run on its own stream, joined back."""
    import torch

    def call() -> None:
        cur = torch.cuda.current_stream()
        go = cur.record_event()
        done = []
        for part, s in zip(parts, streams, strict=False):
            s.wait_event(go)
            with torch.cuda.stream(s):
                part.run()
            done.append(s.record_event())
        for ev in done:
            cur.wait_event(ev)
    return call


def piped(parts: list[Part], pre_s: Any, main_s: Any, fin_s: Any) -> Any:
    """The call: preprocesses in order on ``pre_s``, main kernels on ``main_s``, casts on
    ``fin_s``, each launch waiting for the one before it in its part."""
    import torch

    steps = [p.steps() for p in parts]

    def call() -> None:
        cur = torch.cuda.current_stream()
        go = cur.record_event()
        for s in (pre_s, main_s, fin_s):
            s.wait_event(go)
        for st in steps:
            with torch.cuda.stream(pre_s):
                st["pre"]()
            main_s.wait_event(pre_s.record_event())
            with torch.cuda.stream(main_s):
                st["main"]()
            fin_s.wait_event(main_s.record_event())
            with torch.cuda.stream(fin_s):
                st["finish"]()
        cur.wait_event(main_s.record_event())
        cur.wait_event(fin_s.record_event())
    return call


def prioritized(parts: list[Part], his: list[Any], los: list[Any]) -> Any:
    """The call: each part on streams of its own, its preprocess and cast on a
    high-priority one, its main kernel on a normal one, the main kernels concurrent."""
    import torch

    steps = [p.steps() for p in parts]

    def call() -> None:
        cur = torch.cuda.current_stream()
        go = cur.record_event()
        done = []
        for st, hi, lo in zip(steps, his, los, strict=False):
            hi.wait_event(go)
            with torch.cuda.stream(hi):
                st["pre"]()
            lo.wait_event(hi.record_event())
            with torch.cuda.stream(lo):
                st["main"]()
            hi.wait_event(lo.record_event())
            with torch.cuda.stream(hi):
                st["finish"]()
            done.append(hi.record_event())
        for ev in done:
            cur.wait_event(ev)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0,1,7,8", help="indices into bwd_shipped_variants.SHAPES")
    ap.add_argument("--splits", default="2,4", help="numbers of batch parts")
    ap.add_argument("--modes", default="streams,prio,pipe", help="which ways to split")
    ap.add_argument("--free", action="store_true", help="also the deterministic=False configs")
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
    out["command"] = " ".join(["bwd_split_streams.py", *sys.argv[1:]])
    dev = out["device"]
    splits = [int(x) for x in args.splits.split(",") if x]
    streams = [torch.cuda.Stream() for _ in range(max(splits))]
    high = torch.cuda.Stream(priority=-1)
    mains = torch.cuda.Stream()
    high2 = torch.cuda.Stream(priority=-1)
    his = [torch.cuda.Stream(priority=-1) for _ in range(max(splits))]
    try:
        for shape, fns, (do, q, k, v, o, lse), p, scale in shape_rows(args.shapes):
            mask = mask_params(shape[4], effective_window((-1, -1), shape[2], shape[2]))
            labels = ["cudnn"]
            configs: dict[str, str] = {}
            diffs: dict[str, float] = {}
            for kind, det in (("det", True), ("free", False))[:2 if args.free else 1]:
                cfg = shipped_config(dataclasses.replace(p, deterministic=det), dev, "bwd")
                if cfg is None or cfg.variant != BWD_HOPPER:
                    continue  # a portable entry
                configs[kind] = repr(cfg)
                kw = dict(sm_scale=scale, mask=mask, scales=score_scales(scale, 0.0),
                          softcap=0.0, config=cfg, deterministic=det)
                whole = HopperBwdLaunch(do, q, k, v, o, **kw)
                wbufs = whole.buffers(q, k, v, lse)
                fns[f"{kind}:whole"] = (lambda w=whole, bb=wbufs, xs=(do, q, k, v, o):
                                        w.run(*xs, bb))
                labels.append(f"{kind}:whole")
                fns[f"{kind}:whole"]()
                torch.cuda.synchronize()
                ref = [t.clone() for t in wbufs[:3]]
                for n in splits:
                    parts = [Part(sl, (do, q, k, v, o), lse, kw) for sl in split(shape[0], n)]
                    for name, call in ((f"streams{n}", on_streams(parts, streams)),
                                       (f"pipe{n}", piped(parts, high, mains, high2)),
                                       (f"prio{n}", prioritized(parts, his, streams))):
                        if name.rstrip("0123456789") not in args.modes.split(","):
                            continue
                        label = f"{kind}:{name}"
                        call()
                        torch.cuda.synchronize()
                        err = 0.0
                        for part, sl in zip(parts, split(shape[0], n), strict=True):
                            for a, r in zip(part.bufs[:3], ref, strict=True):
                                err = max(err, float((a.float() - r[sl].float()).abs().max()))
                        diffs[label] = err
                        if det and err:
                            print(f"{label}: gradients differ from the whole call's ({err:.3g})",
                                  flush=True)
                        fns[label] = call
                        labels.append(label)
            ms = interleaved_ms(fns, labels, args.rounds)
            out["rows"].append(dict(shape=list(shape), configs=configs, ms=ms,
                                    max_abs_diff_vs_whole=diffs))
            b, h, s, d, causal = shape
            cud = ms["cudnn"]
            print(f"{b}x{h}x{s}x{d}{' causal' if causal else ''}: cuDNN {cud * 1000:.0f} us; "
                  + "  ".join(f"{n} {cud / t:.3f}" for n, t in ms.items() if n != "cudnn"),
                  flush=True)
            dump(args.out, out)
    finally:
        dump(args.out, out)


if __name__ == "__main__":
    main()
