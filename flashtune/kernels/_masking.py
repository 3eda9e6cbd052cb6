"""Block-range arithmetic and the soft-capping tanh, shared by every kernel (the Hopper
kernels compile the same functions as Gluon).

Visibility rule (flash-attn >= 2.1, bottom-right aligned): with ``offset = Sk - Sq``,
query row ``i`` sees key ``j`` iff ``i + offset - left <= j <= i + offset + right``,
where an unbounded side (``left``/``right`` = -1, no causal) is simply not checked.
``causal`` is ``right = 0``.

For an outer tile ``[start, start + BLOCK_OUTER)`` the inner loop is split in three
runs of inner tiles: ``[lo, full_lo)`` needs the mask, ``[full_lo, full_hi)`` is
visible to every outer row and in bounds (no mask at all), ``[full_hi, hi)`` needs
the mask again. The backward's dK/dV kernel uses the same helper with the roles of
queries and keys swapped (``offset -> -offset``, ``left <-> right``).
"""

import triton
import triton.language as tl


@triton.jit
def _inner_range(start, inner_len, offset, left, right,
                 BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr,
                 MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    # Outer rows x in [start, start + BLOCK_OUTER) see inner j in
    # [x + offset - left, x + offset + right].
    last = start + BLOCK_OUTER - 1
    hi = inner_len
    if MASK_RIGHT:
        hi = tl.minimum(hi, last + offset + right + 1)
    hi = tl.maximum(hi, 0)
    hi = tl.cdiv(hi, BLOCK_INNER) * BLOCK_INNER
    lo = 0
    if MASK_LEFT:
        lo = tl.maximum(start + offset - left, 0)
        lo = (lo // BLOCK_INNER) * BLOCK_INNER
    lo = tl.minimum(lo, hi)
    # Tiles fully visible to every outer row and fully in bounds.
    full_hi = (inner_len // BLOCK_INNER) * BLOCK_INNER
    if MASK_RIGHT:
        full_hi = tl.minimum(full_hi, ((start + offset + right + 1) // BLOCK_INNER) * BLOCK_INNER)
    full_lo = lo
    if MASK_LEFT:
        full_lo = tl.maximum(full_lo, tl.cdiv(last + offset - left, BLOCK_INNER) * BLOCK_INNER)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


def _tdiv(a: int, b: int) -> int:
    """Integer division as the kernels do it (towards zero), for b > 0."""
    return a // b if a >= 0 else -(-a // b)


def inner_range_host(start: int, inner_len: int, offset: int, left: int, right: int,
                     block_outer: int, block_inner: int, mask_left: bool, mask_right: bool,
                     ) -> tuple[int, int, int, int]:
    """``_inner_range`` on the host, for Python ints, with the kernels' integer division
    (towards zero; ``tl.cdiv(x, b)`` is ``(x + b - 1) / b`` so): (lo, full_lo, full_hi, hi)."""
    def cdiv(x: int) -> int:
        return _tdiv(x + block_inner - 1, block_inner)

    last = start + block_outer - 1
    hi = inner_len
    if mask_right:
        hi = min(hi, last + offset + right + 1)
    hi = cdiv(max(hi, 0)) * block_inner
    lo = 0
    if mask_left:
        lo = _tdiv(max(start + offset - left, 0), block_inner) * block_inner
    lo = min(lo, hi)
    full_hi = _tdiv(inner_len, block_inner) * block_inner
    if mask_right:
        full_hi = min(full_hi, _tdiv(start + offset + right + 1, block_inner) * block_inner)
    full_lo = lo
    if mask_left:
        full_lo = max(full_lo, cdiv(last + offset - left) * block_inner)
    full_lo = min(full_lo, hi)
    full_hi = min(max(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _tile_coords(tile, n_m, bh_total, chunk, ORDER: tl.constexpr):
    """(batch * heads + head, query block) of a work tile. ORDER 0: query blocks fastest, in
    order; 1: query blocks fastest, heaviest (last, for causal) first; 2: heads fastest,
    heaviest first (longest-processing-time order across the whole grid); 3: as 2 within
    chunks of ``chunk`` heads, one chunk after another (the host sizes a chunk so its K/V
    stay in L2 while all its query blocks read them; with 2, a head's K/V are evicted
    before its lighter query blocks come round when all heads' K/V exceed L2)."""
    if ORDER == 3:
        per_chunk = chunk * n_m
        first = tile // per_chunk * chunk
        width = tl.minimum(chunk, bh_total - first)
        u = tile % per_chunk
        bh = first + u % width
        m_blk = n_m - 1 - u // width
    elif ORDER == 2:
        bh = tile % bh_total
        m_blk = n_m - 1 - tile // bh_total
    else:
        bh = tile // n_m
        if ORDER == 1:
            m_blk = n_m - 1 - tile % n_m
        else:
            m_blk = tile % n_m
    return bh, m_blk


@triton.jit
def _visible(rows, cols, n_rows, n_cols, offset, left, right,
             MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    # rows: [R] outer indices, cols: [C] inner indices -> [R, C] boolean visibility + bounds.
    vis = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if MASK_LEFT:
        vis = vis & (cols[None, :] >= rows[:, None] + offset - left)
    if MASK_RIGHT:
        vis = vis & (cols[None, :] <= rows[:, None] + offset + right)
    return vis


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); saturates cleanly to +-1 (exp2 -> inf or 0). Near 0 it
    # cancels (1 - ~1) to ~1e-7 absolute, which flattens the scores under a large softcap
    # (tiny x): there the odd series x - x^3/3 + 2x^5/15 holds fp32 precision (the next
    # term, 17x^7/315, is below 2.1e-7 |x| for |x| < 1/8).
    far = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 / ln(2)
    x2 = x * x
    near = x * (1.0 - x2 * (0.3333333333333333 - x2 * 0.13333333333333333))  # 1/3, 2/15
    return tl.where(tl.abs(x) < 0.125, near, far)
