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


def test_sliced_packed_reference_equals_whole(monkeypatch: pytest.MonkeyPatch,
                                              seed: int) -> None:
    """A packed batch's reference, sequence by sequence and head group by head group,
    matches the one made a sequence at a time with every head, and each sequence's slice
    of it matches the dense reference of that sequence alone."""
    gen = torch.Generator().manual_seed(seed)
    lens, hq, hk, d = [5, 11, 8], 4, 2, 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    q, k, v, do = randn(total, hq, d), randn(total, hk, d), randn(total, hk, d), \
        randn(total, hq, d)
    kw = dict(causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0)
    whole = reference.reference(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    monkeypatch.setattr(reference, "REF_CHUNK_SCORES", 2 * 11 * 11)  # one KV head a slice
    sliced = reference.reference(q, k, v, do, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    assert whole.grads is not None and sliced.grads is not None
    for a, b in zip((whole.out, whole.lse, *whole.grads), (sliced.out, sliced.lse,
                                                           *sliced.grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert whole.torch_errors == pytest.approx(sliced.torch_errors, rel=1e-4)
    a, b = int(cu[1]), int(cu[2])  # the second sequence, alone
    seq = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v, do)]
    dense = reference.reference(*seq, **kw)
    torch.testing.assert_close(dense.out[0].transpose(0, 1), whole.out[a:b])
    torch.testing.assert_close(dense.lse[0], whole.lse[:, a:b])
    assert dense.grads is not None
    torch.testing.assert_close(dense.grads[1][0].transpose(0, 1), whole.grads[1][a:b])


def test_flash_errors_match_a_hand_written_backward(monkeypatch: pytest.MonkeyPatch,
                                                    seed: int) -> None:
    """``flash_errors``: each gradient's max difference between two fp64 backwards written
    out by hand, one exact and one that forms delta = rowsum(dO * O) from a given output
    and rounds P (for dV) and dS (for dQ and dK) to bfloat16; GQA, soft-capping, a window
    and rows with no visible key included, dense and as a packed batch."""
    gen = torch.Generator().manual_seed(seed)
    b, hq, hk, sq, sk, d, cap, window = 2, 4, 2, 11, 7, 16, 3.0, (4, -1)
    bf = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(bf)

    q, k, v, do = randn(b, hq, sq, d), randn(b, hk, sk, d), randn(b, hk, sk, d), randn(b, hq, sq, d)
    kw = dict(causal=True, softmax_scale=None, window_size=window, softcap=cap)
    out, _ = reference.attention_ref(q, k, v, **kw)  # rounded to bf16
    out = out + 0.01 * randn(*out.shape)

    q64, do64 = q.double(), do.double()
    k64, v64 = (t.double().repeat_interleave(hq // hk, dim=1) for t in (k, v))
    scale = d ** -0.5
    t = torch.tanh(q64 @ k64.transpose(-1, -2) * scale / cap)
    i = torch.arange(sq)[:, None] + (sk - sq)  # bottom-right aligned: rows 0-3 see no key
    j = torch.arange(sk)[None, :]
    visible = (j <= i) & (j >= i - window[0])
    assert not visible[:4].any() and visible[4:].any(-1).all()
    p = torch.softmax((cap * t).masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    dp = do64 @ v64.transpose(-1, -2)

    def by_kv_head(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(1, (hk, hq // hk)).sum(2)

    grads = []
    for o, rnd in ((p @ v64, False), (out.double(), True)):
        ds = p * (dp - (do64 * o).sum(-1, keepdim=True))
        pv = p
        if rnd:
            ds, pv = ds.to(bf).double(), p.to(bf).double()
        ds = ds * (1 - t * t) * scale
        grads.append((ds @ k64, by_kv_head(ds.transpose(-1, -2) @ q64),
                      by_kv_head(pv.transpose(-1, -2) @ do64)))
    want = {name: (a - e).abs().max().item()
            for name, a, e in zip(("dq", "dk", "dv"), grads[1], grads[0], strict=True)}
    assert all(e > 0 for e in want.values())
    # fp32 against fp64 with the same roundings; one bf16 rounding may land the other way.
    got = reference.flash_errors(q, k, v, do, out, **kw)
    assert got == pytest.approx(want, rel=0.02)
    # The same two sequences packed, with an empty one between them.
    cu_q = torch.tensor([0, sq, sq, 2 * sq], dtype=torch.int32)
    cu_k = torch.tensor([0, sk, sk, 2 * sk], dtype=torch.int32)

    def pack(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).flatten(0, 1)

    packed = reference.flash_errors(*(pack(x) for x in (q, k, v, do, out)), cu_seqlens_q=cu_q,
                                    cu_seqlens_k=cu_k, **kw)
    assert packed == pytest.approx(got, rel=1e-5)
    # In the reference's slices (at S=16k one piece would hold tens of GiB of scores):
    # one batch entry and KV head at a time here, with the same errors.
    pieces = []
    whole_fn = reference._flash_errors

    def counted(q: torch.Tensor, *args: object) -> dict[str, float]:
        pieces.append(tuple(q.shape))
        return whole_fn(q, *args)

    monkeypatch.setattr(reference, "_flash_errors", counted)
    monkeypatch.setattr(reference, "REF_CHUNK_SCORES", (hq // hk) * sq * sk)
    sliced = reference.flash_errors(q, k, v, do, out, **kw)
    assert pieces == [(1, hq // hk, sq, d)] * (b * hk)
    assert sliced == pytest.approx(got, rel=1e-5)
