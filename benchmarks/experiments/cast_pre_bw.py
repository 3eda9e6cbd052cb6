"""The Hopper backward's two bandwidth-bound launches, alone, beside rewrites and a ceiling.

Session 53 measured the delta preprocess at 3.2 TB/s and the cast of the fragment-ordered
fp32 dQ accumulator (``hopper_dq_frag``) at 3.6 TB/s of the H200's 4.8: 97 us per call at
every standard row, most of the gap to cuDNN at 512-1k keys. This times, on one GPU, in one
interleaved loop per group (L2 flushed before each launch, ``flashtune.timing``):

- cast: the shipped ``_dq_finish_fragments`` (a gather of each value's place), ``perm``
  (the block loaded in memory order, one contiguous vector, its fragment order undone by a
  reshape and a permute, then stored by rows) and ``scatter`` (loaded in memory order,
  each value stored to its row and column), against ``torch`` (the same bytes as one dense
  ``.to(bf16)``: the ceiling). Each rewrite's dQ must equal the shipped kernel's bit for bit;
- pre: the shipped ``_attn_bwd_preprocess`` at each rows-per-program and warp count,
  against a dense ``torch`` read of the same bytes (``torch.sum`` of O and of dO).

    timeout 200 python3 benchmarks/experiments/cast_pre_bw.py --out $OUT/bw.json

Runs under the CPU interpreter too (``TRITON_INTERPRET=1``, a small shape): the bitwise
checks, not the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from flashtune.kernels._bwd_common import _attn_bwd_preprocess  # noqa: E402
from flashtune.kernels.attn_bwd_hopper import _dq_finish_fragments  # noqa: E402
from flashtune.timing import time_interleaved  # noqa: E402


@triton.jit
def _tile(heads_q, n_m, BLOCK: tl.constexpr):
    """(query tile, batch, head, the tile's first accumulator value) of this program."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    return (pid_m, (pid_bh // heads_q).to(tl.int64), (pid_bh % heads_q).to(tl.int64),
            (pid_bh.to(tl.int64) * n_m + pid_m) * BLOCK)


@triton.jit
def _cast_perm(DQA, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, heads_q, seq_q, n_m,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    # Memory order of a tile's block: [chunk c, blk, j, w, a, e', h, e] (see
    # _dq_finish_fragments); row 64 blk + 16 w + 8 h + a, column CHUNK c + 8 j + 2 e' + e.
    pid_m, off_b, off_h, block = _tile(heads_q, n_m, BLOCK_M * HEAD_DIM)
    acc = tl.load(DQA + block + tl.arange(0, BLOCK_M * HEAD_DIM))
    acc = tl.reshape(acc, [HEAD_DIM // CHUNK, BLOCK_M // 64, CHUNK // 8, 4, 8, 4, 2, 2])
    acc = tl.permute(acc, [1, 3, 6, 4, 0, 2, 5, 7])
    acc = tl.reshape(acc, [BLOCK_M, HEAD_DIM])
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, HEAD_DIM)
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + rows[:, None] * stride_dqm
             + c[None, :] * stride_dqd, acc.to(DQ.dtype.element_ty), mask=(rows < seq_q)[:, None])


@triton.jit
def _cast_scatter(DQA, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, heads_q, seq_q, n_m,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    pid_m, off_b, off_h, block = _tile(heads_q, n_m, BLOCK_M * HEAD_DIM)
    i = tl.arange(0, BLOCK_M * HEAD_DIM)
    acc = tl.load(DQA + block + i)
    v = i % (BLOCK_M * CHUNK)
    row = ((v // (512 * (CHUNK // 8))) * 64 + ((v // 128) % 4) * 16 + ((v // 2) % 2) * 8
           + (v // 16) % 8)
    col = (i // (BLOCK_M * CHUNK)) * CHUNK + ((v // 512) % (CHUNK // 8)) * 8 \
        + ((v // 4) % 4) * 2 + v % 2
    rows = pid_m * BLOCK_M + row
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + rows * stride_dqm
             + col * stride_dqd, acc.to(DQ.dtype.element_ty), mask=rows < seq_q)


def cast_group(b: int, h: int, s: int, d: int, block_m: int, chunk: int, rounds: int) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n_m = triton.cdiv(s, block_m)
    acc = torch.randn(b * h, n_m * (d // chunk), block_m * chunk // 256, 256, device=dev)
    outs = {n: torch.empty(b, h, s, d, device=dev, dtype=torch.bfloat16)
            for n in ("shipped", "perm", "scatter")}
    kern = {"shipped": _dq_finish_fragments, "perm": _cast_perm, "scatter": _cast_scatter}
    flat = acc.view(-1)
    dense = torch.empty(flat.numel(), device=dev, dtype=torch.bfloat16)

    def launch(name):
        o = outs[name]
        return lambda: kern[name][(n_m, b * h)](acc, o, *o.stride(), h, s, n_m, HEAD_DIM=d,
                                                 BLOCK_M=block_m, CHUNK=chunk, num_warps=4)

    fns = {n: launch(n) for n in kern}
    fns["torch"] = lambda: dense.copy_(flat)
    for f in fns.values():
        f()
    same = {n: bool(torch.equal(outs[n], outs["shipped"])) for n in ("perm", "scatter")}
    names = list(fns)
    ts = time_interleaved([fns[n] for n in names], rounds=rounds)
    nbytes = acc.numel() * 4 + b * h * s * d * 2
    return dict(shape=[b, h, s, d], block_m=block_m, chunk=chunk, bitwise_equal=same,
                us={n: t.median_ms * 1e3 for n, t in zip(names, ts, strict=True)},
                tbps={n: nbytes / t.median_ms / 1e9 for n, t in zip(names, ts, strict=True)})


def pre_group(b: int, h: int, s: int, d: int, rounds: int, grid: list[tuple[int, int]]) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    o = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
    do = torch.randn_like(o)
    deltas = {bw: torch.empty(b * h, s, device=dev) for bw in grid}

    def launch(bm, w):
        dl = deltas[(bm, w)]
        return lambda: _attn_bwd_preprocess[(triton.cdiv(s, bm), b * h)](
            o, do, dl, dl, *o.stride(), *do.stride(), h, s, HEAD_DIM=d, BLOCK_D=d,
            BLOCK_M=bm, ZERO_DQ=False, num_warps=w)

    fns = {f"m{bm}w{w}": launch(bm, w) for bm, w in grid}
    fns["torch"] = lambda: (o.view(-1).sum(), do.view(-1).sum())
    for f in fns.values():
        f()
    ref = (o.float() * do.float()).sum(-1).view(b * h, s)
    err = {f"m{bm}w{w}": float((deltas[(bm, w)] - ref).abs().max()) for bm, w in grid}
    names = list(fns)
    ts = time_interleaved([fns[n] for n in names], rounds=rounds)
    nbytes = 2 * o.numel() * 2
    return dict(shape=[b, h, s, d], max_err=err,
                us={n: t.median_ms * 1e3 for n, t in zip(names, ts, strict=True)},
                tbps={n: nbytes / t.median_ms / 1e9 for n, t in zip(names, ts, strict=True)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    out: dict = dict(device=torch.cuda.get_device_name() if gpu else "cpu (interpreter)",
                     torch=torch.__version__, triton=triton.__version__,
                     date=time.strftime("%Y-%m-%d"), cast=[], pre=[])
    # (b, h, s, d, block_m, chunk): the standard rows' accumulators at 512 keys (the bytes
    # are the same at every row); 1000 keys for a ragged last tile.
    casts = ([(32, 16, 512, 128, 64, 64), (32, 32, 512, 64, 128, 32), (16, 16, 1000, 128, 64, 64)]
             if gpu else [(1, 2, 100, 64, 64, 32), (1, 1, 130, 128, 128, 64)])
    for b, h, s, d, bm, ch in casts:
        row = cast_group(b, h, s, d, bm, ch, args.rounds)
        out["cast"].append(row)
        print(json.dumps(row), flush=True)
    grid = ([(bm, w) for bm in (16, 32, 64, 128) for w in (4, 8)] if gpu else [(16, 4), (64, 4)])
    for b, h, s, d in ([(32, 16, 512, 128), (32, 32, 512, 64)] if gpu else [(1, 2, 100, 64)]):
        row = pre_group(b, h, s, d, args.rounds, grid)
        out["pre"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for row in out["cast"] + out["pre"]:
        best = sorted(row["tbps"].items(), key=lambda kv: -kv[1])
        print(row["shape"], " ".join(f"{n}={v:.2f}" for n, v in best), "TB/s")


if __name__ == "__main__":
    main()
