"""FlashAttention-2 backward: delta preprocess, a dK/dV kernel and a dQ kernel.

Both main kernels recompute P = exp(S - LSE) from the forward's saved LSE. Neither
uses atomics: the dK/dV kernel holds a K/V tile and loops over query tiles (and,
for GQA, over every query head of its group, summing in a fixed order); the dQ
kernel holds a Q tile and loops over key tiles. Gradients are therefore
bit-identical from run to run.

Two more variants (``BwdConfig.variant``) reuse the same program bodies: the atomic
variant lets the dK/dV kernel add dS.K into an fp32 dQ accumulator (five matrix products
instead of seven; the order of the additions is not fixed, so only for
``deterministic=False``), and the one-launch variant runs the dK/dV and dQ programs in one
grid (deterministic: each program writes only its own tiles).

Packed (varlen) batches use the same kernels with ``IS_VARLEN``, as the forward does:
(total, H, D) tensors, per-sequence bounds from the prefix sums, and (Hq, total_q) LSE
and delta buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from flashtune.exceptions import InfeasibleConfigError
from flashtune.kernels._bound import BoundLaunch
from flashtune.kernels._bwd_common import _attn_bwd_dq_finish, _attn_bwd_preprocess
from flashtune.kernels._masking import _inner_range, _tanh, _visible
from flashtune.kernels.attn_fwd import (
    Packed,
    _load_rows,
    _lse_row,
    _seq_bounds,
    call_problem,
    kernel_strides,
    launch_options,
    mask_params,
    problem_dims,
    score_scales,
    warn_portable_once,
)
from flashtune.kernels.config import (
    BWD_ATOMIC,
    BWD_FUSED,
    BWD_HOPPER,
    BWD_ONE_GRID,
    BWD_TWO_KERNEL,
    BWD_VARIANT_NAMES,
    BwdConfig,
    default_bwd,
    padded_head_dim,
)


@triton.jit
def _dq_atomic_add(DQA, dq_desc, row0, start, offs_m, offs_d, dq, seq_q,
                   BLOCK_D: tl.constexpr, MASKED: tl.constexpr, DQ_TMA: tl.constexpr):
    # Add a [BLOCK_M, BLOCK_D] dQ contribution to the fp32 accumulator's rows
    # row0 + offs_m. Rows past the sequence carry exact zeros (their P is masked to 0), so
    # the descriptor may add them to the neighbouring rows; TMA clips past the buffer's end.
    if DQ_TMA:
        dq_desc.atomic_add([(row0 + start).to(tl.int32), 0], dq)
    else:
        ptrs = DQA + (row0 + offs_m)[:, None] * BLOCK_D + offs_d[None, :]
        if MASKED:
            tl.atomic_add(ptrs, dq, mask=offs_m[:, None] < seq_q, sem="relaxed")
        else:
            tl.atomic_add(ptrs, dq, sem="relaxed")


@triton.jit
def _delta_rows(Dh, Oh, stride_om, do, offs_m, seq_q, offs_d, HEAD_DIM: tl.constexpr,
                MASKED: tl.constexpr, PAD_D: tl.constexpr, DELTA_INLINE: tl.constexpr):
    # delta = rowsum(dO * O) of rows offs_m (zero past the sequence): read from the
    # preprocess's buffer, or with DELTA_INLINE computed here from the O rows, as the
    # preprocess computes it (``do`` holds these rows of dO, zeros past the sequence).
    if DELTA_INLINE:
        o = _load_rows(Oh + offs_m[:, None] * stride_om, offs_m, seq_q, offs_d, HEAD_DIM,
                       MASKED, PAD_D)
        return tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    else:
        if MASKED:
            return tl.load(Dh + offs_m, mask=offs_m < seq_q, other=0.0)
        else:
            return tl.load(Dh + offs_m)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Qh, DOh, Oh, LSEh, Dh, DQA, dq_desc, dq_row0, stride_qm,
                stride_dom, stride_om, offs_n, offs_d, start_m, end_m, seq_q, seq_k, offset,
                left, right, qk_scale, cap_scale, cap_log2,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                PAD_D: tl.constexpr, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr,
                MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr, DELTA_INLINE: tl.constexpr):
    # Works in the transposed orientation: rows are this program's keys, columns queries.
    for start in tl.range(start_m, end_m, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        q = _load_rows(Qh + offs_m[:, None] * stride_qm, offs_m, seq_q, offs_d,
                       HEAD_DIM, MASKED, PAD_D)
        if MASKED:
            lse = tl.load(LSEh + offs_m, mask=offs_m < seq_q, other=float("inf"))
        else:
            lse = tl.load(LSEh + offs_m)
        qk_t = tl.dot(k, tl.trans(q))
        if SOFTCAP:
            t_t = _tanh(qk_t * cap_scale)
            s_t = t_t * cap_log2
        else:
            s_t = qk_t * qk_scale
        p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)  # LSE is natural log; 1/ln(2)
        if MASKED:
            # Swapped roles: key j sees query i iff j - offset - right <= i <= j - offset + left.
            vis = _visible(offs_n, offs_m, seq_k, seq_q, -offset, right, left,
                           MASK_RIGHT, MASK_LEFT)
            p_t = tl.where(vis, p_t, 0.0)
        do = _load_rows(DOh + offs_m[:, None] * stride_dom, offs_m, seq_q, offs_d,
                        HEAD_DIM, MASKED, PAD_D)
        dv += tl.dot(p_t.to(do.dtype), do)
        delta = _delta_rows(Dh, Oh, stride_om, do, offs_m, seq_q, offs_d, HEAD_DIM, MASKED,
                            PAD_D, DELTA_INLINE)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)  # d/dx tanh = 1 - tanh^2
        ds_t = ds_t.to(q.dtype)
        dk += tl.dot(ds_t, q)
        if DQ_ATOMIC:  # the fifth product: dQ = dS.K, unscaled (the finishing kernel scales)
            _dq_atomic_add(DQA, dq_desc, dq_row0, start, offs_m, offs_d,
                           tl.dot(tl.trans(ds_t), k), seq_q, BLOCK_D, MASKED, DQ_TMA)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQA, dq_desc, CU_Q, CU_K, O,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_ob, stride_oh, stride_om, stride_od,
    heads_kv, seq_q, seq_k, left, right, tiles_k,
    sm_scale, qk_scale, cap_scale, cap_log2,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr,
    DELTA_INLINE: tl.constexpr,
):
    # Grid: (tiles_k key tiles x heads_kv, batch); one program holds one key tile of one K/V
    # head: dK and dV (and, with DQ_ATOMIC, dQ contributions). Program ids past
    # tiles_k * heads_kv belong to the dQ kernel (one launch, see below). With
    # DELTA_INLINE, the delta rows come from O and dO (Delta unused), else from Delta.
    tl.static_assert(BLOCK_M >= 16)  # tl.dot needs every dimension >= 16
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_n = tl.program_id(0) % tiles_k
    off_hk = (tl.program_id(0) // tiles_k).to(tl.int64)
    off_b = tl.program_id(1).to(tl.int64)
    rows_q = seq_q
    q_start, k_start, seq_q, seq_k = _seq_bounds(CU_Q, CU_K, off_b, seq_q, seq_k, IS_VARLEN)
    # A packed batch's grid fits its longest sequence: tiles past this one's end do nothing.
    if pid_n * BLOCK_N < seq_k:
        offset = seq_k - seq_q
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        K = K + k_start * stride_kn
        V = V + k_start * stride_vn
        DK = DK + k_start * stride_dkn
        DV = DV + k_start * stride_dvn
        k = _load_rows(K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_kn
                       + offs_d[None, :] * stride_kd, offs_n, seq_k, offs_d, HEAD_DIM, True,
                       PAD_D)
        v = _load_rows(V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vn
                       + offs_d[None, :] * stride_vd, offs_n, seq_k, offs_d, HEAD_DIM, True,
                       PAD_D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

        # Query tiles that can see this key tile (roles swapped: offset -> -offset,
        # left <-> right).
        lo, full_lo, full_hi, hi = _inner_range(pid_n * BLOCK_N, seq_q, -offset, right, left,
                                                BLOCK_N, BLOCK_M, MASK_RIGHT, MASK_LEFT)
        heads_q = heads_kv * GQA
        # Sum over the GQA group in a fixed order: dK and dV are deterministic, no atomics.
        for g in range(GQA):
            off_h = off_hk * GQA + g
            Qh = Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm \
                + offs_d[None, :] * stride_qd
            DOh = DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_dom \
                + offs_d[None, :] * stride_dod
            Oh = O + off_b * stride_ob + off_h * stride_oh + q_start * stride_om \
                + offs_d[None, :] * stride_od
            row = _lse_row(off_b, off_h, heads_q, rows_q, q_start, IS_VARLEN)
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, Oh, LSE + row, Delta + row, DQA,
                                 dq_desc, row, stride_qm, stride_dom, stride_om, offs_n,
                                 offs_d, lo, full_lo, seq_q, seq_k, offset, left, right,
                                 qk_scale, cap_scale, cap_log2, BLOCK_M, HEAD_DIM, BLOCK_D,
                                 PAD_D, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, DQ_ATOMIC, DQ_TMA,
                                 DELTA_INLINE)
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, Oh, LSE + row, Delta + row, DQA,
                                 dq_desc, row, stride_qm, stride_dom, stride_om, offs_n,
                                 offs_d, full_lo, full_hi, seq_q, seq_k, offset, left, right,
                                 qk_scale, cap_scale, cap_log2, BLOCK_M, HEAD_DIM, BLOCK_D,
                                 PAD_D, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, DQ_ATOMIC, DQ_TMA,
                                 DELTA_INLINE)
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, Oh, LSE + row, Delta + row, DQA,
                                 dq_desc, row, stride_qm, stride_dom, stride_om, offs_n,
                                 offs_d, full_hi, hi, seq_q, seq_k, offset, left, right,
                                 qk_scale, cap_scale, cap_log2, BLOCK_M, HEAD_DIM, BLOCK_D,
                                 PAD_D, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, DQ_ATOMIC, DQ_TMA,
                                 DELTA_INLINE)

        dk = dk * sm_scale  # S = scale * QK^T, so dK picks up the scale once
        row_ok = offs_n[:, None] < seq_k
        if PAD_D:
            row_ok = row_ok & (offs_d[None, :] < HEAD_DIM)
        tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + offs_n[:, None] * stride_dkn
                 + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=row_ok)
        tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + offs_n[:, None] * stride_dvn
                 + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=row_ok)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, Kh, Vh, stride_kn, stride_vn, offs_m, offs_d,
              start_n, end_n, seq_q, seq_k, offset, left, right,
              qk_scale, cap_scale, cap_log2,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
              MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
              SOFTCAP: tl.constexpr):
    for start in tl.range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_rows(Kh + offs_n[:, None] * stride_kn, offs_n, seq_k, offs_d,
                       HEAD_DIM, MASKED, PAD_D)
        v = _load_rows(Vh + offs_n[:, None] * stride_vn, offs_n, seq_k, offs_d,
                       HEAD_DIM, MASKED, PAD_D)
        qk = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            t = _tanh(qk * cap_scale)
            s = t * cap_log2
        else:
            s = qk * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            vis = _visible(offs_m, offs_n, seq_q, seq_k, offset, left, right,
                           MASK_LEFT, MASK_RIGHT)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)  # d/dx tanh = 1 - tanh^2
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ, CU_Q, CU_K, O,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_ob, stride_oh, stride_om, stride_od,
    heads_q, seq_q, seq_k, left, right, tiles_q, first_pid,
    sm_scale, qk_scale, cap_scale, cap_log2,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, DELTA_INLINE: tl.constexpr,
):
    # Grid: (first_pid + tiles_q query tiles x heads_q, batch); one program holds one query
    # tile of one query head: dQ, recomputing P and dP over the visible keys.
    tl.static_assert(BLOCK_N >= 16)  # tl.dot needs every dimension >= 16
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid = tl.program_id(0) - first_pid
    pid_m = pid % tiles_q
    off_h = (pid // tiles_q).to(tl.int64)
    off_b = tl.program_id(1).to(tl.int64)
    off_hk = off_h // GQA
    rows_q = seq_q
    q_start, k_start, seq_q, seq_k = _seq_bounds(CU_Q, CU_K, off_b, seq_q, seq_k, IS_VARLEN)
    row = _lse_row(off_b, off_h, heads_q, rows_q, q_start, IS_VARLEN)
    # A packed batch's grid fits its longest sequence: tiles past this one's end do nothing.
    if pid_m * BLOCK_M < seq_q:
        offset = seq_k - seq_q
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        Q = Q + q_start * stride_qm
        DO = DO + q_start * stride_dom
        DQ = DQ + q_start * stride_dqm
        O = O + q_start * stride_om
        K = K + k_start * stride_kn
        V = V + k_start * stride_vn
        q = _load_rows(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm
                       + offs_d[None, :] * stride_qd, offs_m, seq_q, offs_d, HEAD_DIM, True,
                       PAD_D)
        do = _load_rows(DO + off_b * stride_dob + off_h * stride_doh
                        + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, offs_m,
                        seq_q, offs_d, HEAD_DIM, True, PAD_D)
        lse2 = tl.load(LSE + row + offs_m, mask=offs_m < seq_q, other=float("inf")) \
            * 1.4426950408889634  # natural-log LSE -> log2 domain (1/ln(2))
        delta = _delta_rows(Delta + row, O + off_b * stride_ob + off_h * stride_oh
                            + offs_d[None, :] * stride_od, stride_om, do, offs_m, seq_q,
                            offs_d, HEAD_DIM, True, PAD_D, DELTA_INLINE)
        Kh = K + off_b * stride_kb + off_hk * stride_kh + offs_d[None, :] * stride_kd
        Vh = V + off_b * stride_vb + off_hk * stride_vh + offs_d[None, :] * stride_vd
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        lo, full_lo, full_hi, hi = _inner_range(pid_m * BLOCK_M, seq_k, offset, left, right,
                                                BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
        dq = _dq_inner(dq, q, do, lse2, delta, Kh, Vh, stride_kn, stride_vn, offs_m, offs_d,
                       lo, full_lo, seq_q, seq_k, offset, left, right, qk_scale, cap_scale,
                       cap_log2, BLOCK_N, HEAD_DIM, PAD_D, True, MASK_LEFT, MASK_RIGHT,
                       SOFTCAP)
        dq = _dq_inner(dq, q, do, lse2, delta, Kh, Vh, stride_kn, stride_vn, offs_m, offs_d,
                       full_lo, full_hi, seq_q, seq_k, offset, left, right, qk_scale, cap_scale,
                       cap_log2, BLOCK_N, HEAD_DIM, PAD_D, False, MASK_LEFT, MASK_RIGHT,
                       SOFTCAP)
        dq = _dq_inner(dq, q, do, lse2, delta, Kh, Vh, stride_kn, stride_vn, offs_m, offs_d,
                       full_hi, hi, seq_q, seq_k, offset, left, right, qk_scale, cap_scale,
                       cap_log2, BLOCK_N, HEAD_DIM, PAD_D, True, MASK_LEFT, MASK_RIGHT,
                       SOFTCAP)

        dq = dq * sm_scale
        mask = offs_m[:, None] < seq_q
        if PAD_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm
                 + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty), mask=mask)


@triton.jit
def _attn_bwd_one_launch_kernel(
    Q, K, V, DO, LSE, Delta, DQ, DK, DV, CU_Q, CU_K, O,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_ob, stride_oh, stride_om, stride_od,
    heads_kv, seq_q, seq_k, left, right, tiles_k, tiles_q,
    sm_scale, qk_scale, cap_scale, cap_log2,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, DELTA_INLINE: tl.constexpr,
):
    # Grid: (tiles_k * heads_kv dK/dV programs, then tiles_q * heads_q dQ programs; batch).
    # The dK/dV programs, the longer ones, come first so they start first. Each program
    # writes only its own tiles: deterministic, as the two-kernel backward. With
    # DELTA_INLINE (the fused variant) no preprocess ran: every program computes the delta
    # rows it reads from O and dO.
    n_dkdv = tiles_k * heads_kv
    if tl.program_id(0) < n_dkdv:
        _attn_bwd_dkdv_kernel(
            Q, K, V, DO, LSE, Delta, DK, DV, DQ, DQ, CU_Q, CU_K, O,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
            stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh,
            stride_dom, stride_dod, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
            stride_dvb, stride_dvh, stride_dvn, stride_dvd,
            stride_ob, stride_oh, stride_om, stride_od,
            heads_kv, seq_q, seq_k, left, right, tiles_k,
            sm_scale, qk_scale, cap_scale, cap_log2,
            GQA, HEAD_DIM, BLOCK_D, BLOCK_M1, BLOCK_N1, MASK_LEFT, MASK_RIGHT, SOFTCAP,
            IS_VARLEN, False, False, DELTA_INLINE)
    else:
        _attn_bwd_dq_kernel(
            Q, K, V, DO, LSE, Delta, DQ, CU_Q, CU_K, O,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
            stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh,
            stride_dom, stride_dod, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
            stride_ob, stride_oh, stride_om, stride_od,
            heads_kv * GQA, seq_q, seq_k, left, right, tiles_q, n_dkdv,
            sm_scale, qk_scale, cap_scale, cap_log2,
            GQA, HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, MASK_LEFT, MASK_RIGHT, SOFTCAP,
            IS_VARLEN, DELTA_INLINE)


BwdStep = tuple[str, Callable[[], Any]]
BWD_PARTS = ("pre", "dkdv", "dq")
# The launch of the one-launch variant: its time depends on the dK/dV and dQ fields at once,
# so the tuner cannot recombine it part by part.
ONE_LAUNCH_PART = "dkdv+dq"
# The Hopper backward's launches, timed as one step for the same reason.
HOPPER_PART = "hopper"


# One launch of a portable backward: (kernel, grid, arguments, constexprs and launch
# options, how many leading arguments are per-call pointers). The per-call slots hold None.
LaunchSpec = tuple[Any, tuple[int, int], list[Any], dict[str, Any], int]


def _portable_specs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    do: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
                    causal: bool, sm_scale: float, window: tuple[int, int], softcap: float,
                    c: BwdConfig, packed: Packed | None) -> dict[str, LaunchSpec]:
    """The launches of the portable variant ``c.variant``, in order, by step: ``pre`` (the
    delta preprocess; atomic dQ: it also zeroes the accumulator), then ``dkdv`` and ``dq``
    (two kernels), ``dkdv`` and ``finish`` (atomic dQ) or ``one`` (one launch; the fused
    variant has no ``pre``). Their per-call pointers, in the kernels' order:

    - pre: O, dO, delta, the fp32 dQ accumulator (delta when there is none);
    - dkdv: q, k, v, dO, LSE, delta, dK, dV, the accumulator, its descriptor, the
      prefix sums (q twice when dense), O;
    - dq: q, k, v, dO, LSE, delta, dQ, the prefix sums, O;
    - finish: the accumulator, dQ;
    - one: q, k, v, dO, LSE, delta, dQ, dK, dV, the prefix sums, O.

    Strides are read from the tensors given (dq, dk, dv: the gradients' layouts)."""
    atomic = c.variant == BWD_ATOMIC
    fused = c.variant == BWD_FUSED
    b, hq, hk, sq, sk, d = problem_dims(q, k, packed)
    block_d = padded_head_dim(d)
    left, right, mask_left, mask_right = mask_params(causal, window)
    qk_scale, cap_scale, cap_log2 = score_scales(sm_scale, softcap)
    common = dict(GQA=hq // hk, HEAD_DIM=d, BLOCK_D=block_d, MASK_LEFT=mask_left,
                  MASK_RIGHT=mask_right, SOFTCAP=softcap > 0.0, IS_VARLEN=packed is not None)
    # Tiles per sequence: the longest sequence's when packed.
    tiles_q, tiles_k = (sq, sk) if packed is None else (max(packed.max_q, 1), max(packed.max_k, 1))
    n_k, n_q = triton.cdiv(tiles_k, c.dkdv_block_n), triton.cdiv(tiles_q, c.dq_block_m)
    # Rows of the delta buffer (and of the atomic variant's fp32 dQ accumulator): a packed
    # batch is one "batch entry" of total_q rows.
    row_grid = hq * (b if packed is None else 1)
    scalars = [sm_scale, qk_scale, cap_scale, cap_log2]

    def st(*ts: torch.Tensor) -> list[int]:
        return [s for t in ts for s in kernel_strides(t, packed)]

    out: dict[str, LaunchSpec] = {}
    if not fused:
        out["pre"] = (_attn_bwd_preprocess, (triton.cdiv(sq, c.pre_block_m), row_grid),
                      [None] * 4 + [*st(o, do), hq, sq],
                      dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=c.pre_block_m, ZERO_DQ=atomic),
                      4)
    if c.variant in BWD_ONE_GRID:
        out["one"] = (_attn_bwd_one_launch_kernel, (n_k * hk + n_q * hq, b),
                      [None] * 12 + [*st(q, k, v, do, dq, dk, dv, o), hk, sq, sk, left, right,
                                     n_k, n_q, *scalars],
                      dict(BLOCK_M1=c.dkdv_block_m, BLOCK_N1=c.dkdv_block_n,
                           BLOCK_M2=c.dq_block_m, BLOCK_N2=c.dq_block_n, DELTA_INLINE=fused,
                           **common, **launch_options(c.dkdv_warps, c.dkdv_stages, c.maxnreg)),
                      12)
        return out
    out["dkdv"] = (_attn_bwd_dkdv_kernel, (n_k * hk, b),
                   [None] * 13 + [*st(q, k, v, do, dk, dv, o), hk, sq, sk, left, right, n_k,
                                  *scalars],
                   dict(BLOCK_M=c.dkdv_block_m, BLOCK_N=c.dkdv_block_n, DQ_ATOMIC=atomic,
                        DQ_TMA=bool(atomic and c.dkdv_atomic_tma), DELTA_INLINE=False, **common,
                        **launch_options(c.dkdv_warps, c.dkdv_stages, c.maxnreg)),
                   13)
    if atomic:
        out["finish"] = (_attn_bwd_dq_finish, (triton.cdiv(sq, c.dq_block_m), row_grid),
                         [None] * 2 + [*st(dq), hq, sq, sm_scale],
                         dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=c.dq_block_m,
                              **launch_options(c.dq_warps, 1, c.maxnreg)),
                         2)
    else:
        out["dq"] = (_attn_bwd_dq_kernel, (n_q * hq, b),
                     [None] * 10 + [*st(q, k, v, do, dq, o), hq, sq, sk, left, right, n_q, 0,
                                    *scalars],
                     dict(BLOCK_M=c.dq_block_m, BLOCK_N=c.dq_block_n, DELTA_INLINE=False,
                          **common, **launch_options(c.dq_warps, c.dq_stages, c.maxnreg)),
                     10)
    return out


def _pointers(step: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, dqa: Any, dq_desc: Any,
              dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
              cu: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, ...]:
    """The per-call pointers of ``step`` (see :func:`_portable_specs`)."""
    if step == "pre":
        return (o, do, delta, dqa)
    if step == "dkdv":
        return (q, k, v, do, lse, delta, dk, dv, dqa, dq_desc, *cu, o)
    if step == "dq":
        return (q, k, v, do, lse, delta, dq, *cu, o)
    if step == "finish":
        return (dqa, dq)
    return (q, k, v, do, lse, delta, dq, dk, dv, *cu, o)


# The tuner's name of each step (BWD_PARTS: the parts it can recombine).
_STEP_PART = {"pre": "pre", "dkdv": "dkdv", "dq": "dq", "finish": "dq", "one": ONE_LAUNCH_PART}


def bwd_steps(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              o: torch.Tensor, lse: torch.Tensor, *, causal: bool, sm_scale: float,
              window: tuple[int, int], softcap: float, config: BwdConfig,
              packed: Packed | None = None, deterministic: bool = True,
              ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[BwdStep]]:
    """The backward's launches, in order, and the (dq, dk, dv) buffers they fill. By
    ``config.variant``: two kernels, ``[("pre", f), ("dkdv", f), ("dq", f)]``; atomic dQ,
    the same three names (the preprocess also zeroes the fp32 dQ accumulator, the dK/dV
    kernel adds to it, "dq" scales and casts it); one launch, ``[("pre", f), ("dkdv+dq",
    f)]``; fused, ``[("dkdv+dq", f)]`` alone. Each of "pre", "dkdv" and "dq" depends only on
    the config fields of its own part (``BwdConfig`` field metadata), so the tuner can time
    the parts separately and recombine the best of each. ``packed``: a varlen batch, as for
    :func:`flashtune.kernels.attn_fwd.attn_fwd`. ``deterministic=True`` refuses the atomic
    variant (its dQ summation order is not fixed). Each step launches through
    ``kernel[grid]`` (the per-signature path is :class:`BwdLaunch`)."""
    c = config
    if c.variant == BWD_HOPPER:
        reason = "packed (varlen) batches" if packed is not None else ""
        if not reason:
            from flashtune.kernels import attn_bwd_hopper as hopper
            from flashtune.kernels.attn_fwd_hopper import tma_describable

            reason = tma_describable(q, k, v, do)
            if not reason:
                grads, launch = hopper.hopper_bwd_launch(
                    do, q, k, v, o, lse, sm_scale=sm_scale, mask=mask_params(causal, window),
                    scales=score_scales(sm_scale, softcap), softcap=softcap, config=c,
                    deterministic=deterministic)
                return grads, [(HOPPER_PART, launch)]
        # What the Hopper kernel cannot take, the portable kernels' default serves.
        warn_portable_once("backward", reason)
        c = default_bwd(call_problem(q, k, causal, window, softcap, packed, deterministic),
                        BWD_TWO_KERNEL)
    _check_portable(c, deterministic)
    atomic = c.variant == BWD_ATOMIC
    b, hq, _, sq, _, _ = problem_dims(q, k, packed)
    delta = torch.empty_like(lse, memory_format=torch.contiguous_format)
    lse = lse.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cu = (q, q) if packed is None else (packed.cu_q, packed.cu_k)
    # Atomic dQ: an fp32 accumulator with delta's rows, BLOCK_D wide (zeroed by "pre").
    row_grid = hq * (b if packed is None else 1)
    dqa = q.new_empty((row_grid * sq, padded_head_dim(q.shape[-1])), dtype=torch.float32) \
        if atomic else delta
    dq_desc: Any = dqa
    if atomic and c.dkdv_atomic_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        dq_desc = TensorDescriptor(dqa, list(dqa.shape), list(dqa.stride()),
                                   [c.dkdv_block_m, dqa.shape[1]])
    specs = _portable_specs(q, k, v, o, do, dq, dk, dv, causal=causal, sm_scale=sm_scale,
                            window=window, softcap=softcap, c=c, packed=packed)

    def step(spec: LaunchSpec, ptrs: tuple[Any, ...]) -> Callable[[], Any]:
        kernel, grid, args, kwargs, n = spec
        return lambda: kernel[grid](*ptrs, *args[n:], **kwargs)

    return (dq, dk, dv), [
        (_STEP_PART[name], step(spec, _pointers(name, q, k, v, o, do, lse, delta, dqa, dq_desc,
                                                dq, dk, dv, cu)))
        for name, spec in specs.items()]


def _check_portable(c: BwdConfig, deterministic: bool) -> None:
    if c.variant not in (BWD_TWO_KERNEL, BWD_ATOMIC, *BWD_ONE_GRID):
        raise InfeasibleConfigError(f"BwdConfig.variant={c.variant} "
                                    f"({BWD_VARIANT_NAMES.get(c.variant, 'unknown')}) has no "
                                    f"kernel here (allowed: {sorted(BWD_VARIANT_NAMES)})")
    if c.variant == BWD_ATOMIC and deterministic:
        raise InfeasibleConfigError("BwdConfig.variant=1 (atomic dQ) gives no fixed dQ "
                                    "summation order: it needs deterministic=False")


class BwdLaunch:
    """The backward for one call signature (shapes and strides of q, k, v, o and dO, dtype,
    device, flags, config), prepared once. The deterministic portable variants (two
    kernels, one launch, fused) are prepared down to their bound kernels: grids, scalars
    and constexprs fixed, launched through the compiled kernels; the Hopper variant as a
    :class:`~flashtune.kernels.attn_bwd_hopper.HopperBwdLaunch`, bound the same way. The
    atomic variant, and the Hopper variant where TMA cannot describe the tensors (the
    portable default serves), prepare their launches per call through :func:`bwd_steps`.
    Built from tensors whose data are 16-byte aligned, it serves every call of that
    signature whose data are too. ``packed``: a varlen batch, as for
    :func:`flashtune.kernels.attn_fwd.attn_fwd`."""

    def __init__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, *, causal: bool, sm_scale: float, window: tuple[int, int],
                 softcap: float, config: BwdConfig, packed: Packed | None = None,
                 deterministic: bool = True) -> None:
        self.config = config
        self.options = dict(causal=causal, sm_scale=sm_scale, window=window, softcap=softcap,
                            config=config, deterministic=deterministic)
        self.maxlen = None if packed is None else (packed.max_q, packed.max_k)
        self.bound = config.variant in (BWD_TWO_KERNEL, *BWD_ONE_GRID)
        self.fused = config.variant == BWD_FUSED
        self.launches: list[tuple[str, BoundLaunch]] = []
        self.hopper: Any = None
        if config.variant == BWD_HOPPER and packed is None:
            from flashtune.kernels import attn_bwd_hopper as hopper
            from flashtune.kernels.attn_fwd_hopper import tma_describable

            if not tma_describable(q, k, v, do):  # else bwd_steps serves the portable default
                self.hopper = hopper.prepare_hopper_bwd(
                    do, q, k, v, o, sm_scale=sm_scale, mask=mask_params(causal, window),
                    scales=score_scales(sm_scale, softcap), softcap=softcap, config=config,
                    deterministic=deterministic)
        if not self.bound:
            return
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # layouts
        specs = _portable_specs(q, k, v, o, do, *grads, causal=causal, sm_scale=sm_scale,
                                window=window, softcap=softcap, c=config, packed=packed)
        self.launches = [(name, BoundLaunch(kernel, grid, args, kwargs, n))
                         for name, (kernel, grid, args, kwargs, n) in specs.items()]

    def steps(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              o: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor | None = None,
              cu_k: torch.Tensor | None = None,
              ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[BwdStep]]:
        """The (dq, dk, dv) buffers and the launches that fill them, in order."""
        if self.hopper is not None:
            bufs = self.hopper.buffers(q, k, v, lse)
            hopper = self.hopper
            return (bufs[0], bufs[1], bufs[2]), [
                (HOPPER_PART, lambda: hopper.run(do, q, k, v, o, bufs))]
        if not self.bound:
            packed = None if cu_q is None or self.maxlen is None \
                else Packed(cu_q, cu_k, *self.maxlen)
            return bwd_steps(do, q, k, v, o, lse, packed=packed, **self.options)
        lse, delta, dq, dk, dv, cu = self._buffers(q, k, v, lse, cu_q, cu_k)

        def step(launch: BoundLaunch, ptrs: tuple[Any, ...]) -> Callable[[], None]:
            return lambda: launch(*ptrs)

        return (dq, dk, dv), [
            (_STEP_PART[name], step(launch, _pointers(name, q, k, v, o, do, lse, delta, delta,
                                                      delta, dq, dk, dv, cu)))
            for name, launch in self.launches]

    def __call__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor | None = None,
                 cu_k: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Launch the backward (as :meth:`steps`, without the closures); (dq, dk, dv)."""
        if self.hopper is not None:
            return self.hopper(do, q, k, v, o, lse)
        if not self.bound:
            grads, steps = self.steps(do, q, k, v, o, lse, cu_q, cu_k)
            for _, launch in steps:
                launch()
            return grads
        lse, delta, dq, dk, dv, cu = self._buffers(q, k, v, lse, cu_q, cu_k)
        for name, launch in self.launches:
            launch(*_pointers(name, q, k, v, o, do, lse, delta, delta, delta, dq, dk, dv, cu))
        return dq, dk, dv

    def _buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                 cu_q: torch.Tensor | None, cu_k: torch.Tensor | None) -> tuple[Any, ...]:
        """(lse contiguous, delta, dq, dk, dv, the prefix sums or q twice). The fused
        variant computes delta in its programs: the LSE stands in for the unused buffer."""
        lse = lse.contiguous()
        delta = lse if self.fused else torch.empty_like(lse)
        return (lse, delta, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                (q, q) if cu_q is None else (cu_q, cu_k))


def attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             o: torch.Tensor, lse: torch.Tensor, *, causal: bool, sm_scale: float,
             window: tuple[int, int], softcap: float, config: BwdConfig,
             packed: Packed | None = None, deterministic: bool = True,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward of ``config.variant`` (see :func:`bwd_steps`). Returns (dq, dk, dv)
    in the inputs' layouts."""
    grads, steps = bwd_steps(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale,
                             window=window, softcap=softcap, config=config, packed=packed,
                             deterministic=deterministic)
    for _, launch in steps:
        launch()
    return grads
