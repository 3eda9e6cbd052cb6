"""The fp32 reference checks large problems slice by slice, with the same result."""

from __future__ import annotations

import pytest
import torch

from flashtune.kernels import reference


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (3, 2))])
def test_sliced_reference_errors_equal_whole(monkeypatch: pytest.MonkeyPatch, seed: int,
                                             causal: bool, window: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, hq, hk, sq, sk, d = 2, 6, 2, 9, 13, 16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    q, k, v, do = randn(b, hq, sq, d), randn(b, hk, sk, d), randn(b, hk, sk, d), randn(b, hq, sq, d)
    kw = dict(causal=causal, softmax_scale=None, window_size=window, softcap=0.0)
    # A "candidate": the low-precision path with some noise, so every error is non-zero.
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention_ref(qg, kg, vg, upcast=False, causal=causal,
                                       window_size=window)
    grads = torch.autograd.grad(out, (qg, kg, vg), do)
    out = out.detach() + 0.01 * randn(*out.shape)
    grads = tuple(g + 0.01 * randn(*g.shape) for g in grads)
    whole = reference.reference_errors(q, k, v, do, out, lse.detach(), grads, **kw)
    monkeypatch.setattr(reference, "REF_CHUNK_SCORES", 3 * sq * sk)  # one KV head a slice
    sliced = reference.reference_errors(q, k, v, do, out, lse.detach(), grads, **kw)
    for w, s in zip(whole, sliced, strict=True):
        assert set(w) == set(s) == {"out", "lse", "dq", "dk", "dv"}
        for name in w:
            assert s[name] == pytest.approx(w[name], rel=1e-4), name
    assert all(v > 0 for v in whole[0].values())
