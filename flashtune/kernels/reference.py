"""fp32 (or fp64) reference attention with exactly the kernels' semantics.

Used by the tests and by the tuner's correctness gate. ``upcast=False`` computes in
the inputs' own dtype, which is "PyTorch's own low-precision error" in the 2x rule.
"""

from __future__ import annotations

import math

import torch


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
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
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
