"""fp32 (or fp64) reference attention with exactly the kernels' semantics.

Used by the tests and by the tuner's correctness gate. ``upcast=False`` computes in
the inputs' own dtype, which is "PyTorch's own low-precision error" in the 2x rule.
"""

from __future__ import annotations

import math
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


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, upcast: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse). out has q's dtype; lse is fp32 (B, Hq, Sq), +inf on empty rows."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    scale = softmax_scale if softmax_scale is not None else default_scale(d)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    vis = visibility(sq, sk, causal, window_size, q.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
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


def reference_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor | None,
                     out: torch.Tensor, lse: torch.Tensor,
                     grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, *,
                     causal: bool, softmax_scale: float | None, window_size: tuple[int, int],
                     softcap: float) -> tuple[dict[str, float], dict[str, float]]:
    """(errors of the candidate, errors of PyTorch's own low-precision path), both against
    the fp32 reference, for out/lse and, when ``grads`` is given, dq/dk/dv.

    Large problems are checked slice by slice (one batch entry and a group of KV heads
    with their query heads at a time); every error is a max, so the result is the same.
    """
    kw: dict[str, Any] = dict(causal=causal, softmax_scale=softmax_scale,
                              window_size=window_size, softcap=softcap)
    b, hq, sq = q.shape[:3]
    hk, sk = k.shape[1], k.shape[2]
    group = hq // hk
    if b * hq * sq * sk <= REF_CHUNK_SCORES:
        return _errors_one(q, k, v, do, out, lse, grads, kw)
    step = max(1, REF_CHUNK_SCORES // (group * sq * sk))
    errs: dict[str, float] = {}
    terrs: dict[str, float] = {}
    for bi in range(b):
        for h0 in range(0, hk, step):
            h1 = min(hk, h0 + step)

            def qs(t: torch.Tensor) -> torch.Tensor:
                return t[bi:bi + 1, h0 * group:h1 * group]  # noqa: B023 - used at once

            def ks(t: torch.Tensor) -> torch.Tensor:
                return t[bi:bi + 1, h0:h1]  # noqa: B023 - used at once

            g = None if grads is None else (qs(grads[0]), ks(grads[1]), ks(grads[2]))
            e, te = _errors_one(qs(q), ks(k), ks(v), None if do is None else qs(do),
                                qs(out), qs(lse), g, kw)
            for name in e:
                errs[name] = max(errs.get(name, 0.0), e[name])
                terrs[name] = max(terrs.get(name, 0.0), te[name])
    return errs, terrs


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
                            grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, *,
                            causal: bool, softmax_scale: float | None,
                            window_size: tuple[int, int], softcap: float,
                            ) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`reference_errors` for a packed batch (lse is (Hq, total_q)): each sequence is
    checked on its own against the fp32 reference, and each error is the max over them."""
    kw: dict[str, Any] = dict(causal=causal, softmax_scale=softmax_scale,
                              window_size=window_size, softcap=softcap)
    errs: dict[str, float] = {}
    terrs: dict[str, float] = {}
    for qa, qb, ka, kb in _sequences(cu_seqlens_q, cu_seqlens_k):
        g = None if grads is None else (_seq(grads[0], qa, qb), _seq(grads[1], ka, kb),
                                        _seq(grads[2], ka, kb))
        e, te = _errors_one(_seq(q, qa, qb), _seq(k, ka, kb), _seq(v, ka, kb),
                            None if do is None else _seq(do, qa, qb), _seq(out, qa, qb),
                            lse[None, :, qa:qb], g, kw)
        for name in e:
            errs[name] = max(errs.get(name, 0.0), e[name])
            terrs[name] = max(terrs.get(name, 0.0), te[name])
    return errs, terrs


def _errors_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor | None,
                out: torch.Tensor, lse: torch.Tensor,
                grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                kw: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    need_grad = grads is not None
    q32, k32, v32 = (t.detach().float().requires_grad_(need_grad) for t in (q, k, v))
    ql, kl, vl = (t.detach().clone().requires_grad_(need_grad) for t in (q, k, v))
    ref_o, ref_lse = attention_ref(q32, k32, v32, upcast=True, **kw)
    low_o, low_lse = attention_ref(ql, kl, vl, upcast=False, **kw)
    errs = {"out": _max_err(out, ref_o.detach()), "lse": _max_err(lse, ref_lse.detach())}
    terrs = {"out": _max_err(low_o.detach(), ref_o.detach()),
             "lse": _max_err(low_lse.detach(), ref_lse.detach())}
    if grads is not None:
        assert do is not None
        r = torch.autograd.grad(ref_o, (q32, k32, v32), do.float())
        lg = torch.autograd.grad(low_o, (ql, kl, vl), do)
        for name, g, rg, lowg in zip(("dq", "dk", "dv"), grads, r, lg, strict=True):
            errs[name] = _max_err(g, rg)
            terrs[name] = _max_err(lowg, rg)
    return errs, terrs


def compare(problem: Any, direction: str, config: Any, *, device: torch.device | str,
            generator: torch.Generator | None = None, factor: float = 2.0) -> Comparison:
    """The correctness gate: run ``config`` on fresh random inputs for ``problem`` and
    check it against the fp32 reference under the 2x rule.

    ``direction="fwd"`` checks O and the LSE (config: FwdConfig); ``"bwd"`` checks dq, dk
    and dv (config: BwdConfig; the forward runs with the heuristic default). A packed
    problem runs its representative packed batch (``Problem.packed_lengths``).
    """
    from flashtune.kernels.attn_bwd import attn_bwd
    from flashtune.kernels.attn_fwd import Packed, attn_fwd
    from flashtune.kernels.config import default_fwd
    from flashtune.timing import make_inputs, packed_layout

    p = problem
    q, k, v = (t.to(device) for t in make_inputs(p, "cpu", generator=generator))
    layout = packed_layout(p, device)
    packed = None if layout is None else Packed(*layout)
    scale = default_scale(p.head_dim)
    kw = dict(causal=p.causal, sm_scale=scale, window=p.window, softcap=p.softcap, packed=packed)
    fcfg = config if direction == "fwd" else default_fwd(p)
    o, lse = attn_fwd(q, k, v, config=fcfg, **kw)
    do = grads = None
    if direction == "bwd":
        do = torch.randn(q.shape, generator=generator, dtype=torch.float32).to(device, q.dtype)
        grads = attn_bwd(do, q, k, v, o, lse, config=config, deterministic=p.deterministic,
                         **kw)
    ref_kw: dict[str, Any] = dict(causal=p.causal, softmax_scale=scale, window_size=p.window,
                                  softcap=p.softcap)
    if packed is None:
        errs, terrs = reference_errors(q, k, v, do, o, lse, grads, **ref_kw)
    else:
        errs, terrs = varlen_reference_errors(q, k, v, packed.cu_q, packed.cu_k, do, o, lse,
                                              grads, **ref_kw)
    if direction == "bwd":  # the gate for a backward config judges its own outputs
        errs = {n: errs[n] for n in ("dq", "dk", "dv")}
    ok, ratio, detail = within_rule(errs, terrs, factor)
    return Comparison(ok, max(errs.values()), ratio, detail, errs)
