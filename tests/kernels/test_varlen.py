"""Packed (varlen) batches: the kernels against the fp32 reference, sequence by sequence,
under the 2x rule for the output, the LSE and all three gradients."""

from __future__ import annotations

import random

import pytest
import torch

from flashtune.kernels.attn_bwd import attn_bwd
from flashtune.kernels.attn_fwd import Packed, attn_fwd
from flashtune.kernels.config import BwdConfig, FwdConfig, default_bwd, default_fwd
from flashtune.kernels.reference import varlen_reference_errors, within_rule
from flashtune.problem import Problem, default_scale

from .helpers import DTYPES, random_config


def random_lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    """``n`` lengths in [lo, hi] with a length-1 sequence between two empty neighbours."""
    lens = [rng.randint(lo, hi) for _ in range(n)]
    i = rng.randrange(1, n - 1)
    lens[i - 1:i + 2] = [0, 1, 0]
    return lens


def cu_seqlens(lens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def make_packed(lens_q: list[int], lens_k: list[int], hq: int, hk: int, d: int, dtype: str,
                device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dt = DTYPES[dtype]

    def rnd(total: int, h: int) -> torch.Tensor:
        return torch.randn(total, h, d, generator=gen).to(device, dt)

    tq, tk = sum(lens_q), sum(lens_k)
    return rnd(tq, hq), rnd(tk, hk), rnd(tk, hk), rnd(tq, hq)


def check_varlen(lens_q: list[int], lens_k: list[int], hq: int, hk: int, d: int, dtype: str,
                 causal: bool, window: tuple[int, int], softcap: float, device: str,
                 seed: int, fwd: FwdConfig | None = None, bwd: BwdConfig | None = None,
                 ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = make_packed(lens_q, lens_k, hq, hk, d, dtype, device, gen)
    packed = Packed(cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), max(lens_q),
                    max(lens_k))
    p = Problem(len(lens_q), hq, hk, max(max(lens_q), 1), max(max(lens_k), 1), d, dtype, causal,
                window, softcap)
    kw = dict(causal=causal, sm_scale=default_scale(d), window=window, softcap=softcap,
              packed=packed)
    o, lse = attn_fwd(q, k, v, config=fwd or default_fwd(p), **kw)
    assert o.shape == q.shape and lse.shape == (hq, q.shape[0]) and lse.dtype == torch.float32
    grads = attn_bwd(do, q, k, v, o, lse, config=bwd or default_bwd(p), **kw)
    errs, terrs = varlen_reference_errors(q, k, v, packed.cu_q, packed.cu_k, do, o, lse, grads,
                                          causal=causal, softmax_scale=None, window_size=window,
                                          softcap=softcap)
    ok, _, detail = within_rule(errs, terrs)
    assert ok, f"seed={seed} lens_q={lens_q} lens_k={lens_k}: {detail} (all: {errs})"
    return (o, lse, *grads)


# (Hq, Hkv, D, dtype, causal, window, softcap, same lengths for q and k)
CASES = [
    (4, 2, 32, "fp16", False, (-1, -1), 0.0, False),
    (2, 2, 40, "bf16", True, (-1, -1), 0.0, True),
    (4, 1, 32, "bf16", True, (-1, -1), 0.0, False),
    (2, 1, 32, "fp16", False, (6, 3), 0.0, False),
    (2, 2, 16, "bf16", True, (9, -1), 0.0, True),
    (4, 2, 32, "fp16", True, (-1, -1), 4.0, False),
]


def _id(c: tuple) -> str:
    hq, hk, d, dt, causal, win, cap, same = c
    return (f"h{hq}k{hk}-d{d}-{dt}-{'c' if causal else 'n'}-w{win[0]}_{win[1]}-cap{cap:g}"
            f"-{'sq=sk' if same else 'sq!=sk'}")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_varlen_matches_reference(case: tuple, device: str, seed: int) -> None:
    hq, hk, d, dt, causal, win, cap, same = case
    rng = random.Random(seed)
    lens_q = random_lengths(rng, 5, 2, 40)
    lens_k = list(lens_q) if same else random_lengths(rng, 5, 2, 40)
    check_varlen(lens_q, lens_k, hq, hk, d, dt, causal, win, cap, device, seed)


def test_varlen_random_configs(device: str, seed: int) -> None:
    rng = random.Random(seed)
    lens_q, lens_k = random_lengths(rng, 4, 1, 50), random_lengths(rng, 4, 1, 50)
    p = Problem(4, 2, 1, max(lens_q), max(lens_k), 32, "bf16", True)
    check_varlen(lens_q, lens_k, 2, 1, 32, "bf16", True, (-1, -1), 0.0, device, seed,
                 fwd=random_config(FwdConfig, p, rng, max_block=32),
                 bwd=random_config(BwdConfig, p, rng, max_block=32))


def test_varlen_equals_dense_per_sequence_and_is_deterministic(device: str, seed: int) -> None:
    """A packed batch gives, row for row, what the dense kernels give on each sequence alone
    (same config, same tiles), and the same bits on a second run."""
    lens_q, lens_k = [17, 1, 30], [25, 4, 30]
    args = (lens_q, lens_k, 4, 2, 32, "bf16", True, (-1, -1), 0.0, device, seed)
    first = check_varlen(*args)
    assert all(torch.equal(a, b) for a, b in zip(first, check_varlen(*args), strict=True))
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = make_packed(lens_q, lens_k, 4, 2, 32, "bf16", device, gen)
    p = Problem(1, 4, 2, 30, 30, 32, "bf16", True)
    kw = dict(causal=True, sm_scale=default_scale(32), window=(-1, -1), softcap=0.0)
    cq, ck = cu_seqlens(lens_q, device).tolist(), cu_seqlens(lens_k, device).tolist()
    for i in range(len(lens_q)):
        qs, ks, vs, dos = (t[a:b].transpose(0, 1)[None] for t, a, b in (
            (q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1]),
            (do, cq[i], cq[i + 1])))
        o, lse = attn_fwd(qs, ks, vs, config=default_fwd(p), **kw)
        dq, dk, dv = attn_bwd(dos, qs, ks, vs, o, lse, config=default_bwd(p), **kw)
        for dense, packed_t, a, b in ((o, first[0], cq[i], cq[i + 1]),
                                      (dq, first[2], cq[i], cq[i + 1]),
                                      (dk, first[3], ck[i], ck[i + 1]),
                                      (dv, first[4], ck[i], ck[i + 1])):
            assert torch.equal(dense[0].transpose(0, 1), packed_t[a:b])
        assert torch.equal(lse[0], first[1][:, cq[i]:cq[i + 1]])
