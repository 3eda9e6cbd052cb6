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
    BWD_HOPPER,
    BWD_ONE_LAUNCH,
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
def _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Dh, DQA, dq_desc, dq_row0, stride_qm, stride_dom,
                offs_n, offs_d, start_m, end_m, seq_q, seq_k, offset, left, right,
                qk_scale, cap_scale, cap_log2,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                PAD_D: tl.constexpr, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr,
                MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr):
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
        if MASKED:
            delta = tl.load(Dh + offs_m, mask=offs_m < seq_q, other=0.0)
        else:
            delta = tl.load(Dh + offs_m)
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
    Q, K, V, DO, LSE, Delta, DK, DV, DQA, dq_desc, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    heads_kv, seq_q, seq_k, left, right, tiles_k,
    sm_scale, qk_scale, cap_scale, cap_log2,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr,
):
    # Grid: (tiles_k key tiles x heads_kv, batch); one program holds one key tile of one K/V
    # head: dK and dV (and, with DQ_ATOMIC, dQ contributions). Program ids past
    # tiles_k * heads_kv belong to the dQ kernel (one launch, see below).
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
            row = _lse_row(off_b, off_h, heads_q, rows_q, q_start, IS_VARLEN)
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSE + row, Delta + row, DQA, dq_desc,
                                 row, stride_qm, stride_dom, offs_n, offs_d, lo, full_lo,
                                 seq_q, seq_k, offset, left, right, qk_scale, cap_scale,
                                 cap_log2, BLOCK_M, HEAD_DIM, BLOCK_D, PAD_D, True, MASK_LEFT,
                                 MASK_RIGHT, SOFTCAP, DQ_ATOMIC, DQ_TMA)
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSE + row, Delta + row, DQA, dq_desc,
                                 row, stride_qm, stride_dom, offs_n, offs_d, full_lo, full_hi,
                                 seq_q, seq_k, offset, left, right, qk_scale, cap_scale,
                                 cap_log2, BLOCK_M, HEAD_DIM, BLOCK_D, PAD_D, False, MASK_LEFT,
                                 MASK_RIGHT, SOFTCAP, DQ_ATOMIC, DQ_TMA)
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSE + row, Delta + row, DQA, dq_desc,
                                 row, stride_qm, stride_dom, offs_n, offs_d, full_hi, hi,
                                 seq_q, seq_k, offset, left, right, qk_scale, cap_scale,
                                 cap_log2, BLOCK_M, HEAD_DIM, BLOCK_D, PAD_D, True, MASK_LEFT,
                                 MASK_RIGHT, SOFTCAP, DQ_ATOMIC, DQ_TMA)

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
    Q, K, V, DO, LSE, Delta, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    heads_q, seq_q, seq_k, left, right, tiles_q, first_pid,
    sm_scale, qk_scale, cap_scale, cap_log2,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr,
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
        delta = tl.load(Delta + row + offs_m, mask=offs_m < seq_q, other=0.0)
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
    Q, K, V, DO, LSE, Delta, DQ, DK, DV, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    heads_kv, seq_q, seq_k, left, right, tiles_k, tiles_q,
    sm_scale, qk_scale, cap_scale, cap_log2,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    # Grid: (tiles_k * heads_kv dK/dV programs, then tiles_q * heads_q dQ programs; batch).
    # The dK/dV programs, the longer ones, come first so they start first. Each program
    # writes only its own tiles: deterministic, as the two-kernel backward.
    n_dkdv = tiles_k * heads_kv
    if tl.program_id(0) < n_dkdv:
        _attn_bwd_dkdv_kernel(
            Q, K, V, DO, LSE, Delta, DK, DV, DQ, DQ, CU_Q, CU_K,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
            stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh,
            stride_dom, stride_dod, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
            stride_dvb, stride_dvh, stride_dvn, stride_dvd,
            heads_kv, seq_q, seq_k, left, right, tiles_k,
            sm_scale, qk_scale, cap_scale, cap_log2,
            GQA, HEAD_DIM, BLOCK_D, BLOCK_M1, BLOCK_N1, MASK_LEFT, MASK_RIGHT, SOFTCAP,
            IS_VARLEN, False, False)
    else:
        _attn_bwd_dq_kernel(
            Q, K, V, DO, LSE, Delta, DQ, CU_Q, CU_K,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
            stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh,
            stride_dom, stride_dod, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
            heads_kv * GQA, seq_q, seq_k, left, right, tiles_q, n_dkdv,
            sm_scale, qk_scale, cap_scale, cap_log2,
            GQA, HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, MASK_LEFT, MASK_RIGHT, SOFTCAP,
            IS_VARLEN)


BwdStep = tuple[str, Callable[[], Any]]
BWD_PARTS = ("pre", "dkdv", "dq")
# The launch of the one-launch variant: its time depends on the dK/dV and dQ fields at once,
# so the tuner cannot recombine it part by part.
ONE_LAUNCH_PART = "dkdv+dq"
# The Hopper backward's launches, timed as one step for the same reason.
HOPPER_PART = "hopper"


def bwd_steps(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              o: torch.Tensor, lse: torch.Tensor, *, causal: bool, sm_scale: float,
              window: tuple[int, int], softcap: float, config: BwdConfig,
              packed: Packed | None = None, deterministic: bool = True,
              ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[BwdStep]]:
    """The backward's launches, in order, and the (dq, dk, dv) buffers they fill. By
    ``config.variant``: two kernels, ``[("pre", f), ("dkdv", f), ("dq", f)]``; atomic dQ,
    the same three names (the preprocess also zeroes the fp32 dQ accumulator, the dK/dV
    kernel adds to it, "dq" scales and casts it); one launch, ``[("pre", f), ("dkdv+dq",
    f)]``. Each of "pre", "dkdv" and "dq" depends only on the config fields of its own part
    (``BwdConfig`` field metadata), so the tuner can time the parts separately and
    recombine the best of each. ``packed``: a varlen batch, as for
    :func:`flashtune.kernels.attn_fwd.attn_fwd`. ``deterministic=True`` refuses the atomic
    variant (its dQ summation order is not fixed)."""
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
    if c.variant not in (BWD_TWO_KERNEL, BWD_ATOMIC, BWD_ONE_LAUNCH):
        raise InfeasibleConfigError(f"BwdConfig.variant={c.variant} "
                                    f"({BWD_VARIANT_NAMES.get(c.variant, 'unknown')}) has no "
                                    f"kernel here (allowed: 0, 1, 2, 3)")
    if c.variant == BWD_ATOMIC and deterministic:
        raise InfeasibleConfigError("BwdConfig.variant=1 (atomic dQ) gives no fixed dQ "
                                    "summation order: it needs deterministic=False")
    atomic = c.variant == BWD_ATOMIC
    b, hq, hk, sq, sk, d = problem_dims(q, k, packed)
    block_d = padded_head_dim(d)
    delta = torch.empty_like(lse, memory_format=torch.contiguous_format)
    lse = lse.contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    left, right, mask_left, mask_right = mask_params(causal, window)
    qk_scale, cap_scale, cap_log2 = score_scales(sm_scale, softcap)
    common = dict(GQA=hq // hk, HEAD_DIM=d, BLOCK_D=block_d, MASK_LEFT=mask_left,
                  MASK_RIGHT=mask_right, SOFTCAP=softcap > 0.0, IS_VARLEN=packed is not None)
    cu = (q, q) if packed is None else (packed.cu_q, packed.cu_k)
    # Tiles per sequence: the longest sequence's when packed.
    tiles_q, tiles_k = (sq, sk) if packed is None else (max(packed.max_q, 1), max(packed.max_k, 1))
    # Rows of the delta buffer (and of the atomic variant's fp32 dQ accumulator): a packed
    # batch is one "batch entry" of total_q rows.
    row_grid = hq * (b if packed is None else 1)
    # Atomic dQ: an fp32 accumulator with delta's rows, BLOCK_D wide (zeroed by "pre").
    dqa = q.new_empty((row_grid * sq, block_d), dtype=torch.float32) if atomic else delta
    dq_desc: Any = dqa
    if atomic and c.dkdv_atomic_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        dq_desc = TensorDescriptor(dqa, list(dqa.shape), list(dqa.stride()),
                                   [c.dkdv_block_m, block_d])

    def st(*ts: torch.Tensor) -> list[int]:
        return [s for t in ts for s in kernel_strides(t, packed)]

    def pre() -> None:
        _attn_bwd_preprocess[(triton.cdiv(sq, c.pre_block_m), row_grid)](
            o, do, delta, dqa, *st(o, do), hq, sq,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=c.pre_block_m, ZERO_DQ=atomic,
        )

    def dkdv() -> None:
        n_k = triton.cdiv(tiles_k, c.dkdv_block_n)
        _attn_bwd_dkdv_kernel[(n_k * hk, b)](
            q, k, v, do, lse, delta, dk, dv, dqa, dq_desc, *cu, *st(q, k, v, do, dk, dv),
            hk, sq, sk, left, right, n_k, sm_scale, qk_scale, cap_scale, cap_log2,
            BLOCK_M=c.dkdv_block_m, BLOCK_N=c.dkdv_block_n, DQ_ATOMIC=atomic,
            DQ_TMA=bool(atomic and c.dkdv_atomic_tma), **common,
            **launch_options(c.dkdv_warps, c.dkdv_stages, c.maxnreg),
        )

    def dq_() -> None:
        n_q = triton.cdiv(tiles_q, c.dq_block_m)
        _attn_bwd_dq_kernel[(n_q * hq, b)](
            q, k, v, do, lse, delta, dq, *cu, *st(q, k, v, do, dq),
            hq, sq, sk, left, right, n_q, 0, sm_scale, qk_scale, cap_scale, cap_log2,
            BLOCK_M=c.dq_block_m, BLOCK_N=c.dq_block_n, **common,
            **launch_options(c.dq_warps, c.dq_stages, c.maxnreg),
        )

    def dq_finish() -> None:
        _attn_bwd_dq_finish[(triton.cdiv(sq, c.dq_block_m), row_grid)](
            dqa, dq, *st(dq), hq, sq, sm_scale,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=c.dq_block_m,
            **launch_options(c.dq_warps, 1, c.maxnreg),
        )

    def one_launch() -> None:
        n_k, n_q = triton.cdiv(tiles_k, c.dkdv_block_n), triton.cdiv(tiles_q, c.dq_block_m)
        _attn_bwd_one_launch_kernel[(n_k * hk + n_q * hq, b)](
            q, k, v, do, lse, delta, dq, dk, dv, *cu, *st(q, k, v, do, dq, dk, dv),
            hk, sq, sk, left, right, n_k, n_q, sm_scale, qk_scale, cap_scale, cap_log2,
            BLOCK_M1=c.dkdv_block_m, BLOCK_N1=c.dkdv_block_n,
            BLOCK_M2=c.dq_block_m, BLOCK_N2=c.dq_block_n, **common,
            **launch_options(c.dkdv_warps, c.dkdv_stages, c.maxnreg),
        )

    if c.variant == BWD_ONE_LAUNCH:
        return (dq, dk, dv), [("pre", pre), (ONE_LAUNCH_PART, one_launch)]
    return (dq, dk, dv), [("pre", pre), ("dkdv", dkdv), ("dq", dq_finish if atomic else dq_)]


class BwdLaunch:
    """The backward for one call signature (shapes and strides of q, k, v, o and dO, dtype,
    device, flags, config), prepared once. The two-kernel backward (variant 0, the default
    for ``deterministic=True``) is prepared down to its three bound kernels: grids, scalars
    and constexprs fixed, launched through the compiled kernels. Other variants prepare
    their launches per call through :func:`bwd_steps`. Built from tensors whose data are
    16-byte aligned, it serves every call of that signature whose data are too.
    ``packed``: a varlen batch, as for :func:`flashtune.kernels.attn_fwd.attn_fwd`."""

    def __init__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, *, causal: bool, sm_scale: float, window: tuple[int, int],
                 softcap: float, config: BwdConfig, packed: Packed | None = None,
                 deterministic: bool = True) -> None:
        self.config = config
        self.options = dict(causal=causal, sm_scale=sm_scale, window=window, softcap=softcap,
                            config=config, deterministic=deterministic)
        self.maxlen = None if packed is None else (packed.max_q, packed.max_k)
        self.bound = config.variant == BWD_TWO_KERNEL
        if not self.bound:
            return
        b, hq, hk, sq, sk, d = problem_dims(q, k, packed)
        c = config
        block_d = padded_head_dim(d)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # layouts
        left, right, mask_left, mask_right = mask_params(causal, window)
        qk_scale, cap_scale, cap_log2 = score_scales(sm_scale, softcap)
        common = dict(GQA=hq // hk, HEAD_DIM=d, BLOCK_D=block_d, MASK_LEFT=mask_left,
                      MASK_RIGHT=mask_right, SOFTCAP=softcap > 0.0,
                      IS_VARLEN=packed is not None)
        # Tiles per sequence: the longest sequence's when packed.
        tiles_q, tiles_k = (sq, sk) if packed is None \
            else (max(packed.max_q, 1), max(packed.max_k, 1))
        n_k, n_q = triton.cdiv(tiles_k, c.dkdv_block_n), triton.cdiv(tiles_q, c.dq_block_m)

        def st(*ts: torch.Tensor) -> list[int]:
            return [s for t in ts for s in kernel_strides(t, packed)]

        # delta has the LSE's rows: a packed batch is one "batch entry" of total_q rows.
        # Leading None slots (the tensors) change from call to call; the rest is fixed.
        self.pre = BoundLaunch(
            _attn_bwd_preprocess, (triton.cdiv(sq, c.pre_block_m),
                                   hq * (b if packed is None else 1)),
            [None] * 4 + [*st(o, do), hq, sq],
            dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=c.pre_block_m, ZERO_DQ=False), 4)
        self.dkdv = BoundLaunch(
            _attn_bwd_dkdv_kernel, (n_k * hk, b),
            [None] * 12 + [*st(q, k, v, do, dk, dv), hk, sq, sk, left, right, n_k, sm_scale,
                           qk_scale, cap_scale, cap_log2],
            dict(BLOCK_M=c.dkdv_block_m, BLOCK_N=c.dkdv_block_n, DQ_ATOMIC=False,
                 DQ_TMA=False, **common,
                 **launch_options(c.dkdv_warps, c.dkdv_stages, c.maxnreg)), 12)
        self.dq = BoundLaunch(
            _attn_bwd_dq_kernel, (n_q * hq, b),
            [None] * 9 + [*st(q, k, v, do, dq), hq, sq, sk, left, right, n_q, 0, sm_scale,
                          qk_scale, cap_scale, cap_log2],
            dict(BLOCK_M=c.dq_block_m, BLOCK_N=c.dq_block_n, **common,
                 **launch_options(c.dq_warps, c.dq_stages, c.maxnreg)), 9)

    def steps(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              o: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor | None = None,
              cu_k: torch.Tensor | None = None,
              ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[BwdStep]]:
        """The (dq, dk, dv) buffers and the launches that fill them, in order."""
        if not self.bound:
            packed = None if cu_q is None or self.maxlen is None \
                else Packed(cu_q, cu_k, *self.maxlen)
            return bwd_steps(do, q, k, v, o, lse, packed=packed, **self.options)
        lse, delta, dq, dk, dv, cu = self._buffers(q, k, v, lse, cu_q, cu_k)
        return (dq, dk, dv), [
            ("pre", lambda: self.pre(o, do, delta, delta)),
            ("dkdv", lambda: self.dkdv(q, k, v, do, lse, delta, dk, dv, delta, delta, *cu)),
            ("dq", lambda: self.dq(q, k, v, do, lse, delta, dq, *cu)),
        ]

    def __call__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor | None = None,
                 cu_k: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Launch the backward (as :meth:`steps`, without the closures); (dq, dk, dv)."""
        if not self.bound:
            grads, steps = self.steps(do, q, k, v, o, lse, cu_q, cu_k)
            for _, launch in steps:
                launch()
            return grads
        lse, delta, dq, dk, dv, cu = self._buffers(q, k, v, lse, cu_q, cu_k)
        self.pre(o, do, delta, delta)
        self.dkdv(q, k, v, do, lse, delta, dk, dv, delta, delta, *cu)
        self.dq(q, k, v, do, lse, delta, dq, *cu)
        return dq, dk, dv

    @staticmethod
    def _buffers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                 cu_q: torch.Tensor | None, cu_k: torch.Tensor | None) -> tuple[Any, ...]:
        """(lse contiguous, delta, dq, dk, dv, the prefix sums or q twice)."""
        delta = torch.empty_like(lse, memory_format=torch.contiguous_format)
        return (lse.contiguous(), delta, torch.empty_like(q), torch.empty_like(k),
                torch.empty_like(v), (q, q) if cu_q is None else (cu_q, cu_k))


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
