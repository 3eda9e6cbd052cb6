"""fp32 (or fp64) reference attention with exactly the kernels' semantics.

Used by the tests and by the tuner's correctness gate. ``upcast=False`` computes in
the inputs' own dtype, which is "PyTorch's own low-precision error" in the 2x rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from flashtune.problem import default_scale


def visibility(sq: int, sk: int, causal: bool, window: tuple[int, int],
               device: torch.device | str) -> torch.Tensor | None:
    """(Sq, Sk) bool mask of visible keys, or None when everything is visible."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left < 0 and right < 0:
        return None
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis


def _scores(q: torch.Tensor, k: torch.Tensor, *, causal: bool, softmax_scale: float | None,
            window_size: tuple[int, int], softcap: float) -> torch.Tensor:
    """The masked scores (B, Hq, Sq, Sk) of (B, H, S, D) inputs, KV heads repeated for GQA:
    scaled, soft-capped, -inf where a key is not visible."""
    hq, hk, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
    scale = softmax_scale if softmax_scale is not None else default_scale(q.shape[-1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    vis = visibility(sq, sk, causal, window_size, q.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    return s


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, upcast: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse). out has q's dtype; lse is fp32 (B, Hq, Sq), +inf on empty rows."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:
        v = v.repeat_interleave(hq // hk, dim=1)
    s = _scores(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                softcap=softcap)
    lse = torch.logsumexp(s.float(), dim=-1)
    empty = torch.isneginf(lse)
    p = torch.softmax(s, dim=-1)
    p = torch.where(empty[..., None], torch.zeros_like(p), p)
    out = torch.matmul(p.to(v.dtype), v)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return out.to(dtype), lse


# ----------------------------------------------------------------------------- the 2x rule

ATOL = {"out": 1e-3, "lse": 1e-3, "dq": 2e-3, "dk": 2e-3, "dv": 2e-3}


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| over finite reference entries; inf if x has NaN or inf where ref is finite,
    or if the non-finite entries (empty rows' LSE) do not match."""
    x = x.float()
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), fin) or torch.isnan(x).any():
        return math.inf
    if not torch.equal(x[~fin], ref[~fin]):
        return math.inf
    return (x[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0


def within_rule(errs: dict[str, float], torch_errs: dict[str, float],
                factor: float = 2.0) -> tuple[bool, float, str]:
    """flash-attn's rule: err <= factor * torch_lowp_err + atol, for every tensor.

    Returns (ok, worst ratio err / allowed, a one-line detail naming the worst tensor).
    """
    worst, worst_name = 0.0, ""
    for name, e in errs.items():
        allowed = factor * torch_errs[name] + ATOL[name]
        r = e / allowed if math.isfinite(e) else math.inf
        if r >= worst:
            worst, worst_name = r, name
    detail = (f"{worst_name}: err {errs[worst_name]:.3g} vs allowed "
              f"{factor * torch_errs[worst_name] + ATOL[worst_name]:.3g}") if worst_name else ""
    return worst <= 1.0, worst, detail


class Comparison:
    """Result of a correctness check: ``ok``, the largest absolute error, the worst
    error/allowed ratio (<= 1 passes) and a one-line detail."""

    __slots__ = ("ok", "max_error", "ratio", "detail", "errors")

    def __init__(self, ok: bool, max_error: float, ratio: float, detail: str,
                 errors: dict[str, float]):
        self.ok, self.max_error, self.ratio, self.detail, self.errors = (
            ok, max_error, ratio, detail, errors)

    def __repr__(self) -> str:
        return f"Comparison(ok={self.ok}, max_error={self.max_error:.3g}, ratio={self.ratio:.3g})"


# Above this many score elements per call, the reference runs in (batch, KV-head) slices:
# autograd keeps several fp32 copies of the scores, which at S=16k would fill a GPU.
REF_CHUNK_SCORES = 1 << 28

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Reference:
    """The fp32 reference of one set of inputs: ``out``, ``lse`` and (given an upstream
    gradient) ``grads`` = (dq, dk, dv), all fp32 in the inputs' layout, and
    ``torch_errors``, PyTorch's own low-precision errors against it (the 2x rule's scale).
    Made once, it checks any number of candidates' outputs (:meth:`errors`)."""

    __slots__ = ("out", "lse", "grads", "torch_errors")

    def __init__(self, out: torch.Tensor, lse: torch.Tensor, grads: Grads | None,
                 torch_errors: dict[str, float]):
        self.out, self.lse, self.grads, self.torch_errors = out, lse, grads, torch_errors

    def errors(self, out: torch.Tensor, lse: torch.Tensor,
               grads: Grads | None = None) -> dict[str, float]:
        """Each tensor's max error against the reference (out and lse; dq, dk and dv when
        ``grads`` is given)."""
        errs = {"out": _max_err(out, self.out), "lse": _max_err(lse, self.lse)}
        if grads is not None:
            if self.grads is None:
                raise ValueError("this reference has no gradients (it was made without do)")
            for name, g, rg in zip(("dq", "dk", "dv"), grads, self.grads, strict=True):
                errs[name] = _max_err(g, rg)
        return errs


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor | None, *,
              causal: bool, softmax_scale: float | None, window_size: tuple[int, int],
              softcap: float, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None) -> Reference:
    """The :class:`Reference` of dense (B, H, S, D) inputs or, with ``cu_seqlens_*``, of a
    packed batch ((total, H, D); lse (Hq, total)), gradients included when ``do`` is given.

    Large dense problems run slice by slice (one batch entry and a group of KV heads with
    their query heads at a time), a packed batch one sequence at a time; every error is a
    max, so the result is the same as in one piece.
    """
    kw: dict[str, Any] = dict(causal=causal, softmax_scale=softmax_scale,
                              window_size=window_size, softcap=softcap)
    slices = _slices(q, k, cu_seqlens_q, cu_seqlens_k)
    hq = q.shape[1]
    lse_full = (torch.empty(hq, q.shape[0], device=q.device) if cu_seqlens_q is not None
                else torch.empty(q.shape[0], hq, q.shape[2], device=q.device))
    ref = Reference(torch.empty(q.shape, device=q.device), lse_full,
                    None if do is None else (torch.empty(q.shape, device=q.device),
                                             torch.empty(k.shape, device=q.device),
                                             torch.empty(v.shape, device=q.device)), {})
    for qs, ks, ls in slices:
        outs = (qs(ref.out), ls(ref.lse), None if ref.grads is None
                else (qs(ref.grads[0]), ks(ref.grads[1]), ks(ref.grads[2])))
        terrs = _reference_into(qs(q), ks(k), ks(v), None if do is None else qs(do), outs, kw)
        for name, e in terrs.items():
            ref.torch_errors[name] = max(ref.torch_errors.get(name, 0.0), e)
    return ref


Take = Callable[[torch.Tensor], torch.Tensor]


def _slices(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
            cu_seqlens_k: torch.Tensor | None) -> list[tuple[Take, Take, Take]]:
    """The pieces a reference of these inputs is computed in, each as three functions of a
    full tensor: its query-side and key-side views, (B', H', S', D) each, and its LSE
    view, (B', H', S'). Dense (B, H, S, D) inputs: whole where the scores fit
    REF_CHUNK_SCORES, else one batch entry and a group of KV heads (with their query
    heads) at a time. Packed ones ((total, H, D), LSE (Hq, total)): one sequence at a
    time, split by heads the same way."""
    hq, hk = q.shape[1], k.shape[1]
    group = hq // hk
    slices: list[tuple[Take, Take, Take]] = []
    if cu_seqlens_q is not None:
        assert cu_seqlens_k is not None
        for qa, qb, ka, kb in _sequences(cu_seqlens_q, cu_seqlens_k):
            step = _heads_per_slice(hk, group, (qb - qa) * (kb - ka))
            for h0 in range(0, hk, step):
                h1 = min(hk, h0 + step)
                slices.append((_packed_take(qa, qb, h0 * group, h1 * group),
                               _packed_take(ka, kb, h0, h1),
                               _packed_lse_take(qa, qb, h0 * group, h1 * group)))
        return slices
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    step = _heads_per_slice(hk, group, sq * sk, batch=b)
    whole = step == hk and b * hq * sq * sk <= REF_CHUNK_SCORES
    for bi in [slice(None)] if whole else [slice(i, i + 1) for i in range(b)]:
        for h0 in range(0, hk, step):
            h1 = min(hk, h0 + step)
            slices.append((_dense_take(bi, h0 * group, h1 * group), _dense_take(bi, h0, h1),
                           _dense_take(bi, h0 * group, h1 * group)))
    return slices


def _dense_take(batch: slice, h0: int, h1: int) -> Take:
    """Heads [h0, h1) of the sequences ``batch`` of a dense (B, H, ...) tensor."""
    return lambda t: t[batch, h0:h1]


def _packed_take(a: int, b: int, h0: int, h1: int) -> Take:
    """Tokens [a, b) of heads [h0, h1) of a packed (total, H, D) tensor, as (1, H, S, D)."""
    return lambda t: _seq(t[:, h0:h1], a, b)


def _packed_lse_take(a: int, b: int, h0: int, h1: int) -> Take:
    """Tokens [a, b) of heads [h0, h1) of a packed LSE (H, total), as (1, H, S)."""
    return lambda t: t[None, h0:h1, a:b]


def _heads_per_slice(hk: int, group: int, scores_per_head: int, batch: int = 1) -> int:
    """KV heads per reference slice: all of them when the whole fits REF_CHUNK_SCORES."""
    if batch * hk * group * scores_per_head <= REF_CHUNK_SCORES:
        return hk
    return max(1, REF_CHUNK_SCORES // (group * scores_per_head))


def reference_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor | None,
                     out: torch.Tensor, lse: torch.Tensor, grads: Grads | None, *,
                     causal: bool, softmax_scale: float | None, window_size: tuple[int, int],
                     softcap: float) -> tuple[dict[str, float], dict[str, float]]:
    """(errors of the candidate, errors of PyTorch's own low-precision path), both against
    the fp32 reference, for out/lse and, when ``grads`` is given, dq/dk/dv."""
    ref = reference(q, k, v, do if grads is not None else None, causal=causal,
                    softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    return ref.errors(out, lse, grads), ref.torch_errors


def flash_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                 out: torch.Tensor, *, causal: bool, softmax_scale: float | None,
                 window_size: tuple[int, int], softcap: float,
                 cu_seqlens_q: torch.Tensor | None = None,
                 cu_seqlens_k: torch.Tensor | None = None) -> dict[str, float]:
    """The max errors in dq, dk and dv of a FlashAttention backward computed in fp32 but for
    the roundings the algorithm itself makes, given ``out``, a candidate forward's output
    as stored; dense (B, H, S, D) inputs or, with ``cu_seqlens_*``, a packed batch, one
    sequence at a time; in the reference's slices (a few fp32 copies of one slice's
    scores at a time).

    The roundings, to the inputs' dtype: the output, from which delta = rowsum(dO * O) is
    formed (an output off by e per element moves delta_i by rowsum(dO * e) and the score
    gradient dS = P * (dO V^T - delta) by -P times that); P before dV = P^T dO; and dS
    before dQ = dS K and dK = dS^T Q. PyTorch's own low-precision path forms no delta from
    a stored output and rounds elsewhere, so on a batch of a few dozen rows its errors can
    fall well short of these, which any FlashAttention backward given ``out`` makes."""
    kw: dict[str, Any] = dict(causal=causal, softmax_scale=softmax_scale,
                              window_size=window_size, softcap=softcap)
    worst = {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    for qs, ks, _ls in _slices(q, k, cu_seqlens_q, cu_seqlens_k):
        errs = _flash_errors(qs(q), ks(k), ks(v), qs(do), qs(out), kw)
        worst = {name: max(worst[name], e) for name, e in errs.items()}
    return worst


def _flash_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                  out: torch.Tensor, kw: dict[str, Any]) -> dict[str, float]:
    # Both backwards, exact and rounded, take dS (dP) through autograd from the scores
    # (scale, soft-cap, mask and the GQA head sum included) and from P V.
    low = q.dtype
    q32, k32, v32, do32 = (t.detach().float().requires_grad_(True) for t in (q, k, v, do))
    with torch.enable_grad():
        s = _scores(q32, k32, **kw)
        hq, hk = q.shape[1], k.shape[1]
        vr = v32.repeat_interleave(hq // hk, dim=1) if hq != hk else v32
    if s.numel() == 0:
        return {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    p = torch.softmax(s.detach(), dim=-1)
    p = torch.where(torch.isfinite(s.detach()).any(-1, keepdim=True), p, torch.zeros_like(p))
    o = torch.matmul(p, vr.detach())
    dp = torch.matmul(do32.detach(), vr.detach().transpose(-1, -2))
    grads = []
    for o_used, rnd in ((o, False), (out.detach().float(), True)):
        ds = p * (dp - (do32.detach() * o_used).sum(-1, keepdim=True))
        pv = p
        if rnd:
            ds, pv = ds.to(low).float(), p.to(low).float()
        with torch.enable_grad():
            o_of_v = torch.matmul(pv, vr)
        dq, dk = torch.autograd.grad(s, (q32, k32), ds, retain_graph=True)
        (dv,) = torch.autograd.grad(o_of_v, (v32,), do32.detach(), retain_graph=True)
        grads.append((dq, dk, dv))
    return {name: (a - b).abs().max().item()
            for name, a, b in zip(("dq", "dk", "dv"), *grads, strict=True)}


def _sequences(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end) of each sequence of a packed batch (host copies)."""
    qs, ks = cu_q.tolist(), cu_k.tolist()
    return [(qs[i], qs[i + 1], ks[i], ks[i + 1]) for i in range(len(qs) - 1)]


def _seq(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    # Rows [a, b) of a packed (total, H, D) tensor as a (1, H, b - a, D) view.
    return t[a:b].transpose(0, 1).unsqueeze(0)


def attention_ref_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_ref` of a packed batch, one sequence at a time: q (total_q, Hq, D),
    k and v (total_k, Hkv, D). Returns out (total_q, Hq, D) and lse (Hq, total_q)."""
    outs, lses = [], []
    for qa, qb, ka, kb in _sequences(cu_seqlens_q, cu_seqlens_k):
        o, lse = attention_ref(_seq(q, qa, qb), _seq(k, ka, kb), _seq(v, ka, kb), **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def varlen_reference_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                            do: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                            grads: Grads | None, *, causal: bool, softmax_scale: float | None,
                            window_size: tuple[int, int], softcap: float,
                            ) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`reference_errors` for a packed batch (lse is (Hq, total_q)): each sequence is
    checked against the fp32 reference, and each error is the max over them."""
    ref = reference(q, k, v, do if grads is not None else None, causal=causal,
                    softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return ref.errors(out, lse, grads), ref.torch_errors


def _reference_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor | None,
                    into: tuple[torch.Tensor, torch.Tensor, Grads | None],
                    kw: dict[str, Any]) -> dict[str, float]:
    """Write the fp32 reference of one slice into the views ``into`` = (out, lse, grads or
    None); return PyTorch's low-precision errors against it."""
    need_grad = do is not None
    q32, k32, v32 = (t.detach().float().requires_grad_(need_grad) for t in (q, k, v))
    ql, kl, vl = (t.detach().clone().requires_grad_(need_grad) for t in (q, k, v))
    ref_o, ref_lse = attention_ref(q32, k32, v32, upcast=True, **kw)
    low_o, low_lse = attention_ref(ql, kl, vl, upcast=False, **kw)
    into[0].copy_(ref_o.detach())
    into[1].copy_(ref_lse.detach())
    terrs = {"out": _max_err(low_o.detach(), ref_o.detach()),
             "lse": _max_err(low_lse.detach(), ref_lse.detach())}
    if do is not None:
        assert into[2] is not None
        r = torch.autograd.grad(ref_o, (q32, k32, v32), do.float())
        lg = torch.autograd.grad(low_o, (ql, kl, vl), do)
        for name, dst, rg, lowg in zip(("dq", "dk", "dv"), into[2], r, lg, strict=True):
            dst.copy_(rg)
            terrs[name] = _max_err(lowg, rg)
    return terrs


class GateCase:
    """One problem's gate inputs, drawn once from ``generator``, and their fp32 reference:
    every candidate of a search is checked on them (:meth:`check`), so the reference,
    the costly part of a gate, is computed once per problem and direction.

    ``direction="fwd"`` checks O and the LSE; ``"bwd"`` checks dq, dk and dv, on O and
    the LSE of the heuristic default forward, made once. A packed problem runs its
    representative packed batch (``Problem.packed_lengths``).
    """

    def __init__(self, problem: Any, direction: str, *, device: torch.device | str,
                 generator: torch.Generator | None = None):
        from flashtune.kernels.attn_fwd import Packed, attn_fwd
        from flashtune.kernels.config import default_fwd
        from flashtune.timing import make_inputs, packed_layout

        p = self.problem = problem
        self.direction = direction
        self.q, self.k, self.v = (t.to(device) for t in make_inputs(p, "cpu",
                                                                    generator=generator))
        layout = packed_layout(p, device)
        self.packed = None if layout is None else Packed(*layout)
        scale = default_scale(p.head_dim)
        self.kw: dict[str, Any] = dict(causal=p.causal, sm_scale=scale, window=p.window,
                                       softcap=p.softcap, packed=self.packed)
        self.do: torch.Tensor | None = None
        self.fwd_out: tuple[torch.Tensor, torch.Tensor] | None = None
        if direction == "bwd":
            self.do = torch.randn(self.q.shape, generator=generator,
                                  dtype=torch.float32).to(device, self.q.dtype)
            self.fwd_out = attn_fwd(self.q, self.k, self.v, config=default_fwd(p), **self.kw)
        self.ref = reference(
            self.q, self.k, self.v, self.do, causal=p.causal, softmax_scale=scale,
            window_size=p.window, softcap=p.softcap,
            cu_seqlens_q=None if self.packed is None else self.packed.cu_q,
            cu_seqlens_k=None if self.packed is None else self.packed.cu_k)

    def check(self, config: Any, factor: float = 2.0) -> Comparison:
        """Run ``config`` on the case's inputs and judge its outputs under the 2x rule.

        The outputs are then filled with NaN before they go back to PyTorch's allocator:
        a later candidate that leaves part of its output unwritten, in memory that held
        this one's correct answer, must not pass on it."""
        from flashtune.kernels.attn_bwd import attn_bwd
        from flashtune.kernels.attn_fwd import attn_fwd

        q, k, v, kw = self.q, self.k, self.v, self.kw
        if self.direction == "fwd":
            o, lse = attn_fwd(q, k, v, config=config, **kw)
            errs = self.ref.errors(o, lse)
            outs: tuple[torch.Tensor, ...] = (o, lse)
        else:
            assert self.do is not None and self.fwd_out is not None
            o, lse = self.fwd_out
            grads = attn_bwd(self.do, q, k, v, o, lse, config=config,
                             deterministic=self.problem.deterministic, **kw)
            errs = self.ref.errors(o, lse, grads)
            errs = {n: errs[n] for n in ("dq", "dk", "dv")}  # judged on its own outputs
            outs = tuple(grads)
        ok, ratio, detail = within_rule(errs, self.ref.torch_errors, factor)
        for t in outs:
            t.fill_(math.nan)
        return Comparison(ok, max(errs.values()), ratio, detail, errs)


def compare(problem: Any, direction: str, config: Any, *, device: torch.device | str,
            generator: torch.Generator | None = None, factor: float = 2.0) -> Comparison:
    """The correctness gate on one set of fresh random inputs: ``GateCase(...).check``."""
    return GateCase(problem, direction, device=device, generator=generator).check(config, factor)
