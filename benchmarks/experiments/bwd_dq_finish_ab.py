"""The dQ cast of ``hopper_dq_frag`` in two forms, bit for bit and timed, on an sm90 GPU:
``_dq_finish_fragments`` of a patched copy of the Hopper backward's module (``--module``;
``bwd_dq_finish_digits.patch``: the tile read in memory order, its index digits relabelled
into rows) against the tree's own (gathered into rows). Each cast runs alone, in one
interleaved loop with the other (L2 flushed), on random accumulators of the standard rows'
sizes and tile shapes, a padded last tile and (B, S, H, D) strides included.

    patch -o /tmp/h.py flashtune/kernels/attn_bwd_hopper.py \\
        benchmarks/experiments/bwd_dq_finish_digits.patch
    timeout 100 python3 benchmarks/experiments/bwd_dq_finish_ab.py --module /tmp/h.py out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch

from flashtune.kernels.attn_bwd_hopper import _dq_finish_fragments as old_kernel
from flashtune.timing import time_interleaved

CASES = [  # batch, heads, sequence, head dim, BLOCK_M, CHUNK, layout
    (1, 16, 16384, 128, 64, 64, "bhsd"), (4, 16, 4096, 128, 64, 64, "bhsd"),
    (8, 32, 2048, 64, 128, 32, "bhsd"), (16, 32, 1024, 64, 128, 32, "bshd"),
    (16, 16, 1000, 128, 64, 64, "bshd"), (5, 16, 3000, 128, 64, 128, "bhsd"),
    (2, 8, 1031, 64, 64, 32, "bhsd"), (32, 16, 512, 128, 64, 64, "bhsd"),
]


def load_kernel(path: str):
    """``_dq_finish_fragments`` of the module copy at ``path``."""
    spec = importlib.util.spec_from_file_location("attn_bwd_hopper_candidate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._dq_finish_fragments


def case(new_kernel, b: int, h: int, s: int, d: int, bm: int, ch: int, layout: str) -> dict:
    n_m = -(-s // bm)
    acc = torch.randn(b * h, n_m * (d // ch), bm * ch // 256, 256, device="cuda")

    def out() -> torch.Tensor:
        if layout == "bshd":
            return torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16)

    o_new, o_old = out(), out()
    kw = dict(HEAD_DIM=d, BLOCK_M=bm, CHUNK=ch, num_warps=4)

    def f_new() -> None:
        new_kernel[(n_m, b * h)](acc, o_new, *o_new.stride(), h, s, n_m, **kw)

    def f_old() -> None:
        old_kernel[(n_m, b * h)](acc, o_old, *o_old.stride(), h, s, n_m, **kw)

    f_new()
    f_old()
    torch.cuda.synchronize()
    same = torch.equal(o_new, o_old)
    t = time_interleaved([f_new, f_old], rounds=3)
    gb = (acc.numel() * 4 + b * h * s * d * 2) / 1e9
    return dict(case=f"{b}x{h}x{s}x{d} m{bm} c{ch} {layout}", same_bits=same,
                new_us=t[0].median_ms * 1e3, old_us=t[1].median_ms * 1e3,
                new_tbs=gb / t[0].median_ms, old_tbs=gb / t[1].median_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", required=True, help="the patched copy of attn_bwd_hopper.py")
    ap.add_argument("out")
    args = ap.parse_args()
    new_kernel = load_kernel(args.module)
    rows = []
    for spec in CASES:
        r = case(new_kernel, *spec)
        rows.append(r)
        print(f"{r['case']:34s} same {r['same_bits']}  new {r['new_us']:7.1f} us "
              f"({r['new_tbs']:.2f} TB/s)  old {r['old_us']:7.1f} us ({r['old_tbs']:.2f} TB/s)",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    if not all(r["same_bits"] for r in rows):
        raise SystemExit("the two casts differ")


if __name__ == "__main__":
    main()
