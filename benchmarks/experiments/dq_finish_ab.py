"""The cast-back of the ``hopper_dq_frag`` accumulator, two ways: the shipped
``_dq_finish_fragments`` (each value gathered from its place in the register-order block:
per warp, two 4-byte values of every 16 bytes, half of each sector read) against a copy
that loads each query tile's blocks flat (contiguous, vectorized) and puts them in rows
with a reshape and a permute in registers (a layout conversion through shared memory).

Both read the same fp32 values and cast them alike, so their outputs must be equal bit for
bit (``--check``, which also runs in the CPU interpreter at small sizes). On a GPU it times
both with ``triton.testing.do_bench`` (L2 flushed between repetitions) on the standard
matrix's head-dim-128 accumulators:

    python3 benchmarks/experiments/dq_finish_ab.py --check [--out ab.json]
    TRITON_INTERPRET=1 python3 benchmarks/experiments/dq_finish_ab.py --check --small

Session 50 ran it on an H200 (``dq_finish_ab_h200_s50.json``): equal bit for bit on all
seven accumulators, the flat copy 0.956-0.978x the shipped gather's time (about 2 us of
55): not worth staling the frag entries for.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from flashtune.kernels.attn_bwd_hopper import _dq_finish_fragments


@triton.jit
def _dq_finish_flat(
    DQA, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, heads_q, seq_q, n_m,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):
    """As ``_dq_finish_fragments``, loading the tile's HEAD_DIM / CHUNK blocks as one
    contiguous run. A block's value 4 (128 k + t) + i is, split as [row block of 64, column
    group j, warp w, row a, lane pair e', row pair h, column pair e], row 64 blk + 16 w +
    8 h + a and column 8 j + 2 e' + e of its chunk (see attn_bwd_hopper._fragments)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    block = (pid_bh.to(tl.int64) * n_m + pid_m) * (BLOCK_M * HEAD_DIM)
    x = tl.load(DQA + block + tl.arange(0, BLOCK_M * HEAD_DIM))
    x = tl.reshape(x, [HEAD_DIM // CHUNK, BLOCK_M // 64, CHUNK // 8, 4, 8, 4, 2, 2])
    # [chunk, blk, j, w, a, e', h, e] -> [blk, w, h, a, chunk, j, e', e]: rows, then columns.
    x = tl.reshape(tl.permute(x, (1, 3, 6, 4, 0, 2, 5, 7)), [BLOCK_M, HEAD_DIM])
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, HEAD_DIM)
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + rows[:, None] * stride_dqm
             + c[None, :] * stride_dqd, x.to(DQ.dtype.element_ty), mask=(rows < seq_q)[:, None])


def _case(b: int, h: int, s: int, d: int, block_m: int, chunk: int, device: str,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    n_m = -(-s // block_m)
    gen = torch.Generator(device=device).manual_seed(b * 1000 + s)
    acc = torch.randn(b * h, n_m * (d // chunk), block_m * chunk // 256, 256, device=device,
                      generator=gen)
    # Different fillings: a kernel that wrote nothing cannot pass the check.
    out = (torch.full((b, h, s, d), fill, device=device, dtype=dtype) for fill in (1.0, 2.0))
    return acc, *out, n_m


def _launch(kernel, acc, out, n_m, h, s, d, block_m, chunk):  # type: ignore[no-untyped-def]
    return lambda: kernel[(n_m, out.shape[0] * h)](
        acc, out, *out.stride(), h, s, n_m, HEAD_DIM=d, BLOCK_M=block_m, CHUNK=chunk,
        num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="outputs equal, bit for bit")
    ap.add_argument("--small", action="store_true", help="small sizes (the interpreter)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # (b, h, s, d, block_m, chunk): the fixed order stages 64 columns, the free one 128.
    cases = ([(1, 2, 150, 128, 64, 64), (1, 2, 150, 128, 64, 128), (2, 1, 200, 64, 128, 32)]
             if args.small else
             [(b, 16, s, 128, 64, chunk) for b, s in ((32, 512), (8, 2048), (1, 16384))
              for chunk in (64, 128)] + [(4, 32, 4096, 64, 128, 32)])
    rows = []
    for b, h, s, d, block_m, chunk in cases:
        acc, ref_out, new_out, n_m = _case(b, h, s, d, block_m, chunk, device, torch.bfloat16)
        old = _launch(_dq_finish_fragments, acc, ref_out, n_m, h, s, d, block_m, chunk)
        new = _launch(_dq_finish_flat, acc, new_out, n_m, h, s, d, block_m, chunk)
        old()
        new()
        row = {"shape": f"{b}x{h}x{s}x{d}", "block_m": block_m, "chunk": chunk}
        if args.check:
            row["equal"] = bool(torch.equal(ref_out, new_out))
        if device == "cuda":
            row["old_us"] = 1e3 * triton.testing.do_bench(old)
            row["new_us"] = 1e3 * triton.testing.do_bench(new)
            row["new/old"] = row["new_us"] / row["old_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "torch": torch.__version__, "triton": triton.__version__, "rows": rows},
                      f, indent=1)
    if args.check and not all(r["equal"] for r in rows):
        raise SystemExit("the flat cast-back differs from the shipped one")


if __name__ == "__main__":
    main()
