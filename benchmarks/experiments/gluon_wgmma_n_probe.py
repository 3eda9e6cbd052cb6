"""Which query-step heights can a Gluon wgmma take? Built for sm_90 without a GPU.

FA3's sm90 backward at head dim 128 steps 80 query rows when unmasked, with the query rows
on the wgmma's N side. This builds one warpgroup's ``acc[64, N] = A[64, 128] @ B[128, N]``
for each N given, with B as a shared buffer of its own and as a slice of a 128-wide one
(the accumulator's [64, N] layout is needed either way). Each build either gives PTX or
the compiler's message. Compile-only through ``benchmarks/probe_ptxas.py``'s driver;
nothing runs.

    PYTHONPATH=<triton 3.6>:.:benchmarks python3 \\
        benchmarks/experiments/gluon_wgmma_n_probe.py [--n 64 80 96 128]

Session 45 (Triton 3.6): N = 64 and 128 build; N = 80 and 96 fail in both spellings with
"shape must have power-of-2 and non-zero dimensions" (the accumulator's layout, reached
first, refuses the shape, so a sliced B alone is not what is refused).
"""

from __future__ import annotations

import argparse

import torch
from probe_ptxas import BUILT_PTX, _install_compile_only

_install_compile_only()

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

KD = 128  # the products' reduction length (the keys of a tile, or the head dim)


@gluon.jit
def _probe(Out, N: gl.constexpr, KD: gl.constexpr, SLICED: gl.constexpr):
    fill: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    a = gl.allocate_shared_memory(
        gl.bfloat16, [64, KD], gl.NVMMASharedLayout.get_default_for([64, KD], gl.bfloat16))
    a.store(gl.zeros([64, KD], gl.bfloat16, layout=fill))
    if SLICED:
        wide = gl.allocate_shared_memory(
            gl.bfloat16, [KD, 128], gl.NVMMASharedLayout.get_default_for([KD, 128], gl.bfloat16))
        wide.store(gl.zeros([KD, 128], gl.bfloat16, layout=fill))
        b = wide.slice(0, N, dim=1)
    else:
        b = gl.allocate_shared_memory(
            gl.bfloat16, [KD, N], gl.NVMMASharedLayout.get_default_for([KD, N], gl.bfloat16))
        b.store(gl.zeros([KD, N], gl.bfloat16, layout=fill))
    fence_async_shared()
    acc = gl.zeros([64, N], gl.float32, layout=acc_layout)
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout))
    gl.store(Out + rows[:, None] * N + cols[None, :], acc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[64, 80, 96, 128])
    args = ap.parse_args()
    out = torch.empty(64 * max(args.n), dtype=torch.float32)
    for n in args.n:
        for sliced in (False, True):
            spelling = "slice of 128" if sliced else "own buffer"
            BUILT_PTX.pop("_probe", None)
            try:
                _probe[(1, )](out, n, KD, sliced, num_warps=4)
                ok = "wgmma.mma_async" in BUILT_PTX.get("_probe", "")
                print(f"N={n:<4} {spelling:13} built{'' if ok else ' (no wgmma in the PTX)'}")
            except Exception as e:  # the compiler's refusal is the answer
                last = [ln for ln in str(e).splitlines() if ln.strip()][-1:] or [type(e).__name__]
                print(f"N={n:<4} {spelling:13} refused: {last[0]}")


if __name__ == "__main__":
    main()
