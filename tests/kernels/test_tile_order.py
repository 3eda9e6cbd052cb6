"""The Hopper forward's tile orders (``flashtune.kernels._masking._tile_coords``, which the
Gluon kernel compiles as is), run under the interpreter, and the L2 chunk size of order 3.

Every order must visit each (head, query block) exactly once; the heaviest-first orders
must put a head's last (for causal rows, heaviest) query block before its lighter ones;
order 3 must keep each chunk's heads together and finish one chunk before the next."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from flashtune.kernels._masking import _inner_range, _tile_coords, inner_range_host
from flashtune.kernels.config import l2_chunk_heads


@triton.jit
def _coords_kernel(BH, M, n_m, bh_total, chunk, ORDER: tl.constexpr):
    tile = tl.program_id(0)
    bh, m_blk = _tile_coords(tile, n_m, bh_total, chunk, ORDER)
    tl.store(BH + tile, bh)
    tl.store(M + tile, m_blk)


def coords(order: int, n_m: int, bh_total: int, chunk: int) -> list[tuple[int, int]]:
    n = n_m * bh_total
    bh = torch.full((n,), -1, dtype=torch.int32)
    m = torch.full((n,), -1, dtype=torch.int32)
    _coords_kernel[(n,)](bh, m, n_m, bh_total, chunk, ORDER=order)
    return list(zip(bh.tolist(), m.tolist(), strict=True))


@pytest.mark.parametrize("order", [0, 1, 2, 3])
@pytest.mark.parametrize("n_m, bh_total, chunk", [(4, 10, 3), (1, 7, 2), (5, 6, 6), (3, 5, 1),
                                                   (2, 9, 20)])
def test_every_tile_once_and_heaviest_first(order: int, n_m: int, bh_total: int,
                                            chunk: int) -> None:
    seq = coords(order, n_m, bh_total, chunk)
    assert sorted(seq) == [(b, m) for b in range(bh_total) for m in range(n_m)]
    first_seen: dict[int, list[int]] = {}
    for b, m in seq:
        first_seen.setdefault(b, []).append(m)
    for b, ms in first_seen.items():
        if order == 0:
            assert ms == sorted(ms), (b, ms)
        else:  # a head's query blocks come heaviest (last) first
            assert ms == sorted(ms, reverse=True), (b, ms)
    if order == 2:  # longest-processing-time across the whole grid
        assert [m for _, m in seq] == sorted((m for _, m in seq), reverse=True)
    if order == 3:
        # Chunks of `chunk` consecutive heads (the last may be short), one after another,
        # heaviest first within each.
        size = min(chunk, bh_total)
        for i in range(0, len(seq), size * n_m):
            part = seq[i:i + size * n_m]
            heads = {b for b, _ in part}
            first = i // n_m
            assert heads == set(range(first, min(first + size, bh_total))), (i, heads)
            assert [m for _, m in part] == sorted((m for _, m in part), reverse=True)


def test_l2_chunk_heads() -> None:
    mb = 1 << 20
    # 512 keys x D=128 x bf16, K and V: 256 KiB per head; half of a 50 MiB L2 holds 100.
    assert l2_chunk_heads(512, 128, 2, 1, 4096, 50 * mb) == 100
    # Never more heads than there are, never fewer than one.
    assert l2_chunk_heads(512, 128, 2, 1, 16, 50 * mb) == 16
    assert l2_chunk_heads(1 << 20, 128, 2, 1, 16, 50 * mb) == 1
    # GQA: a K/V head serves `gqa` query heads, so a chunk takes whole groups of them.
    assert l2_chunk_heads(512, 128, 2, 4, 4096, 50 * mb) == 400
    # Longer keys, wider heads and wider types all shrink the chunk.
    assert l2_chunk_heads(2048, 128, 2, 1, 4096, 50 * mb) == 25
    assert l2_chunk_heads(512, 64, 2, 1, 4096, 50 * mb) == 200
    assert l2_chunk_heads(512, 128, 4, 1, 4096, 50 * mb) == 50


@triton.jit
def _range_kernel(OUT, ARGS, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr,
                  MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    i = tl.program_id(0)
    lo, full_lo, full_hi, hi = _inner_range(
        tl.load(ARGS + 5 * i), tl.load(ARGS + 5 * i + 1), tl.load(ARGS + 5 * i + 2),
        tl.load(ARGS + 5 * i + 3), tl.load(ARGS + 5 * i + 4), BLOCK_OUTER, BLOCK_INNER,
        MASK_LEFT, MASK_RIGHT)
    tl.store(OUT + 4 * i, lo)
    tl.store(OUT + 4 * i + 1, full_lo)
    tl.store(OUT + 4 * i + 2, full_hi)
    tl.store(OUT + 4 * i + 3, hi)


@pytest.mark.parametrize("blocks", [(64, 128), (128, 64)])
@pytest.mark.parametrize("mask_left, mask_right", [(False, False), (False, True), (True, False),
                                                   (True, True)])
def test_host_inner_range_is_the_kernels(blocks: tuple[int, int], mask_left: bool,
                                         mask_right: bool) -> None:
    """``inner_range_host`` (the host's copy, for the Hopper backward's launch plan) gives
    what the kernels' ``_inner_range`` computes, negative offsets and ranges included
    (integer division towards zero there)."""
    gen = torch.Generator().manual_seed(7)
    n = 48
    args = torch.stack([
        torch.randint(0, 30, (n,), generator=gen) * blocks[0],   # start: a tile's first row
        torch.randint(1, 1500, (n,), generator=gen),             # inner length
        torch.randint(-1500, 1500, (n,), generator=gen),         # offset = Sk - Sq
        torch.randint(0, 400, (n,), generator=gen),              # left
        torch.randint(0, 400, (n,), generator=gen)], 1).to(torch.int32)
    out = torch.full((n, 4), -7, dtype=torch.int32)
    _range_kernel[(n,)](out, args, BLOCK_OUTER=blocks[0], BLOCK_INNER=blocks[1],
                        MASK_LEFT=mask_left, MASK_RIGHT=mask_right)
    for a, got in zip(args.tolist(), out.tolist(), strict=True):
        assert list(inner_range_host(*a, *blocks, mask_left, mask_right)) == got, a
