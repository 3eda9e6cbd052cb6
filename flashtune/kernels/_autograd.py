"""The one autograd wiring of every attention entry point, dense and packed: what the
forward saves, and how the backward turns it into dq, dk and dv.

Every way in saves the forward's tensor inputs (q, k, v, then a packed batch's prefix
sums), O and the LSE, and runs :meth:`Plan.backward <flashtune.kernels._plans.Plan.backward>`
(or the backward op) on them:

- eager calls go through :func:`apply`: the plan's prepared launches run directly, with no
  custom-op dispatch in between, and the backward node is the C++ one of
  :mod:`flashtune.kernels._native` where it is built (it runs the plan's bound backward
  without Python, and calls ``Plan.backward`` for anything else), else :class:`Attention`,
  a ``torch.autograd.Function``;
- torch.compile sees the ``torch.library`` custom ops, whose autograd :func:`register`
  wires with the same :func:`save` and :func:`grads`, the backward staying inside the
  op graph (the backward op).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import forward_ad

from flashtune._env import interpreting
from flashtune.kernels import _bound, _native
from flashtune.kernels._plans import Plan


def save(ctx: Any, inputs: Sequence[torch.Tensor], o: torch.Tensor, lse: torch.Tensor,
         backward: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Save for :func:`grads`: ``backward(do, q, k, v, o, lse, *rest_of_inputs, *args)``
    gives (dq, dk, dv)."""
    ctx.save_for_backward(*inputs, o, lse)
    ctx.backward_fn = backward
    ctx.backward_args = args
    ctx.mark_non_differentiable(lse)


def grads(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, *rest = ctx.saved_tensors
    *extra, o, lse = rest
    dq, dk, dv = ctx.backward_fn(do, q, k, v, o, lse, *extra, *ctx.backward_args)
    return dq, dk, dv


class Attention(torch.autograd.Function):
    """Eager autograd: ``Attention.apply(plan, q, k, v, *prefix_sums)`` -> (O, LSE).

    Gradients are not materialized: the LSE is not differentiable, and autograd would
    otherwise allocate and zero-fill a gradient for it on every backward (a kernel launch
    of host time at small shapes) that the backward never reads."""

    @staticmethod
    def forward(ctx: Any, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                *cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = plan.forward(q, k, v, *cu)
        save(ctx, (q, k, v, *cu), o, lse, plan.backward, ())
        ctx.set_materialize_grads(False)
        ctx.n_cu = len(cu)
        return o, lse

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor | None, _dlse: Any) -> tuple[Any, ...]:
        if do is None:  # no gradient reached O: none for the inputs either
            return (None,) * (4 + ctx.n_cu)
        return (None, *grads(ctx, do), *(None,) * ctx.n_cu)


def register(fwd_op: Any, bwd_op: Any) -> None:
    """Autograd for a forward custom op taking (q, k, v, *tensors, *scalars, fwd_config,
    bwd_config), whose backward op takes (do, q, k, v, o, lse, *tensors, *scalars,
    bwd_config): the scalars and configs in the forward's order, less the forward config."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        n = sum(isinstance(x, torch.Tensor) for x in inputs)
        args = inputs[n:-2] + inputs[-1:]
        o, lse = output
        save(ctx, inputs[:n], o, lse, bwd_op, args)
        ctx.n_inputs = len(inputs)

    def backward(ctx: Any, do: torch.Tensor, _dlse: Any) -> tuple[Any, ...]:
        return (*grads(ctx, do), *(None,) * (ctx.n_inputs - 3))

    fwd_op.register_autograd(backward, setup_context=setup_context)


def apply(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          *cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager forward with autograd: (O, LSE), O's history leading to q, k and v.

    The C++ node serves CUDA calls once the extension is built (``FLASHTUNE_NATIVE``), and
    any call with ``FLASHTUNE_NATIVE=1``; the Python Function serves the rest, and calls
    it cannot: forward-mode AD (the Function raises for it) and a launch hook installed
    (the node's launches would bypass it)."""
    ext = _native_for(q)
    if ext is None or forward_ad._current_level >= 0 or _bound.hooked():
        return Attention.apply(plan, q, k, v, *cu)
    o, lse = plan.forward(q, k, v, *cu)
    ext.attach(plan.native_handle(ext), plan, o, lse, q, k, v, list(cu))
    return o, lse


def _native_for(q: torch.Tensor) -> Any:
    if q.is_cuda:
        return _native.module()
    if interpreting() and _native.mode() == "sync":  # CPU tensors: tests of the wiring
        return _native.module()
    return None
