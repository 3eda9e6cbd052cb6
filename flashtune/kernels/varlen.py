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

from collections.abc import Sequence
from typing import Any

import torch

from flashtune._env import dtype_name
from flashtune.kernels import _autograd, _plans
from flashtune.kernels._plans import (
    Plan,
    ProblemResolver,
    caches,
    heuristic_problem_resolver,
    remember,
)
from flashtune.kernels.attention import (
    _encode,
    _same_config,
    check_tensors,
    forced_configs,
    needs_grad,
    validate_deterministic,
    validate_options,
)
from flashtune.kernels.config import BwdConfig, FwdConfig
from flashtune.problem import Problem

__all__ = ["flash_attn_varlen_func", "set_varlen_resolver", "heuristic_problem_resolver",
           "varlen_problem", "validate_varlen"]


def set_varlen_resolver(fn: ProblemResolver | None) -> None:
    """Install the function that picks a varlen call's config (None resets to the heuristic).
    Every remembered decision is forgotten."""
    _plans.set_resolvers(_plans.resolvers()[0], fn)


def varlen_problem(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                   window: tuple[int, int], softcap: float,
                   deterministic: bool = True) -> Problem:
    """The :class:`Problem` of a packed call: one batch entry per sequence, each as long as
    the longest (the kernels' grid has exactly that shape)."""
    return Problem(batch=cu_seqlens_q.shape[0] - 1, heads_q=q.shape[1], heads_kv=k.shape[1],
                   seqlen_q=max(int(max_seqlen_q), 1), seqlen_k=max(int(max_seqlen_k), 1),
                   head_dim=q.shape[2], dtype=dtype_name(q.dtype), causal=causal,
                   window=window, softcap=softcap, deterministic=deterministic,
                   total_q=q.shape[0], total_k=k.shape[0])


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
        if t.stride(0) != 1:  # the kernels read entry i at the base pointer + i
            raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)}; "
                             f"pass {name}.contiguous()")
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


def op_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
            max_q: int, max_k: int, causal: bool, scale: float, window: tuple[int, int],
            softcap: float, deterministic: bool, fwd_enc: Sequence[int],
            bwd_enc: Sequence[int]) -> Plan:
    """The plan of a packed custom-op call (arguments already normalised), by signature."""
    cache = caches["op"]
    key = ("varlen", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype,
           q.device, cu_q.shape, max_q, max_k, causal, scale, window, softcap, deterministic,
           tuple(fwd_enc), tuple(bwd_enc))
    plan = cache.get(key)
    if plan is None:
        problem = varlen_problem(q, k, cu_q, max_q, max_k, causal, window, softcap,
                                 deterministic)
        plan = remember(cache, key, Plan(
            problem, q.device, causal, scale, window, softcap, deterministic,
            FwdConfig(*fwd_enc) if fwd_enc else None, BwdConfig(*bwd_enc) if bwd_enc else None,
            maxlen=(max_q, max_k)))
    return plan


@torch.library.custom_op("flashtune::attn_varlen_fwd", mutates_args=())
def attn_varlen_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                       max_seqlen_k: int, causal: bool, scale: float, window_left: int,
                       window_right: int, softcap: float, deterministic: bool,
                       fwd_config: list[int], bwd_config: list[int],
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    plan = op_plan(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, scale,
                   (window_left, window_right), softcap, deterministic, fwd_config, ())
    return plan.forward(q, k, v, cu_seqlens_q, cu_seqlens_k)


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
    # ``deterministic`` picks the backward's config (and refuses free-order dQ variants).
    plan = op_plan(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, scale,
                   (window_left, window_right), softcap, deterministic, (), bwd_config)
    return plan.backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)


@attn_varlen_bwd_op.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      scale, window_left, window_right, softcap, deterministic, bwd_config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_autograd.register(attn_varlen_fwd_op, attn_varlen_bwd_op)


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
    v (total_k, Hkv, D); ``cu_seqlens_q`` / ``cu_seqlens_k`` are contiguous int32 prefix sums
    (batch + 1 entries, starting at 0), ``max_seqlen_*`` the longest sequence on each side.

    Each sequence attends only to itself. ``causal`` is bottom-right aligned per sequence
    when its query and key lengths differ; ``window_size`` and ``softcap`` are as in
    :func:`flashtune.flash_attention`. A sequence with no keys gives zeros (LSE +inf).
    Returns the output (q's shape and dtype), plus the natural-log LSE (Hq, total_q) fp32
    with ``return_lse=True``. ``deterministic`` as in
    :func:`flashtune.flash_attention`. Works under autograd, torch.compile and CUDA graphs.
    """
    cu = (cu_seqlens_q, cu_seqlens_k)
    if torch.compiler.is_compiling():  # the custom op, which the graph keeps
        scale, window, cap, problem = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                max_seqlen_q, max_seqlen_k, causal,
                                                softmax_scale, window_size, softcap,
                                                deterministic)
        fwd_cfg, bwd_cfg = forced_configs(config, problem)
        o, lse = attn_varlen_fwd_op(q, k, v, *cu, int(max_seqlen_q), int(max_seqlen_k), causal,
                                    scale, window[0], window[1], cap, deterministic,
                                    _encode(fwd_cfg), _encode(bwd_cfg))
    else:
        plan = call_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         causal, softmax_scale, window_size, softcap, deterministic, config)
        if needs_grad(q, k, v):
            o, lse = _autograd.apply(plan, q, k, v, *cu)
        else:
            o, lse = plan.forward(q, k, v, *cu, lse=return_lse)
    return (o, lse) if return_lse else o


def _validate(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: Any, max_k: Any,
              causal: Any, softmax_scale: Any, window_size: Any, softcap: Any,
              deterministic: Any) -> tuple[float, tuple[int, int], float, Problem]:
    validate_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    scale, window, cap = validate_options(q.shape[2], causal, softmax_scale, window_size,
                                          softcap, max_q, max_k)
    validate_deterministic(deterministic)
    return scale, window, cap, varlen_problem(q, k, cu_q, max_q, max_k, causal, window, cap,
                                              deterministic)


def call_plan(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: Any, max_k: Any,
              causal: Any, softmax_scale: Any, window_size: Any, softcap: Any,
              deterministic: Any, config: Any) -> Plan:
    """The plan of a :func:`flash_attn_varlen_func` call, cached by its signature (the
    prefix sums' shapes, dtypes and devices; never their values)."""
    cache = caches["call"]
    try:
        key: Any = (
            "varlen", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype,
            k.dtype, v.dtype, q.device, k.device, v.device, cu_q.shape, cu_q.stride(),
            cu_q.dtype, cu_q.device, cu_k.shape, cu_k.stride(), cu_k.dtype, cu_k.device, max_q,
            max_k, causal, softmax_scale, window_size, softcap, deterministic, config, type(q),
            type(k), type(v), type(cu_q), type(cu_k), type(max_q), type(max_k), type(causal),
            type(softmax_scale), type(window_size), type(window_size[0]),
            type(window_size[1]), type(softcap), type(deterministic))
        plan = cache.get(key)
    except Exception:  # not tensors, or arguments that cannot key a dict: validate in full
        key = plan = None
    if plan is not None and _same_config(plan, config):
        return plan
    scale, window, cap, problem = _validate(q, k, v, cu_q, cu_k, max_q, max_k, causal,
                                            softmax_scale, window_size, softcap, deterministic)
    fwd_cfg, bwd_cfg = forced_configs(config, problem)
    return remember(cache, key, Plan(problem, q.device, causal, scale, window, cap,
                                     deterministic, fwd_cfg, bwd_cfg,
                                     maxlen=(int(max_q), int(max_k)), config=config))
