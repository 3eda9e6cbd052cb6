"""FlashAttention forward for Hopper (sm90), FA3-style, written in Gluon.

One program (persistent or not) walks query tiles of ``BLOCK_M = 64 * CONSUMERS`` rows
(one to three consumers; three is FA3's tile at D=64, where the consumers' share of the
register file is 152-160 per thread):

- a **producer** partition (the default one) loads each tile's Q (one 64-row slice per
  consumer) and streams the visible K/V tiles through a ring of ``STAGES`` shared-memory
  buffers with TMA, each buffer guarded by a full/empty mbarrier pair. In a persistent grid
  Q is double-buffered where shared memory allows (``Q_BUFS``), so the producer loads the
  next tile's Q and first K/V tiles while the consumers finish this one: on short rows a
  tile has few key tiles, and loading at the tile boundary left the tensor cores waiting;
- **consumer** warpgroups (one per 64 query rows) compute S = QKᵀ and O += PV with async
  ``warpgroup_mma``. The QKᵀ of tile j+1 is in flight while the softmax of tile j runs and
  PV of tile j-1 drains (FA3's intra-warpgroup overlap). With ``PINGPONG`` the two consumers
  take turns issuing their products, ordered by an mbarrier pair (Gluon on Triton 3.6 has no
  named barriers), so one warpgroup's exponentials overlap the other's tensor-core work.

Scores stay in the log2 domain; the softmax scale is folded into the exp2 argument
(``s * scale - m``: one FMA). Masks (causal bottom-right, window, ragged ends) are applied
only on the edge and diagonal tiles. TMA reads through rank-4 (B, H, S, D) descriptors, so
rows past a sequence's end come back as zeros and any 16-byte-aligned strides work. A
dense batch's O goes out through its consumer's Q buffer with one TMA store (with
``DEFER_O``, waited for behind the next tile's first product rather than at once); the
natural-log LSE is written with plain stores. Rows that see no key get O = 0 and
LSE = +inf, as in the portable kernel.

Packed (varlen) batches use the same program: q (total_q, Hq, D) is described as the
rank-4 view (1, Hq, total_q, D), and each program reads its sequence's first row and
length from the prefix sums on the device. A tile's rows past its sequence's end are
loaded from the next sequence and never stored; keys past the end are masked on the edge
tile, as Sk's ragged end is. Query tiles that lie wholly past their sequence's end are
skipped by the producer and the consumers alike.

This module imports Gluon's Hopper API at import time: import it only where
``flashtune.kernels.config.hopper_support()`` says the variant can run.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtune.kernels._bound import BoundLaunch, descriptor_like, template
from flashtune.kernels._masking import _inner_range
from flashtune.kernels._masking import _tanh as _portable_tanh
from flashtune.kernels._masking import _tile_coords as _portable_tile_coords
from flashtune.kernels.config import FwdConfig, hopper_q_buffers, l2_chunk_heads

ROWS_PER_WG = 64  # wgmma's M per warpgroup; each consumer owns 64 query rows
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


# The portable kernels' scalar and elementwise helpers, compiled as Gluon: one copy of the
# visibility rule, of the persistent grid's tile orders (tested under the interpreter) and
# of the precise tanh. _inner_range gives the key tiles [lo, hi) that query rows
# [start, start + BLOCK_M) can see and the unmasked middle run [full_lo, full_hi).
_tanh = gluon.jit(_portable_tanh.fn)
_kv_range = gluon.jit(_inner_range.fn)
_tile_coords = gluon.jit(_portable_tile_coords.fn)


@gluon.jit
def _sequence(CU_Q, CU_K, b, seq_q, seq_k, IS_VARLEN: gl.constexpr):
    """(first query row, first key row, query length, key length) of batch entry ``b``:
    dense, (0, 0, Sq, Sk); packed, read from the prefix sums."""
    if IS_VARLEN:
        q_off = gl.load(CU_Q + b)
        k_off = gl.load(CU_K + b)
        len_q = gl.load(CU_Q + b + 1) - q_off
        len_k = gl.load(CU_K + b + 1) - k_off
        return q_off, k_off, len_q, len_k
    else:
        return 0, 0, seq_q, seq_k


@gluon.jit
def _load_tile(desc, smem, full, empty, phase, b, h, row):
    """Wait until ``smem`` is free (``empty`` at ``phase``), then load the descriptor's box
    at (b, h, row, 0) into it with TMA, completing on ``full``."""
    mbarrier.wait(empty, phase)
    mbarrier.expect(full, desc.block_type.nbytes)
    dst = smem._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)
    tma.async_copy_global_to_shared(desc, [b, h, row, 0], full, dst)


@gluon.jit
def _producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem,
              q_full, q_empty, k_full, k_empty, v_full, v_empty, CU_Q, CU_K,
              n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k, left, right,
              GQA: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, Q_BUFS: gl.constexpr, ORDER: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr):
    BLOCK_M: gl.constexpr = 64 * CONSUMERS
    kv_count = 0
    t_local = 0
    for tile in range(gl.program_id(0), n_tiles, n_progs):
        bh, m_blk = _tile_coords(tile, n_m, bh_total, chunk, ORDER)
        b = bh // heads_q
        h = bh % heads_q
        hk = h // GQA
        q_off, k_off, len_q, len_k = _sequence(CU_Q, CU_K, b, seq_q, seq_k, IS_VARLEN)
        if IS_VARLEN:
            db = 0  # the descriptors are (1, H, total, D) views
        else:
            db = b
        q_start = m_blk * BLOCK_M
        if q_start < len_q:
            lo, full_lo, full_hi, hi = _kv_range(q_start, len_k, len_k - len_q, left, right,
                                                 BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
            q_slot = (t_local % Q_BUFS) * CONSUMERS
            q_phase = ((t_local // Q_BUFS) & 1) ^ 1
            for c in gl.static_range(CONSUMERS):
                _load_tile(desc_q, q_smem.index(q_slot + c), q_full.index(q_slot + c),
                           q_empty.index(q_slot + c), q_phase, db, h, q_off + q_start + c * 64)
            for start in range(lo, hi, BLOCK_N):
                buf = kv_count % STAGES
                phase = ((kv_count // STAGES) & 1) ^ 1
                _load_tile(desc_k, k_smem.index(buf), k_full.index(buf), k_empty.index(buf),
                           phase, db, hk, k_off + start)
                _load_tile(desc_v, v_smem.index(buf), v_full.index(buf), v_empty.index(buf),
                           phase, db, hk, k_off + start)
                kv_count += 1
            t_local += 1


@gluon.jit
def _mask_scores(s, rows, start, seq_k, offset, left, right,
                 MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
                 col_layout: gl.constexpr):
    cols = start + gl.arange(0, BLOCK_N, layout=col_layout)
    vis = cols[None, :] < seq_k
    if MASK_LEFT:
        vis = vis & (cols[None, :] >= rows[:, None] + offset - left)
    if MASK_RIGHT:
        vis = vis & (cols[None, :] <= rows[:, None] + offset + right)
    return gl.where(vis, s, -float("inf"))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, cap_scale, cap_log2, need_mask, rows, start, seq_k,
                  offset, left, right, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                  SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr, col_layout: gl.constexpr):
    """One online-softmax update. Returns (p, alpha, m_new, l_new); scores in log2 units."""
    if SOFTCAP:
        s = _tanh(s * cap_scale) * cap_log2
        scale = 1.0
    else:
        scale = qk_scale
    if need_mask:
        s = _mask_scores(s, rows, start, seq_k, offset, left, right, MASK_LEFT, MASK_RIGHT,
                         BLOCK_N, col_layout)
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    # A row that has seen no key yet keeps m = -inf; subtract 0 instead (no NaN).
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    p = gl.exp2(s * scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _steady_state(q, k_smem, v_smem, k_full, k_empty, v_full, v_empty, turn, turns, p, acc,
                  m_i, l_i, kv_count, n_iters, lo, full_lo, full_hi, rows, len_k, offset, left,
                  right, qk_scale, cap_scale, cap_log2, cid: gl.constexpr, STAGES: gl.constexpr,
                  PINGPONG: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                  SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """A tile's key tiles 1 .. n_iters - 1 (tile 0's S and softmax done, ``p`` its P): S(j)
    in flight while PV(j-1) runs and softmax(j) follows. Returns (P of the last key tile,
    its PV not issued; acc; m; l; turns)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = v_smem.dtype
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    for j in range(1, n_iters):
        start = lo + j * BLOCK_N
        cnt = kv_count + j
        buf = cnt % STAGES
        phase = (cnt // STAGES) & 1
        pbuf = (cnt - 1) % STAGES
        pphase = ((cnt - 1) // STAGES) & 1
        mbarrier.wait(k_full.index(buf), phase)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_full.index(pbuf), pphase)
        if PINGPONG:
            mbarrier.wait(turn.index(cid), (turns & 1) ^ (1 - cid))
        s = warpgroup_mma(q, k_smem.index(buf).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p16, v_smem.index(pbuf), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - cid), count=1)
            turns += 1
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        mbarrier.arrive(k_empty.index(buf), count=1)
        p, alpha_j, m_i, l_i = _softmax_step(
            s, m_i, l_i, qk_scale, cap_scale, cap_log2,
            (start < full_lo) | (start >= full_hi), rows, start, len_k, offset, left,
            right, MASK_LEFT, MASK_RIGHT, SOFTCAP, BLOCK_N, col_s)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(pbuf), count=1)
        acc = acc * gl.convert_layout(alpha_j, row_o)[:, None]
    return p, acc, m_i, l_i, turns


@gluon.jit
def _release_stored_q(q_empty, t_local, cid: gl.constexpr, CONSUMERS: gl.constexpr,
                      Q_BUFS: gl.constexpr):
    """With DEFER_O, at tile ``t_local``: wait for the previous tile's O store (TMA, out of
    that tile's Q buffer) to have read its buffer, then hand the buffer back to the
    producer. The store is issued at the end of its tile and waited for here, behind this
    tile's first product, instead of at once."""
    if t_local > 0:
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index(((t_local - 1) % Q_BUFS) * CONSUMERS + cid), count=1)


@gluon.jit
def _consumer(cid: gl.constexpr, q_smem, k_smem, v_smem,
              q_full, q_empty, k_full, k_empty, v_full, v_empty, turn,
              desc_o, O, LSE, CU_Q, CU_K, stride_ob, stride_oh, stride_om,
              n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k, left, right,
              qk_scale, cap_scale, cap_log2,
              CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              STAGES: gl.constexpr, Q_BUFS: gl.constexpr, ORDER: gl.constexpr,
              PINGPONG: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
              IS_VARLEN: gl.constexpr, DEFER_O: gl.constexpr, OVERLAP: gl.constexpr):
    """A consumer warpgroup: tile by tile (``_consumer_serial``), or with each tile's last
    PV and epilogue beside the next tile's first QK^T (``OVERLAP``, _consumer_overlapped)."""
    if OVERLAP:
        _consumer_overlapped(cid, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty,
                             v_full, v_empty, turn, desc_o, LSE, n_tiles, n_progs, n_m,
                             bh_total, chunk, heads_q, seq_q, seq_k, left, right, qk_scale,
                             cap_scale, cap_log2, CONSUMERS, BLOCK_N, D, STAGES, Q_BUFS, ORDER,
                             PINGPONG, MASK_LEFT, MASK_RIGHT, SOFTCAP)
    else:
        _consumer_serial(cid, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                         v_empty, turn, desc_o, O, LSE, CU_Q, CU_K, stride_ob, stride_oh,
                         stride_om, n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q,
                         seq_k, left, right, qk_scale, cap_scale, cap_log2, CONSUMERS, BLOCK_N,
                         D, STAGES, Q_BUFS, ORDER, PINGPONG, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                         IS_VARLEN, DEFER_O)


@gluon.jit
def _consumer_serial(cid: gl.constexpr, q_smem, k_smem, v_smem,
                     q_full, q_empty, k_full, k_empty, v_full, v_empty, turn,
                     desc_o, O, LSE, CU_Q, CU_K, stride_ob, stride_oh, stride_om,
                     n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k, left, right,
                     qk_scale, cap_scale, cap_log2,
                     CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                     STAGES: gl.constexpr, Q_BUFS: gl.constexpr, ORDER: gl.constexpr,
                     PINGPONG: gl.constexpr,
                     MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                     IS_VARLEN: gl.constexpr, DEFER_O: gl.constexpr):
    BLOCK_M: gl.constexpr = 64 * CONSUMERS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = v_smem.dtype
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    kv_count = 0
    t_local = 0
    turns = 0
    for tile in range(gl.program_id(0), n_tiles, n_progs):
        bh, m_blk = _tile_coords(tile, n_m, bh_total, chunk, ORDER)
        q_off, k_off, len_q, len_k = _sequence(CU_Q, CU_K, bh // heads_q, seq_q, seq_k,
                                               IS_VARLEN)
        q_start = m_blk * BLOCK_M
        if q_start < len_q:
            offset = len_k - len_q  # bottom-right alignment of the causal / window diagonal
            lo, full_lo, full_hi, hi = _kv_range(q_start, len_k, offset, left, right,
                                                 BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
            n_iters = (hi - lo) // BLOCK_N
            row0 = q_start + cid * 64
            rows = row0 + gl.arange(0, 64, layout=row_s)
            m_i = gl.full([64], -float("inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([64], gl.float32, layout=row_s)
            acc = gl.zeros([64, D], gl.float32, layout=o_layout)
            q_slot = (t_local % Q_BUFS) * CONSUMERS + cid
            if DEFER_O:
                if n_iters == 0:  # no product to hide the last tile's store behind
                    _release_stored_q(q_empty, t_local, cid, CONSUMERS, Q_BUFS)
            mbarrier.wait(q_full.index(q_slot), (t_local // Q_BUFS) & 1)
            q = q_smem.index(q_slot)
            if n_iters > 0:
                # Prologue: S of the first key tile, its softmax.
                buf = kv_count % STAGES
                phase = (kv_count // STAGES) & 1
                mbarrier.wait(k_full.index(buf), phase)
                if PINGPONG:
                    mbarrier.wait(turn.index(cid), (turns & 1) ^ (1 - cid))
                s = warpgroup_mma(q, k_smem.index(buf).permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - cid), count=1)
                    turns += 1
                if DEFER_O:  # the last tile's O store completes behind this product
                    _release_stored_q(q_empty, t_local, cid, CONSUMERS, Q_BUFS)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                mbarrier.arrive(k_empty.index(buf), count=1)
                p, alpha, m_i, l_i = _softmax_step(
                    s, m_i, l_i, qk_scale, cap_scale, cap_log2, (lo < full_lo) | (lo >= full_hi),
                    rows, lo, len_k, offset, left, right, MASK_LEFT, MASK_RIGHT, SOFTCAP, BLOCK_N,
                    col_s)
                # Steady state: S(j) in flight while PV(j-1) runs and softmax(j) follows.
                p, acc, m_i, l_i, turns = _steady_state(
                    q, k_smem, v_smem, k_full, k_empty, v_full, v_empty, turn, turns, p, acc,
                    m_i, l_i, kv_count, n_iters, lo, full_lo, full_hi, rows, len_k, offset, left,
                    right, qk_scale, cap_scale, cap_log2, cid, STAGES, PINGPONG, MASK_LEFT,
                    MASK_RIGHT, SOFTCAP, BLOCK_N, D)
                # Epilogue: PV of the last key tile.
                cnt = kv_count + n_iters - 1
                lbuf = cnt % STAGES
                mbarrier.wait(v_full.index(lbuf), (cnt // STAGES) & 1)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
                if PINGPONG:
                    mbarrier.wait(turn.index(cid), (turns & 1) ^ (1 - cid))
                acc = warpgroup_mma(p16, v_smem.index(lbuf), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - cid), count=1)
                    turns += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(lbuf), count=1)
            kv_count += n_iters
            t_local += 1

            out, lse = _out_and_lse(acc, m_i, l_i, o_layout)
            b = (bh // heads_q).to(gl.int64)
            h = (bh % heads_q).to(gl.int64)
            if IS_VARLEN:
                # Rows past the sequence's end belong to the next one: masked plain stores.
                rows_o = row0 + gl.arange(0, 64, layout=row_o)
                cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
                o_ptrs = O + b * stride_ob + h * stride_oh \
                    + (q_off + rows_o).to(gl.int64)[:, None] * stride_om + cols_o[None, :]
                gl.store(o_ptrs, out.to(dtype), mask=(rows_o < len_q)[:, None])
            else:
                # Every product that read this Q has completed: O goes out through its
                # buffer with one TMA store (rows past Sq are clipped by the descriptor),
                # not 64 partial-sector stores per thread.
                q.store(out.to(dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(
                    desc_o, [bh // heads_q, bh % heads_q, row0, 0],
                    q._reinterpret(desc_o.dtype, desc_o.block_type.shape, desc_o.layout))
                if not DEFER_O:
                    tma.store_wait(0)
            if not DEFER_O:
                # Q's buffer may take a later tile's.
                mbarrier.arrive(q_empty.index(q_slot), count=1)
            # seq_q >= 0, widened without a sign: a sign-extended kernel argument is a value
            # ptxas keeps live across the whole loop (and, at 240 registers, spills). (A
            # seq_q of 1 arrives as a constant: to_tensor makes it a value either way.)
            lse_rows = gl.to_tensor(seq_q).to(gl.uint32).to(gl.int64)
            if IS_VARLEN:  # (Hq, total_q)
                lse_ptrs = LSE + h * lse_rows + q_off + rows
            else:  # (B, Hq, Sq)
                lse_ptrs = LSE + bh.to(gl.int64) * lse_rows + rows
            gl.store(lse_ptrs, lse, mask=rows < len_q)
    if DEFER_O:
        tma.store_wait(0)  # the last tile's O


@gluon.jit
def _out_and_lse(acc, m_i, l_i, o_layout: gl.constexpr):
    """O = acc / l and the natural-log LSE of a tile's rows. Rows that saw no key get O = 0
    and LSE = +inf (the backward's P = exp(s - lse) = 0)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)  # ln 2
    return out, lse


@gluon.jit
def _finish_tile(acc, m_i, l_i, q_buf, desc_o, LSE, bh, row0, heads_q, seq_q,
                 o_layout: gl.constexpr, row_s: gl.constexpr):
    """A dense tile's end: O through its Q buffer with one TMA store (left in flight) and
    the LSE (see _out_and_lse)."""
    out, lse = _out_and_lse(acc, m_i, l_i, o_layout)
    q_buf.store(out.to(q_buf.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(
        desc_o, [bh // heads_q, bh % heads_q, row0, 0],
        q_buf._reinterpret(desc_o.dtype, desc_o.block_type.shape, desc_o.layout))
    rows = row0 + gl.arange(0, 64, layout=row_s)
    lse_rows = gl.to_tensor(seq_q).to(gl.uint32).to(gl.int64)  # see _consumer_serial
    gl.store(LSE + bh.to(gl.int64) * lse_rows + rows, lse, mask=rows < seq_q)


@gluon.jit
def _close_tile(acc, p16, m_i, l_i, last_cnt, slot, bh, row0, q_smem, v_smem, q_empty, v_full,
                v_empty, turn, turns, desc_o, LSE, heads_q, seq_q, cid: gl.constexpr,
                STAGES: gl.constexpr, PINGPONG: gl.constexpr, o_layout: gl.constexpr,
                row_s: gl.constexpr):
    """The last PV of a tile left open, alone (no next tile's product to pair it with),
    then its end; its Q buffer goes back to the producer. Returns the turns taken."""
    lbuf = last_cnt % STAGES
    mbarrier.wait(v_full.index(lbuf), (last_cnt // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn.index(cid), (turns & 1) ^ (1 - cid))
    acc = warpgroup_mma(p16, v_smem.index(lbuf), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - cid), count=1)
        turns += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(lbuf), count=1)
    _finish_tile(acc, m_i, l_i, q_smem.index(slot), desc_o, LSE, bh, row0, heads_q, seq_q,
                 o_layout, row_s)
    tma.store_wait(0)
    mbarrier.arrive(q_empty.index(slot), count=1)
    return turns


@gluon.jit
def _consumer_overlapped(cid: gl.constexpr, q_smem, k_smem, v_smem,
                         q_full, q_empty, k_full, k_empty, v_full, v_empty, turn,
                         desc_o, LSE, n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q,
                         seq_k, left, right, qk_scale, cap_scale, cap_log2,
                         CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                         STAGES: gl.constexpr, Q_BUFS: gl.constexpr, ORDER: gl.constexpr,
                         PINGPONG: gl.constexpr, MASK_LEFT: gl.constexpr,
                         MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr):
    """A consumer whose tiles overlap (dense batches, two Q buffers): a tile's last PV is
    left open, and issued together with the next tile's first QK^T; the tile's end (O
    through its Q buffer, the LSE) runs while that QK^T computes, and its Q buffer goes
    back to the producer before the next tile's softmax, so the tile after next loads
    its Q meanwhile. The serial consumer instead starts each tile's first QK^T only once
    the last tile's end is done: on short rows that start and end were a large part of a
    tile (BENCHMARKS.md, issue 12). A tile whose rows see no key closes the open one
    alone and ends at once (O = 0, LSE = +inf). Both consumers walk the same tiles, so
    their ping-pong turns stay in step."""
    BLOCK_M: gl.constexpr = 64 * CONSUMERS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = v_smem.dtype
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    offset = seq_k - seq_q  # bottom-right alignment of the causal / window diagonal
    kv_count = 0
    t_local = 0
    turns = 0
    # The open tile: its accumulator, last P, row statistics, last K/V index, Q buffer
    # and coordinates (has_open 0: none).
    has_open = 0
    acc_o = gl.zeros([64, D], gl.float32, layout=o_layout)
    p16_o = gl.convert_layout(zero_s.to(dtype), p_layout)
    m_o = gl.full([64], -float("inf"), gl.float32, layout=row_s)
    l_o = gl.zeros([64], gl.float32, layout=row_s)
    cnt_o = 0
    slot_o = 0
    bh_o = 0
    row0_o = 0
    for tile in range(gl.program_id(0), n_tiles, n_progs):
        bh, m_blk = _tile_coords(tile, n_m, bh_total, chunk, ORDER)
        q_start = m_blk * BLOCK_M
        lo, full_lo, full_hi, hi = _kv_range(q_start, seq_k, offset, left, right,
                                             BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
        n_iters = (hi - lo) // BLOCK_N
        row0 = q_start + cid * 64
        rows = row0 + gl.arange(0, 64, layout=row_s)
        q_slot = (t_local % Q_BUFS) * CONSUMERS + cid
        mbarrier.wait(q_full.index(q_slot), (t_local // Q_BUFS) & 1)
        q = q_smem.index(q_slot)
        if n_iters > 0:
            buf = kv_count % STAGES
            mbarrier.wait(k_full.index(buf), (kv_count // STAGES) & 1)
            # One turn: the open tile's last PV, then this tile's first QK^T, each issued
            # at one site. With no tile open the PV runs all the same, on whatever P and V
            # its buffers hold, and its result is dropped: Gluon lets no product in flight
            # leave an `if`, and with the QK^T written once per branch, ptxas 12.8 (Triton
            # 3.6's) hoisted the second k-step's Q descriptor out of the open branch and
            # read it undefined in the other (an out-of-range shared address, session 39).
            obuf = cnt_o % STAGES
            if has_open:
                mbarrier.wait(v_full.index(obuf), (cnt_o // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(cid), (turns & 1) ^ (1 - cid))
            acc_o = warpgroup_mma(p16_o, v_smem.index(obuf), acc_o, is_async=True)
            s = warpgroup_mma(q, k_smem.index(buf).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - cid), count=1)
                turns += 1
            # The PV (issued first) completes; the QK^T runs on while the open tile ends.
            acc_o = warpgroup_mma_wait(num_outstanding=1, deps=(acc_o, ))
            if has_open:
                mbarrier.arrive(v_empty.index(obuf), count=1)
                _finish_tile(acc_o, m_o, l_o, q_smem.index(slot_o), desc_o, LSE, bh_o, row0_o,
                             heads_q, seq_q, o_layout, row_s)
                tma.store_wait(0)
                mbarrier.arrive(q_empty.index(slot_o), count=1)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            mbarrier.arrive(k_empty.index(buf), count=1)
            m_i = gl.full([64], -float("inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([64], gl.float32, layout=row_s)
            p, alpha, m_i, l_i = _softmax_step(
                s, m_i, l_i, qk_scale, cap_scale, cap_log2, (lo < full_lo) | (lo >= full_hi),
                rows, lo, seq_k, offset, left, right, MASK_LEFT, MASK_RIGHT, SOFTCAP, BLOCK_N,
                col_s)
            acc = gl.zeros([64, D], gl.float32, layout=o_layout)
            p, acc, m_i, l_i, turns = _steady_state(
                q, k_smem, v_smem, k_full, k_empty, v_full, v_empty, turn, turns, p, acc, m_i,
                l_i, kv_count, n_iters, lo, full_lo, full_hi, rows, seq_k, offset, left, right,
                qk_scale, cap_scale, cap_log2, cid, STAGES, PINGPONG, MASK_LEFT, MASK_RIGHT,
                SOFTCAP, BLOCK_N, D)
            # This tile stays open: its last PV goes with the next tile's first QK^T.
            acc_o = acc
            p16_o = gl.convert_layout(p.to(dtype), p_layout)
            m_o = m_i
            l_o = l_i
            cnt_o = kv_count + n_iters - 1
            slot_o = q_slot
            bh_o = bh
            row0_o = row0
            has_open = 1
        else:
            if has_open:
                turns = _close_tile(acc_o, p16_o, m_o, l_o, cnt_o, slot_o, bh_o, row0_o, q_smem,
                                    v_smem, q_empty, v_full, v_empty, turn, turns, desc_o, LSE,
                                    heads_q, seq_q, cid, STAGES, PINGPONG, o_layout, row_s)
            # No key to see: O = 0 and LSE = +inf, at once.
            _finish_tile(gl.zeros([64, D], gl.float32, layout=o_layout),
                         gl.full([64], -float("inf"), gl.float32, layout=row_s),
                         gl.zeros([64], gl.float32, layout=row_s), q, desc_o, LSE, bh, row0,
                         heads_q, seq_q, o_layout, row_s)
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(q_slot), count=1)
            has_open = 0
        kv_count += n_iters
        t_local += 1
    if has_open:
        turns = _close_tile(acc_o, p16_o, m_o, l_o, cnt_o, slot_o, bh_o, row0_o, q_smem, v_smem,
                            q_empty, v_full, v_empty, turn, turns, desc_o, LSE, heads_q, seq_q,
                            cid, STAGES, PINGPONG, o_layout, row_s)


# The grid size and B*Hq vary with the batch; left unspecialized, a reduced problem (the
# tuner's correctness gate) launches the binary that the full one times.
@gluon.jit(do_not_specialize=["n_progs", "bh_total"])
def _attn_fwd_hopper_kernel(
    desc_q, desc_k, desc_v, desc_o, O, LSE, CU_Q, CU_K,
    stride_ob, stride_oh, stride_om,
    heads_q, seq_q, seq_k, left, right, n_m, n_tiles, n_progs, bh_total, chunk,
    qk_scale, cap_scale, cap_log2,
    GQA: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, Q_BUFS: gl.constexpr, ORDER: gl.constexpr, PINGPONG: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, IS_VARLEN: gl.constexpr, DEFER_O: gl.constexpr,
    OVERLAP: gl.constexpr,
):
    gl.static_assert(CONSUMERS >= 1 and CONSUMERS <= 3)
    gl.static_assert(not PINGPONG or CONSUMERS == 2)
    # A deferred O store holds its tile's Q buffer into the next tile: two buffers, and
    # a dense batch (a packed one stores O with plain stores).
    gl.static_assert(not DEFER_O or (Q_BUFS == 2 and not IS_VARLEN))
    gl.static_assert(not OVERLAP or (Q_BUFS == 2 and not IS_VARLEN and not DEFER_O))
    D: gl.constexpr = desc_q.block_type.shape[3]
    dtype: gl.constexpr = desc_q.dtype
    if IS_VARLEN:
        # One tile per program (not persistent): a tile past its sequence's end exits here,
        # before the barriers and partitions are set up. The grid is sized by the longest
        # sequence, so most of a mixed batch's programs are such tiles.
        if n_progs == n_tiles:
            bh, m_blk = _tile_coords(gl.program_id(0), n_m, bh_total, chunk, ORDER)
            b = bh // heads_q
            if m_blk * (64 * CONSUMERS) >= gl.load(CU_Q + b + 1) - gl.load(CU_Q + b):
                return
    # 2-D shared tiles for the tensor cores; TMA writes them through rank-4 views.
    q_layout: gl.constexpr = gl.NVMMASharedLayout(desc_q.layout.swizzle_byte_width, 16)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout(desc_k.layout.swizzle_byte_width, 16)
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFS * CONSUMERS, 64, D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    q_full = gl.allocate_shared_memory(gl.int64, [Q_BUFS * CONSUMERS, 1],
                                       mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS * CONSUMERS, 1],
                                        mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFS * CONSUMERS):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    # The producer is the default partition; one worker partition per consumer warpgroup.
    # Written out per count: Triton 3.6 traces the partition lists as literals (arguments
    # gathered into a tuple variable lose their constexpr-ness there).
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem,
                          q_full, q_empty, k_full, k_empty, v_full, v_empty, CU_Q, CU_K,
                          n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k,
                          left, right, GQA, CONSUMERS, BLOCK_N, STAGES, Q_BUFS, ORDER,
                          MASK_LEFT, MASK_RIGHT, IS_VARLEN)),
            (_consumer, (0, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                         v_empty, turn, desc_o, O, LSE, CU_Q, CU_K, stride_ob, stride_oh,
                         stride_om,
                         n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k,
                         left, right, qk_scale, cap_scale, cap_log2, CONSUMERS, BLOCK_N, D,
                         STAGES, Q_BUFS, ORDER, PINGPONG, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                         IS_VARLEN, DEFER_O, OVERLAP)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                         v_empty, turn, desc_o, O, LSE, CU_Q, CU_K, stride_ob, stride_oh,
                         stride_om,
                         n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k,
                         left, right, qk_scale, cap_scale, cap_log2, CONSUMERS, BLOCK_N, D,
                         STAGES, Q_BUFS, ORDER, PINGPONG, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                         IS_VARLEN, DEFER_O, OVERLAP)),
            (_consumer, (2, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                         v_empty, turn, desc_o, O, LSE, CU_Q, CU_K, stride_ob, stride_oh,
                         stride_om,
                         n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k,
                         left, right, qk_scale, cap_scale, cap_log2, CONSUMERS, BLOCK_N, D,
                         STAGES, Q_BUFS, ORDER, PINGPONG, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                         IS_VARLEN, DEFER_O, OVERLAP)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem,
                          q_full, q_empty, k_full, k_empty, v_full, v_empty, CU_Q, CU_K,
                          n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k,
                          left, right, GQA, CONSUMERS, BLOCK_N, STAGES, Q_BUFS, ORDER,
                          MASK_LEFT, MASK_RIGHT, IS_VARLEN)),
            (_consumer, (0, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                         v_empty, turn, desc_o, O, LSE, CU_Q, CU_K, stride_ob, stride_oh,
                         stride_om,
                         n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k,
                         left, right, qk_scale, cap_scale, cap_log2, CONSUMERS, BLOCK_N, D,
                         STAGES, Q_BUFS, ORDER, PINGPONG, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                         IS_VARLEN, DEFER_O, OVERLAP)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                         v_empty, turn, desc_o, O, LSE, CU_Q, CU_K, stride_ob, stride_oh,
                         stride_om,
                         n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k,
                         left, right, qk_scale, cap_scale, cap_log2, CONSUMERS, BLOCK_N, D,
                         STAGES, Q_BUFS, ORDER, PINGPONG, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                         IS_VARLEN, DEFER_O, OVERLAP)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem,
                          q_full, q_empty, k_full, k_empty, v_full, v_empty, CU_Q, CU_K,
                          n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k,
                          left, right, GQA, CONSUMERS, BLOCK_N, STAGES, Q_BUFS, ORDER,
                          MASK_LEFT, MASK_RIGHT, IS_VARLEN)),
            (_consumer, (0, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                         v_empty, turn, desc_o, O, LSE, CU_Q, CU_K, stride_ob, stride_oh,
                         stride_om,
                         n_tiles, n_progs, n_m, bh_total, chunk, heads_q, seq_q, seq_k,
                         left, right, qk_scale, cap_scale, cap_log2, CONSUMERS, BLOCK_N, D,
                         STAGES, Q_BUFS, ORDER, PINGPONG, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                         IS_VARLEN, DEFER_O, OVERLAP)),
        ], [4], [CONSUMER_REGS])


# ----------------------------------------------------------------------------- host side


def tma_describable(*ts: torch.Tensor) -> str:
    """'' if TMA can describe every tensor (unit inner stride, 16-byte aligned base and
    strides), else the reason it cannot."""
    for t in ts:
        if t.stride(-1) != 1:
            return f"inner stride {t.stride(-1)} != 1"
        if t.data_ptr() % 16:
            return "base address not 16-byte aligned"
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return f"strides {tuple(t.stride())} not 16-byte aligned"
    return ""


@functools.lru_cache(maxsize=64)
def _smem_layout(rows: int, d: int, dtype: torch.dtype) -> Any:
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], _GL_DTYPES[dtype])


def _descriptor(t: torch.Tensor, rows: int, cols: int = 0) -> Any:
    """A rank-4 TMA descriptor over ``t`` whose box is ``rows`` rows of one head, ``cols``
    wide (default: the whole head dim)."""
    cols = cols or t.shape[-1]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols],
                            _smem_layout(rows, cols, t.dtype))


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=16)
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def l2_chunk(k: torch.Tensor, order: int, rows_k: int, gqa: int, bh_total: int) -> int:
    """The kernel's ``chunk`` (:func:`~flashtune.kernels.config.l2_chunk_heads` on this
    device for tile order 3; 1 for the other orders, which do not read it)."""
    if order != 3:
        return 1
    return l2_chunk_heads(rows_k, k.shape[-1], k.element_size(), gqa, bh_total,
                          _l2_bytes(k.device.index or 0))


def _packed_view(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor as the rank-4 (1, H, total, D) view the descriptors
    take (same data, any 16-byte-aligned strides)."""
    return t.unsqueeze(0).transpose(1, 2)


class HopperLaunch:
    """The Gluon forward for one call signature, prepared once: the grid, the scalars and
    constexprs, descriptor templates and the bound kernel (``flashtune.kernels._bound``, the
    mechanism the portable kernels use). ``mask`` is (left, right, MASK_LEFT, MASK_RIGHT)
    and ``scales`` (qk_scale, cap_scale, cap_log2), as the portable launcher computes them.
    With ``packed`` (the prefix sums and the longest query and key sequence, as
    ``attn_fwd.Packed`` holds them), q is (total_q, Hq, D), k and v (total_k, Hkv, D), and
    the LSE (Hq, total_q). The caller has checked feasibility and that TMA can describe
    q, k, v; calling it with tensors of the same signature and 16-byte aligned data
    allocates O and the LSE and launches."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 mask: tuple[int, int, bool, bool], scales: tuple[float, float, float],
                 softcap: float, config: FwdConfig,
                 packed: tuple[torch.Tensor, torch.Tensor, int, int] | None = None) -> None:
        c = config
        o = torch.empty_like(q)  # its strides (empty_like keeps q's layout), never its data
        if packed is None:
            b, hq, sq, _ = q.shape
            hk, sk = k.shape[1], k.shape[2]
            rows, rows_k = sq, sk
            self.lse_shape: tuple[int, ...] = (b, hq, sq)
            o_strides = (o.stride(0), o.stride(1), o.stride(2))
            views = (q, k, v, o)
        else:
            cu_q, _, max_q, _ = packed
            b, hq, hk = cu_q.shape[0] - 1, q.shape[1], k.shape[1]
            sq, sk = q.shape[0], k.shape[0]
            rows, rows_k = max(int(max_q), 1), int(packed[3])
            self.lse_shape = (hq, sq)
            o_strides = (0, o.stride(1), o.stride(0))
            views = tuple(_packed_view(t) for t in (q, k, v, o))
        left, right, mask_left, mask_right = mask
        qk_scale, cap_scale, cap_log2 = scales
        consumers = c.block_m // ROWS_PER_WG
        n_m = -(-rows // c.block_m)
        n_tiles = n_m * b * hq
        grid_size = min(n_tiles, _sm_count(q.device.index or 0)) if c.persistent else n_tiles
        self.templates = (template(_descriptor(views[0], ROWS_PER_WG)),
                          template(_descriptor(views[1], c.block_n)),
                          template(_descriptor(views[2], c.block_n)),
                          template(_descriptor(views[3], ROWS_PER_WG)))
        # Slots 0-7 (the q, k, v and o descriptors, o, lse, the prefix sums) change from
        # call to call.
        args = [None] * 8 + [*o_strides, hq, sq, sk, left, right, n_m, n_tiles, grid_size,
                             b * hq, l2_chunk(k, c.tile_order, rows_k, hq // hk, b * hq),
                             qk_scale, cap_scale, cap_log2]
        kwargs = dict(
            GQA=hq // hk, CONSUMERS=consumers, BLOCK_N=c.block_n, STAGES=c.num_stages,
            Q_BUFS=hopper_q_buffers(c, q.shape[-1]), ORDER=c.tile_order,
            PINGPONG=bool(c.pingpong), MASK_LEFT=mask_left, MASK_RIGHT=mask_right,
            SOFTCAP=softcap > 0.0, CONSUMER_REGS=c.consumer_regs, IS_VARLEN=packed is not None,
            DEFER_O=bool(c.defer_o), OVERLAP=bool(c.tile_overlap), num_warps=4)
        self.launch = BoundLaunch(_attn_fwd_hopper_kernel, (grid_size,), args, kwargs, 8)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_q: torch.Tensor | None = None, cu_k: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.empty_like(q)
        lse = torch.empty(self.lse_shape, device=q.device, dtype=torch.float32)
        tq, tk, tv, to = self.templates
        if cu_q is None:
            cu_q = cu_k = lse  # dense: unused pointers
        # A descriptor template reads only its tensor's data pointer, which a packed
        # tensor shares with its rank-4 view.
        self.launch(descriptor_like(tq, q), descriptor_like(tk, k), descriptor_like(tv, v),
                    descriptor_like(to, o), o, lse, cu_q, cu_k)
        return o, lse


def attn_fwd_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float,
                    mask: tuple[int, int, bool, bool], scales: tuple[float, float, float],
                    softcap: float, config: FwdConfig,
                    packed: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Gluon forward once (see :class:`HopperLaunch`; ``sm_scale`` is folded
    into ``scales``)."""
    launch = HopperLaunch(q, k, v, mask=mask, scales=scales, softcap=softcap, config=config,
                          packed=packed)
    if packed is None:
        return launch(q, k, v)
    return launch(q, k, v, packed[0], packed[1])
