"""Packed (varlen) attention above the launchers: input validation, ``torch.library``
custom ops with fake implementations and autograd, and the typed public function
:func:`flash_attn_varlen_func` (flash-attn's signature and layout).

A packed batch concatenates sequences along the token axis: q is (total_q, Hq, D), k
and v are (total_k, Hkv, D), and sequence ``i`` owns rows ``cu_seqlens[i]:cu_seqlens[i+1]``
of each. The kernels read the prefix sums on the device, so a call makes no host sync.

Config selection works as for the dense path: the installed varlen resolver (the
dispatcher, or the heuristic default) picks a config for the call's :class:`Problem`,
whose batch is the number of sequences and whose lengths are the longest sequence's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from flashtune._env import dtype_name
from flashtune.kernels.attention import (
    _encode,
    check_tensors,
    split_config,
    validate_deterministic,
    validate_options,
)
from flashtune.kernels.attn_bwd import attn_bwd
from flashtune.kernels.attn_fwd import Packed, attn_fwd
from flashtune.kernels.config import (
    BwdConfig,
    FwdConfig,
    check_bwd,
    check_fwd,
    default_config,
)
from flashtune.problem import Problem

ProblemResolver = Callable[[str, Problem, torch.device], "FwdConfig | BwdConfig"]


def heuristic_problem_resolver(direction: str, problem: Problem,
                               device: torch.device) -> FwdConfig | BwdConfig:
    return default_config(direction, problem)


_resolver: ProblemResolver = heuristic_problem_resolver


def set_varlen_resolver(fn: ProblemResolver | None) -> None:
    """Install the function that picks a varlen call's config (None resets to the heuristic)."""
    global _resolver
    _resolver = fn if fn is not None else heuristic_problem_resolver


def varlen_problem(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                   window: tuple[int, int], softcap: float,
                   deterministic: bool = True) -> Problem:
    """The :class:`Problem` of a packed call: one batch entry per sequence, each as long as
    the longest (the kernels' grid has exactly that shape)."""
    return Problem(batch=cu_seqlens_q.shape[0] - 1, heads_q=q.shape[1], heads_kv=k.shape[1],
                   seqlen_q=max(int(max_seqlen_q), 1), seqlen_k=max(int(max_seqlen_k), 1),
                   head_dim=q.shape[2], dtype=dtype_name(q.dtype), causal=causal,
                   window=window, softcap=softcap, total_q=q.shape[0], total_k=k.shape[0],
                   deterministic=deterministic)


# ----------------------------------------------------------------------------- validation


def validate_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                    max_seqlen_q: Any, max_seqlen_k: Any) -> None:
    """Check the packed tensors; raise TypeError / ValueError naming the argument and value.

    The prefix sums' values are not read (that would sync with the device): they must start
    at 0, never decrease, and end at total_q / total_k; ``max_seqlen_*`` must be at least the
    longest sequence (longer only costs empty programs)."""
    check_tensors(q, k, v, "(total_tokens, heads, head_dim)", " for flash_attn_varlen_func")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) \
                else type(t).__name__
            raise TypeError(f"{name} must be a 1-D torch.int32 tensor of prefix sums, got {what}")
        if t.shape[0] < 2:
            raise ValueError(f"{name} needs batch + 1 >= 2 entries, got {t.shape[0]}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or m < 0:
            raise ValueError(f"{name} must be an int >= 0, got {m!r}")
    if q.shape[0] < 1 or k.shape[0] < 1:
        raise ValueError(f"total_q and total_k must be >= 1, got {q.shape[0]} and {k.shape[0]}")


# ----------------------------------------------------------------------------- custom ops


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed, causal: bool,
              scale: float, window: tuple[int, int], softcap: float, enc: Sequence[int],
              ) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = FwdConfig(*enc) if enc else _resolver(
        "fwd", varlen_problem(q, k, packed.cu_q, packed.max_q, packed.max_k, causal, window,
                              softcap), q.device)
    assert isinstance(cfg, FwdConfig)
    return attn_fwd(q, k, v, causal=causal, sm_scale=scale, window=window, softcap=softcap,
                    config=cfg, packed=packed)


@torch.library.custom_op("flashtune::attn_varlen_fwd", mutates_args=())
def attn_varlen_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                       max_seqlen_k: int, causal: bool, scale: float, window_left: int,
                       window_right: int, softcap: float, deterministic: bool,
                       fwd_config: list[int], bwd_config: list[int],
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    packed = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _fwd_impl(q, k, v, packed, causal, scale, (window_left, window_right), softcap,
                     fwd_config)


@attn_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
      window_left, window_right, softcap, deterministic, fwd_config, bwd_config):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("flashtune::attn_varlen_bwd", mutates_args=())
def attn_varlen_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                       causal: bool, scale: float, window_left: int, window_right: int,
                       softcap: float, deterministic: bool, bwd_config: list[int],
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # ``deterministic`` picks the backward's problem key (see the dense path).
    window = (window_left, window_right)
    cfg = BwdConfig(*bwd_config) if bwd_config else _resolver(
        "bwd", varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, window,
                              softcap, deterministic), q.device)
    assert isinstance(cfg, BwdConfig)
    return attn_bwd(do, q, k, v, o, lse, causal=causal, sm_scale=scale, window=window,
                    softcap=softcap, config=cfg,
                    packed=Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


@attn_varlen_bwd_op.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      scale, window_left, window_right, softcap, deterministic, bwd_config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, cu_q, cu_k, *args = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.args = args[:-2] + args[-1:]  # everything but the forward config
    ctx.mark_non_differentiable(lse)


def _backward(ctx: Any, do: torch.Tensor, _dlse: Any) -> tuple[Any, ...]:
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = attn_varlen_bwd_op(do, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
    return (dq, dk, dv) + (None,) * 12


attn_varlen_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           deterministic: bool = True, return_lse: bool = False,
                           config: FwdConfig | BwdConfig | tuple[FwdConfig, BwdConfig]
                           | None = None,
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 on packed sequences, flash-attn's layout: q (total_q, Hq, D), k and
    v (total_k, Hkv, D); ``cu_seqlens_q`` / ``cu_seqlens_k`` are int32 prefix sums
    (batch + 1 entries, starting at 0), ``max_seqlen_*`` the longest sequence on each side.

    Each sequence attends only to itself. ``causal`` is bottom-right aligned per sequence
    when its query and key lengths differ; ``window_size`` and ``softcap`` are as in
    :func:`flashtune.flash_attention`. A sequence with no keys gives zeros (LSE +inf).
    Returns the output (q's shape and dtype), plus the natural-log LSE (Hq, total_q) fp32
    with ``return_lse=True``. The backward is deterministic (``deterministic`` is accepted
    for flash-attn compatibility). Works under autograd, torch.compile and CUDA graphs.
    """
    validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale, window, cap = validate_options(q.shape[2], causal, softmax_scale, window_size,
                                          softcap, max_seqlen_q, max_seqlen_k)
    validate_deterministic(deterministic)
    fwd_cfg, bwd_cfg = split_config(config)
    if fwd_cfg is not None or bwd_cfg is not None:
        p = varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, window, cap,
                           deterministic)
        if fwd_cfg is not None:
            check_fwd(fwd_cfg, p)
        if bwd_cfg is not None:
            check_bwd(bwd_cfg, p)
    o, lse = attn_varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                int(max_seqlen_k), causal, scale, window[0], window[1], cap,
                                deterministic, _encode(fwd_cfg), _encode(bwd_cfg))
    return (o, lse) if return_lse else o
