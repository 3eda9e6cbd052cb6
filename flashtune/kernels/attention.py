"""The layers above the launchers: input validation, a ``torch.autograd.Function``,
``torch.library`` custom ops (with fake implementations, so ``torch.compile`` sees
through them), and the typed public function.

Config selection happens *inside* the ops and launches, at run time, through a resolver
hook: by default the heuristic defaults; :func:`flashtune.dispatch.install` installs the
dispatcher's lookup. That keeps database code out of traced graphs and out of this
package. Per-call work is cached by the call's signature (:mod:`flashtune.kernels._plans`);
the autograd wiring is :mod:`flashtune.kernels._autograd`, shared with the packed path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from flashtune._env import interpreting, torch_dtype
from flashtune.kernels import _autograd, _plans
from flashtune.kernels._plans import Plan, Resolver, caches, heuristic_resolver, remember
from flashtune.kernels.config import (
    BWD_HOPPER,
    BwdConfig,
    FwdConfig,
    check_bwd,
    check_fwd,
    validate_config,
)
from flashtune.problem import (
    DTYPES,
    HEAD_DIMS,
    SOFTCAP_LIMIT,
    Problem,
    default_scale,
    effective_softcap,
    effective_window,
    head_dim_ok,
)

__all__ = ["flash_attention", "flash_attn_func", "set_config_resolver", "get_config_resolver",
           "heuristic_resolver", "validate", "check_tensors"]

_DTYPES = tuple(torch_dtype(name) for name in DTYPES)  # fp16, bf16
_INTERPRET = interpreting()
# The kernels scale q.k in fp32: |q.k| stays below 65504**2 * 256 ~ 1.1e12 for fp16 inputs,
# so a scale up to 1e20 keeps every score finite (fp32 ends at 3.4e38).
_MAX_SCALE = 1e20


def set_config_resolver(fn: Resolver | None) -> None:
    """Install the function that picks a config when the caller forces none (None resets
    to the heuristic). Every remembered decision is forgotten."""
    _plans.set_resolvers(fn, _plans.resolvers()[1])


def get_config_resolver() -> Resolver:
    return _plans.resolvers()[0]


# ----------------------------------------------------------------------------- validation


def check_tensors(q: Any, k: Any, v: Any, axes: str, where: str = "") -> None:
    """The checks every entry point shares. q, k and v are fp16/bf16 tensors of one dtype,
    of rank len(axes) (``axes`` names the dimensions, heads second and head_dim last), on
    one device flashtune can use; k and v share a shape; q's head dim equals k's, is
    supported, and q's heads are a multiple of k's (GQA/MQA). TypeError / ValueError name
    the argument and the value; ``where`` names the entry point in the rank message."""
    ndim = axes.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D {axes}{where}, "
                             f"got shape {tuple(t.shape)} ({t.dim()}-D)")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}.dtype must be torch.float16 or torch.bfloat16, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "cpu" and not _INTERPRET:
        raise ValueError("q is a CPU tensor: CPU tensors run only under Triton's interpreter "
                         "(set TRITON_INTERPRET=1 before importing flashtune); move the "
                         "tensors to a CUDA device otherwise")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"q.device must be a CUDA device, got {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got k {tuple(k.shape)} v {tuple(v.shape)}")
    d, dk, hq, hk = q.shape[-1], k.shape[-1], q.shape[1], k.shape[1]
    if dk != d:
        raise ValueError(f"k.shape[{ndim - 1}] (head_dim) = {dk} must equal "
                         f"q.shape[{ndim - 1}] = {d}")
    if not head_dim_ok(d):
        raise ValueError(f"head_dim = {d} is not supported: use {HEAD_DIMS}")
    if hk < 1 or hq % hk:
        raise ValueError(f"q heads = {hq} must be a multiple of k/v heads = {hk} (GQA/MQA)")


def validate(q: Any, k: Any, v: Any, causal: Any, softmax_scale: Any, window_size: Any,
             softcap: Any) -> tuple[float, tuple[int, int], float]:
    """Check the public arguments; return (scale, window, softcap) normalised.

    Raises TypeError / ValueError naming the argument and the offending value.
    """
    check_tensors(q, k, v, "(batch, heads, seqlen, head_dim)")
    b, hq, sq, d = q.shape
    bk, hk, sk, dk = k.shape
    if bk != b:
        raise ValueError(f"k.shape[0] (batch) = {bk} must equal q.shape[0] = {b}")
    if b < 1 or sq < 1 or sk < 1:
        raise ValueError(f"batch, seqlen_q and seqlen_k must be >= 1, got batch={b}, "
                         f"seqlen_q={sq}, seqlen_k={sk}")
    return validate_options(d, causal, softmax_scale, window_size, softcap, sq, sk)


def validate_options(d: int, causal: Any, softmax_scale: Any, window_size: Any,
                     softcap: Any, sq: int, sk: int) -> tuple[float, tuple[int, int], float]:
    """The mask and score options of every entry point; (scale, window, softcap) normalised.
    ``sq`` and ``sk`` are the (longest) query and key lengths: window bounds past them mean
    unbounded."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if softmax_scale is None:
        scale = default_scale(d)
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
        scale = float(softmax_scale)
        if not (0 < scale <= _MAX_SCALE):
            raise ValueError(f"softmax_scale must be finite and > 0 (at most {_MAX_SCALE:g}), "
                             f"got {softmax_scale!r}")
    if (not isinstance(window_size, Sequence) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    window = (int(window_size[0]), int(window_size[1]))
    if window[0] < -1 or window[1] < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded, got {window}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {softcap!r}")
    cap = float(softcap)
    if not cap >= 0:
        raise ValueError(f"softcap must be a number >= 0 (0 disables it; {SOFTCAP_LIMIT:g} or "
                         f"more, inf included, is its limit: no softcap), got {softcap!r}")
    # A bound past the sequence is unbounded, a huge cap is no cap: what the call means,
    # in a form the kernels' int32 / fp32 arithmetic holds exactly.
    return scale, effective_window(window, sq, sk), effective_softcap(cap, scale)


def validate_deterministic(deterministic: Any) -> None:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")


def split_config(config: Any) -> tuple[FwdConfig | None, BwdConfig | None]:
    """Accept None, a FwdConfig, a BwdConfig or a (FwdConfig, BwdConfig) pair."""
    if config is None:
        return None, None
    if isinstance(config, FwdConfig):
        return config, None
    if isinstance(config, BwdConfig):
        return None, config
    if (isinstance(config, (tuple, list)) and len(config) == 2
            and isinstance(config[0], FwdConfig) and isinstance(config[1], BwdConfig)):
        return config[0], config[1]
    raise TypeError("config must be None, a FwdConfig, a BwdConfig or a (FwdConfig, BwdConfig) "
                    f"pair, got {config!r}")


def _encode(cfg: FwdConfig | BwdConfig | None) -> list[int]:
    # Custom-op schemas carry ints, not dataclasses: fields in declaration order; [] = resolve.
    return [] if cfg is None else [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]


def op_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            window: tuple[int, int], softcap: float, deterministic: bool,
            fwd_enc: Sequence[int], bwd_enc: Sequence[int]) -> Plan:
    """The plan of a custom-op call (arguments already normalised), cached by signature."""
    cache = caches["op"]
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
           causal, scale, window, softcap, deterministic, tuple(fwd_enc), tuple(bwd_enc))
    plan = cache.get(key)
    if plan is None:
        problem = Problem.from_tensors(q, k, causal=causal, window_size=window, softcap=softcap,
                                       deterministic=deterministic)
        plan = remember(cache, key, Plan(
            problem, q.device, causal, scale, window, softcap, deterministic,
            FwdConfig(*fwd_enc) if fwd_enc else None, BwdConfig(*bwd_enc) if bwd_enc else None))
    return plan


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
              window: tuple[int, int], softcap: float, enc: Sequence[int],
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return op_plan(q, k, v, causal, scale, window, softcap, True, enc, ()).forward(q, k, v)


def _bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
              window: tuple[int, int], softcap: float, enc: Sequence[int],
              deterministic: bool = True,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # ``deterministic`` picks the backward's config (and refuses free-order dQ variants).
    plan = op_plan(q, k, v, causal, scale, window, softcap, deterministic, (), enc)
    return plan.backward(do, q, k, v, o, lse)


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("flashtune::attn_fwd", mutates_args=())
def attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                window_left: int, window_right: int, softcap: float, deterministic: bool,
                fwd_config: list[int], bwd_config: list[int],
                ) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, causal, scale, (window_left, window_right), softcap, fwd_config)


@attn_fwd_op.register_fake
def _(q, k, v, causal, scale, window_left, window_right, softcap, deterministic, fwd_config,
      bwd_config):
    b, hq, sq, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("flashtune::attn_bwd", mutates_args=())
def attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                window_left: int, window_right: int, softcap: float, deterministic: bool,
                bwd_config: list[int],
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(do, q, k, v, o, lse, causal, scale, (window_left, window_right), softcap,
                     bwd_config, deterministic)


@attn_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, scale, window_left, window_right, softcap, deterministic,
      bwd_config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_autograd.register(attn_fwd_op, attn_bwd_op)


# ----------------------------------------------------------------------------- public


def forced_configs(config: Any, problem: Problem) -> tuple[FwdConfig | None, BwdConfig | None]:
    """The forward and backward configs ``config`` forces (None: resolve), each checked
    for validity and for feasibility on ``problem``."""
    fwd_cfg, bwd_cfg = split_config(config)
    for cfg in (fwd_cfg, bwd_cfg):
        if cfg is not None:
            validate_config(cfg)
    if fwd_cfg is not None:
        check_fwd(fwd_cfg, problem)
    if bwd_cfg is not None:
        check_bwd(bwd_cfg, problem)
        if bwd_cfg.variant == BWD_HOPPER:
            # The Hopper backward's launch plan (the fixed order's dQ staging), checked here
            # too, so the call fails before its forward runs. Importable: the rules passed.
            from flashtune.kernels.attn_bwd_hopper import check_launch_plan

            check_launch_plan(bwd_cfg, problem.head_dim, problem.deterministic)
    return fwd_cfg, bwd_cfg


def _same_config(plan: Plan, config: Any) -> bool:
    """Whether a plan made for an equal ``config`` serves this one: the same object, or an
    equal one whose fields pass validation (``64.0 == 64`` to a dict, not to the kernels)."""
    if config is None or plan.config is config:
        return True
    for cfg in split_config(config):
        if cfg is not None:
            validate_config(cfg)
    return True


def call_plan(q: Any, k: Any, v: Any, causal: Any, softmax_scale: Any, window_size: Any,
              softcap: Any, deterministic: Any, config: Any) -> Plan:
    """The plan of a :func:`flash_attention` call, cached by its signature: validation,
    normalisation, forced-config checks and the problem run on first sight only."""
    cache = caches["call"]
    try:
        key: Any = (
            q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, causal, softmax_scale, window_size, softcap,
            deterministic, config, type(q), type(k), type(v), type(causal), type(softmax_scale),
            type(window_size), type(window_size[0]), type(window_size[1]), type(softcap),
            type(deterministic))
        plan = cache.get(key)
    except Exception:  # not tensors, or arguments that cannot key a dict: validate in full
        key = plan = None
    if plan is not None and _same_config(plan, config):
        return plan
    scale, window, cap = validate(q, k, v, causal, softmax_scale, window_size, softcap)
    validate_deterministic(deterministic)
    problem = Problem.from_tensors(q, k, causal=causal, window_size=window, softcap=cap,
                                   deterministic=deterministic)
    fwd_cfg, bwd_cfg = forced_configs(config, problem)
    return remember(cache, key, Plan(problem, q.device, causal, scale, window, cap,
                                     deterministic, fwd_cfg, bwd_cfg, config=config))


def needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: float | None = None,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    return_lse: bool = False, deterministic: bool = True,
                    config: FwdConfig | BwdConfig | tuple[FwdConfig, BwdConfig] | None = None,
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 on q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D), any strides.

    ``causal`` is bottom-right aligned when Sq != Sk; ``window_size=(left, right)``
    bounds the visible keys (-1: unbounded); ``softcap > 0`` applies
    ``softcap * tanh(s / softcap)`` to the scores. Returns the output (q's shape and
    dtype), plus the natural-log LSE (B, Hq, Sq) fp32 with ``return_lse=True``.
    ``config`` forces a forward and/or backward config; otherwise the installed
    resolver (the dispatcher, or the heuristic default) chooses. ``deterministic=True``
    (the default) gives bit-identical gradients; ``False`` also allows backward variants
    whose dQ summation order is not fixed (a forced ``BwdConfig(variant=1)`` needs it).

    The layout is PyTorch SDPA's: heads before sequence. For flash-attn's (B, S, H, D)
    tensors use :func:`flash_attn_func`, or pass ``x.transpose(1, 2)`` (no copy).
    """
    if torch.compiler.is_compiling():  # the custom op, which the graph keeps
        scale, window, cap = validate(q, k, v, causal, softmax_scale, window_size, softcap)
        validate_deterministic(deterministic)
        problem = Problem.from_tensors(q, k, causal=causal, window_size=window, softcap=cap,
                                       deterministic=deterministic)
        fwd_cfg, bwd_cfg = forced_configs(config, problem)
        o, lse = attn_fwd_op(q, k, v, causal, scale, window[0], window[1], cap, deterministic,
                             _encode(fwd_cfg), _encode(bwd_cfg))
    else:
        plan = call_plan(q, k, v, causal, softmax_scale, window_size, softcap, deterministic,
                         config)
        if needs_grad(q, k, v):
            o, lse = _autograd.apply(plan, q, k, v)
        else:
            o, lse = plan.forward(q, k, v, lse=return_lse)
    return (o, lse) if return_lse else o


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> torch.Tensor:
    """flash-attn's ``flash_attn_func``: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), with
    flash-attn's defaults; returns (B, Sq, Hq, D). Runs :func:`flash_attention` on
    transposed views (no copies). Dropout, ALiBi and returning the attention
    probabilities are not implemented and raise a ValueError naming the argument."""
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p!r}: flashtune has no attention dropout; pass "
                         "dropout_p=0.0 (flash-attn's default in eval is 0.0 too)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by flashtune; pass alibi_slopes=None")
    if return_attn_probs:
        raise ValueError("return_attn_probs=True is not supported by flashtune; use "
                         "flash_attention(..., return_lse=True) for the log-sum-exp")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim) for "
                             f"flash_attn_func, got shape {tuple(t.shape)}")
    out = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                          softcap=softcap, deterministic=deterministic)
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2)
