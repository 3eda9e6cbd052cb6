"""FlashAttention-2 forward: Triton kernel and host launcher.

One program owns a BLOCK_M tile of query rows for one (batch, query head) and
streams the visible K/V tiles through on-chip online-softmax state (running max
``m``, running sum ``l``, fp32 accumulator). Scores live in the log2 domain so the
exponentials are ``exp2``. The key loop is split into masked edge runs and an
unmasked middle run (see ``_masking``). It writes O and the natural-log LSE.

Packed (varlen) batches use the same kernel with ``IS_VARLEN``: q is (total_q, Hq, D),
k and v (total_k, Hkv, D), and each program reads its sequence's start and length from
the int32 prefix sums ``cu_seqlens_q`` / ``cu_seqlens_k`` (no padding, no host sync).
The grid covers ``max_seqlen_q`` tiles per sequence; programs past their sequence's
end exit at once. The LSE of a packed batch is (Hq, total_q).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from flashtune.kernels._bound import BoundLaunch, descriptor_like, template
from flashtune.kernels._masking import _inner_range, _tanh, _visible
from flashtune.kernels.config import HOPPER, FwdConfig, default_portable_fwd, padded_head_dim
from flashtune.problem import Problem

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) == exp2(x * LOG2E)


@triton.jit
def _scores(q, k, qk_scale, cap_scale, cap_log2, SOFTCAP: tl.constexpr):
    """q @ k^T mapped to log2-domain softmax logits (with optional tanh soft-capping)."""
    qk = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        return _tanh(qk * cap_scale) * cap_log2
    return qk * qk_scale


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr,
               PAD_D: tl.constexpr):
    if CHECK_ROWS:
        if PAD_D:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM),
                           other=0.0)
        return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    if PAD_D:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _load_kv(P, Pd, desc_b, desc_h, start, stride_n, offs_n, seq_k, offs_d,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
             MASKED: tl.constexpr, PAD_D: tl.constexpr, USE_TMA: tl.constexpr):
    if USE_TMA:
        # Bulk tensor copy: rows past seq_k come back as zeros (the descriptor's bounds).
        return Pd.load([desc_b, desc_h, start, 0]).reshape(BLOCK_N, BLOCK_D)
    return _load_rows(P + offs_n[:, None] * stride_n, offs_n, seq_k, offs_d,
                      HEAD_DIM, MASKED, PAD_D)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, Kd, Vd, desc_b, desc_h, stride_kn, stride_vn,
               offs_m, offs_d, start_n, end_n, seq_q, seq_k, offset, left, right,
               qk_scale, cap_scale, cap_log2,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
               PAD_D: tl.constexpr, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr,
               MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr):
    # K, V point at key row 0 / column offs_d of this (batch, kv head); Kd, Vd are the
    # (B, H, S, D) tensor descriptors when USE_TMA.
    for start in tl.range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_kv(K, Kd, desc_b, desc_h, start, stride_kn, offs_n, seq_k, offs_d,
                     BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, PAD_D, USE_TMA)
        s = _scores(q, k, qk_scale, cap_scale, cap_log2, SOFTCAP)
        if MASKED:
            vis = _visible(offs_m, offs_n, seq_q, seq_k, offset, left, right,
                           MASK_LEFT, MASK_RIGHT)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet keeps m = -inf; subtract 0 instead (no NaN).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv(V, Vd, desc_b, desc_h, start, stride_vn, offs_n, seq_k, offs_d,
                     BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, PAD_D, USE_TMA)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _seq_bounds(CU_Q, CU_K, off_b, seq_q, seq_k, IS_VARLEN: tl.constexpr):
    """(q_start, k_start, len_q, len_k) of sequence ``off_b``: dense, (0, 0, Sq, Sk); varlen,
    read from the prefix sums."""
    if IS_VARLEN:
        q_start = tl.load(CU_Q + off_b).to(tl.int64)
        k_start = tl.load(CU_K + off_b).to(tl.int64)
        len_q = (tl.load(CU_Q + off_b + 1) - q_start).to(tl.int32)
        len_k = (tl.load(CU_K + off_b + 1) - k_start).to(tl.int32)
        return q_start, k_start, len_q, len_k
    else:
        return 0, 0, seq_q, seq_k


@triton.jit
def _lse_row(off_b, off_h, heads_q, rows_q, q_start, IS_VARLEN: tl.constexpr):
    """Offset of row 0 of (sequence ``off_b``, query head ``off_h``) in the LSE / delta
    buffers: (B, Hq, Sq) when dense, (Hq, total_q) when varlen."""
    if IS_VARLEN:
        return off_h * rows_q + q_start
    else:
        return (off_b * heads_q + off_h) * rows_q


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, Kd, Vd, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    heads_q, seq_q, seq_k, left, right,
    qk_scale, cap_scale, cap_log2,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # Dense: q is (B, Hq, Sq, D) and seq_q / seq_k are Sq / Sk. Varlen: the batch strides
    # are 0, seq_q / seq_k are the packed totals and the sequence comes from CU_Q / CU_K.
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_N >= 16)  # tl.dot needs every dimension >= 16
    tl.static_assert(not (IS_VARLEN and USE_TMA))  # descriptors span whole (B, H, S, D) rows
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    off_hk = off_h // GQA
    rows_q = seq_q
    q_start, k_start, seq_q, seq_k = _seq_bounds(CU_Q, CU_K, off_b, seq_q, seq_k, IS_VARLEN)
    lse_row = _lse_row(off_b, off_h, heads_q, rows_q, q_start, IS_VARLEN)
    if IS_VARLEN:
        if pid_m * BLOCK_M >= seq_q:  # this tile lies past the end of its sequence
            return
    offset = seq_k - seq_q  # bottom-right alignment of the causal / window diagonal

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm \
        + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = _load_rows(q_ptrs, offs_m, seq_q, offs_d, HEAD_DIM, True, PAD_D)
    Kh = K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn \
        + offs_d[None, :] * stride_kd
    Vh = V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn \
        + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _inner_range(pid_m * BLOCK_M, seq_k, offset, left, right,
                                            BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    desc_b = off_b.to(tl.int32)
    desc_h = off_hk.to(tl.int32)
    # Left edge (window), unmasked middle, right edge (diagonal / ragged end of K).
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, Kh, Vh, Kd, Vd, desc_b, desc_h, stride_kn,
                               stride_vn, offs_m, offs_d, lo, full_lo, seq_q, seq_k, offset, left,
                               right, qk_scale, cap_scale, cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM,
                               PAD_D, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, USE_TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, Kh, Vh, Kd, Vd, desc_b, desc_h, stride_kn,
                               stride_vn, offs_m, offs_d, full_lo, full_hi, seq_q, seq_k, offset,
                               left, right, qk_scale, cap_scale, cap_log2, BLOCK_N, BLOCK_D,
                               HEAD_DIM, PAD_D, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, USE_TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, Kh, Vh, Kd, Vd, desc_b, desc_h, stride_kn,
                               stride_vn, offs_m, offs_d, full_hi, hi, seq_q, seq_k, offset, left,
                               right, qk_scale, cap_scale, cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM,
                               PAD_D, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, USE_TMA)

    # Rows that saw no key: output 0 and LSE = +inf (so the backward's P = exp(s - lse) = 0).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)  # ln(2)
    row_ok = offs_m < seq_q
    tl.store(LSE + lse_row + offs_m, lse, mask=row_ok)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + q_start * stride_om \
        + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    if PAD_D:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])


def mask_params(causal: bool, window: tuple[int, int]) -> tuple[int, int, bool, bool]:
    """(left, right, MASK_LEFT, MASK_RIGHT) for the kernels' visibility rule."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return max(left, 0), max(right, 0), left >= 0, right >= 0


def score_scales(sm_scale: float, softcap: float) -> tuple[float, float, float]:
    """(qk_scale, cap_scale, cap_log2): the log2-domain multipliers the kernels take."""
    if softcap > 0.0:
        return 0.0, sm_scale / softcap, softcap * LOG2E
    return sm_scale * LOG2E, 0.0, 0.0


def launch_options(num_warps: int, num_stages: int, maxnreg: int) -> dict[str, int]:
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return opts


class Packed(NamedTuple):
    """A packed (varlen) batch: int32 prefix sums of the query and key lengths (batch + 1
    entries each) and the longest query and key sequence (they size the grid)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1


def kernel_strides(t: torch.Tensor, packed: Packed | None) -> tuple[int, ...]:
    """(batch, head, row, dim) strides: a dense (B, H, S, D) tensor's own, or for a packed
    (total, H, D) tensor batch stride 0 (the kernel adds the sequence start itself)."""
    if packed is None:
        return tuple(t.stride())
    return (0, t.stride(1), t.stride(0), t.stride(2))


def problem_dims(q: torch.Tensor, k: torch.Tensor, packed: Packed | None,
                 ) -> tuple[int, int, int, int, int, int]:
    """(batch, Hq, Hkv, rows_q, rows_k, D) as the kernels take them: rows are Sq / Sk when
    dense, the packed totals when varlen."""
    if packed is None:
        b, hq, sq, d = q.shape
        return b, hq, k.shape[1], sq, k.shape[2], d
    return packed.batch, q.shape[1], k.shape[1], q.shape[0], k.shape[0], q.shape[2]


# A call that returns no LSE (no grad, ``return_lse=False``) still has the kernel write
# one: up to this many rows it goes to a scratch buffer per device, written and never read
# (calls on several streams at once only overwrite each other's garbage), which saves an
# allocation of host time per call. Allocated once outside CUDA-graph capture and never
# freed, so a captured graph may keep writing to it.
SCRATCH_LSE_ROWS = 1 << 16
_scratch_lse: dict[torch.device, torch.Tensor] = {}


def scratch_lse(device: torch.device, rows: int) -> torch.Tensor | None:
    """The device's scratch LSE buffer if it holds ``rows`` fp32 rows, else None (too many
    rows, or a CUDA graph being captured when it does not exist yet)."""
    if rows > SCRATCH_LSE_ROWS:
        return None
    buf = _scratch_lse.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _scratch_lse[device] = torch.empty(SCRATCH_LSE_ROWS, device=device,
                                                 dtype=torch.float32)
    return buf


class FwdLaunch:
    """The forward for one call signature (shapes, strides, dtype, device, flags, config),
    prepared once: the variant and its fallback, the grid, every scalar and constexpr, and
    the bound kernel. Built from tensors whose data are 16-byte aligned, it serves every
    call of that signature whose data are too; calling it allocates O and the LSE and
    launches (see :func:`attn_fwd` for the layouts). Called with ``lse=False``, the
    portable kernel writes its LSE to the scratch buffer (:func:`scratch_lse`) where it
    fits, and the LSE returned is not the call's."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 sm_scale: float, window: tuple[int, int], softcap: float, config: FwdConfig,
                 packed: Packed | None = None) -> None:
        self.config = config  # the config that runs (the portable fallback's, if it came to that)
        self.hopper: Any = None
        self.descriptors: tuple[Any, Any] | None = None
        if config.variant == HOPPER:
            from flashtune.kernels import attn_fwd_hopper as hopper

            reason = hopper.tma_describable(q, k, v)
            if not reason:
                self.hopper = hopper.HopperLaunch(
                    q, k, v, mask=mask_params(causal, window),
                    scales=score_scales(sm_scale, softcap), softcap=softcap, config=config,
                    packed=packed)
                return
            # What the Hopper kernel cannot take, the portable kernel's default serves.
            warn_portable_once("forward", reason)
            config = self.config = default_portable_fwd(
                call_problem(q, k, causal, window, softcap, packed))
        b, hq, hk, sq, sk, d = problem_dims(q, k, packed)
        self.lse_shape = (b, hq, sq) if packed is None else (hq, sq)
        self.scratch = scratch_lse(q.device, b * hq * sq)
        o = torch.empty_like(q)  # its strides (empty_like keeps q's layout), never its data
        left, right, mask_left, mask_right = mask_params(causal, window)
        qk_scale, cap_scale, cap_log2 = score_scales(sm_scale, softcap)
        c = config
        use_tma = bool(c.use_tma) and packed is None and tma_ok(k, v)
        if use_tma:
            kd, vd = kv_descriptors(k, v, c.block_n)
            self.descriptors = (template(kd), template(vd))
        grid = (triton.cdiv(max(sq if packed is None else packed.max_q, 1), c.block_m), b * hq)
        # Slots 0-8 (q, k, v, o, lse, K/V or their descriptors, the prefix sums) change
        # from call to call; the rest is fixed.
        args = [None] * 9 + [
            *kernel_strides(q, packed), *kernel_strides(k, packed), *kernel_strides(v, packed),
            *kernel_strides(o, packed),
            hq, sq, sk, left, right,
            qk_scale, cap_scale, cap_log2]
        kwargs = dict(
            GQA=hq // hk, HEAD_DIM=d, BLOCK_D=padded_head_dim(d),
            BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            MASK_LEFT=mask_left, MASK_RIGHT=mask_right, SOFTCAP=softcap > 0.0, USE_TMA=use_tma,
            IS_VARLEN=packed is not None,
            **launch_options(c.num_warps, c.num_stages, c.maxnreg))
        self.launch = BoundLaunch(_attn_fwd_kernel, grid, args, kwargs, 9)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_q: torch.Tensor | None = None, cu_k: torch.Tensor | None = None,
                 lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hopper is not None:
            return self.hopper(q, k, v, cu_q, cu_k)
        o = torch.empty_like(q)
        out = self.scratch if not lse and self.scratch is not None \
            else torch.empty(self.lse_shape, device=q.device, dtype=torch.float32)
        if self.descriptors is not None:
            td, tv = self.descriptors
            kd, vd = descriptor_like(td, k), descriptor_like(tv, v)
        else:
            kd, vd = k, v
        if cu_q is None:
            cu_q = cu_k = q  # dense: unused pointers
        self.launch(q, k, v, o, out, kd, vd, cu_q, cu_k)
        return o, out


def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
             sm_scale: float, window: tuple[int, int], softcap: float,
             config: FwdConfig, packed: Packed | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Inputs are validated by the caller (``attention.py``).

    Returns ``o`` (q's shape, dtype and memory layout) and ``lse`` ((B, Hq, Sq) fp32, natural
    log). With ``packed``, q is (total_q, Hq, D), k and v (total_k, Hkv, D), and the LSE is
    (Hq, total_q). Prepares the launch for this one call: the hot path keeps a
    :class:`FwdLaunch` per call signature instead (``flashtune.kernels._calls``).
    """
    launch = FwdLaunch(q, k, v, causal=causal, sm_scale=sm_scale, window=window,
                       softcap=softcap, config=config, packed=packed)
    if packed is None:
        return launch(q, k, v)
    return launch(q, k, v, packed.cu_q, packed.cu_k)


def call_problem(q: torch.Tensor, k: torch.Tensor, causal: bool, window: tuple[int, int],
                 softcap: float, packed: Packed | None, deterministic: bool = True) -> Problem:
    """The :class:`Problem` of a launch (a packed batch's sequences as long as its longest),
    for the launchers' own config choices, such as a portable fallback."""
    from flashtune._env import dtype_name

    b, hq, hk, sq, sk, d = problem_dims(q, k, packed)
    if packed is not None:
        sq, sk = max(packed.max_q, 1), max(packed.max_k, 1)
    return Problem(batch=b, heads_q=hq, heads_kv=hk, seqlen_q=sq, seqlen_k=sk, head_dim=d,
                   dtype=dtype_name(q.dtype), causal=causal, window=window, softcap=softcap,
                   deterministic=deterministic)


@functools.cache
def warn_portable_once(direction: str, reason: str) -> None:
    """One warning per (direction, reason) that a forced Hopper config fell back."""
    logging.getLogger("flashtune").warning(
        "flashtune: the Hopper %s cannot take these tensors (%s); the portable kernels run "
        "instead. Pass contiguous (or 16-byte-aligned, unit inner stride) tensors to use it.",
        direction, reason)


def tma_ok(*ts: torch.Tensor) -> bool:
    """Tensor descriptors need a Hopper-class GPU (or the interpreter), a power-of-two head dim,
    a unit inner stride and 16-byte aligned base and strides. Anything else takes the pointer
    path (same results)."""
    if ts[0].device.type == "cuda" and torch.cuda.get_device_capability(ts[0].device)[0] < 9:
        return False
    for t in ts:
        d = t.shape[-1]
        if d & (d - 1) or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[Any, Any]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    d = k.shape[-1]
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_n, d])
                 for t in (k, v))  # type: ignore[return-value]

