"""Packed (varlen) batches: the kernels against the fp32 reference, sequence by sequence,
under the 2x rule for the output, the LSE and all three gradients."""

from __future__ import annotations

import random

import pytest
import torch

import flashtune
from flashtune.kernels.attn_bwd import attn_bwd
from flashtune.kernels.attn_fwd import Packed, attn_fwd
from flashtune.kernels.config import (
    BWD_ATOMIC,
    BWD_FUSED,
    BWD_ONE_LAUNCH,
    BWD_TWO_KERNEL,
    BwdConfig,
    FwdConfig,
    default_bwd,
    default_fwd,
)
from flashtune.kernels.reference import flash_errors, reference, within_rule
from flashtune.kernels.varlen import flash_attn_varlen_func
from flashtune.problem import Problem, default_scale

from .helpers import DTYPES, random_config, rounding_floored


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
                 deterministic: bool = True) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = make_packed(lens_q, lens_k, hq, hk, d, dtype, device, gen)
    packed = Packed(cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), max(lens_q),
                    max(lens_k))
    # The packed problem, as the entry points make it: its defaults are a packed batch's
    # (a dense problem's Hopper forward may take defer_o, which a packed batch refuses).
    p = Problem(len(lens_q), hq, hk, max(max(lens_q), 1), max(max(lens_k), 1), d, dtype, causal,
                window, softcap, total_q=sum(lens_q), total_k=sum(lens_k))
    kw = dict(causal=causal, sm_scale=default_scale(d), window=window, softcap=softcap,
              packed=packed)
    o, lse = attn_fwd(q, k, v, config=fwd or default_fwd(p), **kw)
    assert o.shape == q.shape and lse.shape == (hq, q.shape[0]) and lse.dtype == torch.float32
    grads = attn_bwd(do, q, k, v, o, lse, config=bwd or default_bwd(p),
                     deterministic=deterministic, **kw)
    ref = reference(q, k, v, do, causal=causal, softmax_scale=None, window_size=window,
                    softcap=softcap, cu_seqlens_q=packed.cu_q, cu_seqlens_k=packed.cu_k)
    errs = ref.errors(o, lse, grads)
    # These batches are tiny: PyTorch's own error is floored at the output's rounding and,
    # for the gradients, at the FlashAttention backward's own roundings given this output.
    flash = flash_errors(q, k, v, do, o, causal=causal, softmax_scale=None, window_size=window,
                         softcap=softcap, cu_seqlens_q=packed.cu_q, cu_seqlens_k=packed.cu_k)
    ok, _, detail = within_rule(errs, rounding_floored(ref, DTYPES[dtype], flash))
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


@pytest.mark.parametrize("variant", [BWD_TWO_KERNEL, BWD_ATOMIC, BWD_ONE_LAUNCH, BWD_FUSED])
def test_varlen_every_backward_variant(variant: int, device: str, seed: int) -> None:
    """Packed batches run every portable backward variant (GQA, causal bottom-right per
    sequence, empty and length-1 sequences)."""
    rng = random.Random(seed)
    lens_q, lens_k = random_lengths(rng, 4, 1, 40), random_lengths(rng, 4, 1, 50)
    det = variant != BWD_ATOMIC
    p = Problem(4, 4, 2, max(lens_q), max(lens_k), 40, "fp16", True, deterministic=det,
                total_q=sum(lens_q), total_k=sum(lens_k))
    check_varlen(lens_q, lens_k, 4, 2, 40, "fp16", True, (-1, -1), 0.0, device, seed,
                 bwd=random_config(BwdConfig, p, rng, max_block=32, variant=variant),
                 deterministic=det)


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


# ----------------------------------------------------------------------------- public function


def _public_inputs(device: str, seed: int, lens_q: list[int], lens_k: list[int], hq: int = 4,
                   hk: int = 2, d: int = 32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = make_packed(lens_q, lens_k, hq, hk, d, "bf16", device, gen)
    return q, k, v, do, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)


def test_flash_attn_varlen_func_autograd_matches_reference(device: str, seed: int) -> None:
    lens_q, lens_k = [9, 0, 1, 23], [12, 3, 1, 20]
    q, k, v, do, cu_q, cu_k = _public_inputs(device, seed, lens_q, lens_k)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    kw = dict(causal=True, window_size=(7, -1), softcap=3.0)
    out, lse = flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k),
                                      return_lse=True, deterministic=True, **kw)
    grads = torch.autograd.grad(out, (qg, kg, vg), do)
    ref = reference(q, k, v, do, softmax_scale=None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    flash = flash_errors(q, k, v, do, out, softmax_scale=None, cu_seqlens_q=cu_q,
                         cu_seqlens_k=cu_k, **kw)
    ok, _, detail = within_rule(ref.errors(out, lse, grads), rounding_floored(ref, q.dtype, flash))
    assert ok, detail


def test_flash_attn_varlen_func_is_served_by_the_dispatcher(device: str, seed: int, tmp_path,
                                                            monkeypatch) -> None:
    from flashtune import dispatch
    from tests.dispatch.test_dispatch import fresh_db

    fixture = fresh_db(tmp_path, monkeypatch)
    next(fixture)
    q, k, v, _, cu_q, cu_k = _public_inputs(device, seed, [5, 7], [5, 7])
    for _ in range(2):  # the second call is served from the dispatcher's memory
        flashtune.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, causal=True)
    assert dispatch.stats()["first_sights"] == 1
    assert dispatch.stats()["misses"] == 1
    next(fixture, None)


def test_flash_attn_varlen_func_torch_compile_fullgraph(device: str, seed: int) -> None:
    if torch.cuda.is_available():
        pytest.skip("the GPU suite compiles with inductor")
    lens = [6, 1, 13]
    q, k, v, do, cu_q, cu_k = _public_inputs(device, seed, lens, lens)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 13, causal=True) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ys = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    oc, oe = compiled(*xs), f(*ys)
    assert torch.equal(oc, oe)
    for a, b in zip(torch.autograd.grad(oc, xs, do), torch.autograd.grad(oe, ys, do),
                    strict=True):
        assert torch.equal(a, b)


def _bad(device: str, **over: object) -> dict[str, object]:
    q = torch.randn(10, 4, 32).to(device, torch.float16)
    k = torch.randn(12, 2, 32).to(device, torch.float16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    args: dict[str, object] = dict(q=q, k=k, v=k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   max_seqlen_q=6, max_seqlen_k=7)
    args.update(over)
    return args


@pytest.mark.parametrize("over, exc, match", [
    (lambda d: {"q": torch.randn(1, 10, 4, 32).to(d, torch.float16)}, ValueError,
     r"q must be 3-D \(total_tokens, heads, head_dim\).*\(1, 10, 4, 32\)"),
    (lambda d: {"cu_seqlens_q": torch.tensor([0, 4, 10], device=d)}, TypeError,
     r"cu_seqlens_q must be a 1-D torch.int32 tensor.*torch.int64"),
    (lambda d: {"cu_seqlens_q": torch.tensor([0, 9, 4, 9, 10, 9], dtype=torch.int32,
                                             device=d)[::2]},
     ValueError, r"cu_seqlens_q must be contiguous \(stride 1\), got stride 2"),
    (lambda d: {"cu_seqlens_k": torch.tensor([0, 12], dtype=torch.int32, device=d)},
     ValueError, r"cu_seqlens_q and cu_seqlens_k must have one length.*3 and 2"),
    (lambda d: {"max_seqlen_q": -1}, ValueError, r"max_seqlen_q must be an int >= 0, got -1"),
    (lambda d: {"max_seqlen_k": 7.0}, ValueError, r"max_seqlen_k must be an int"),
    (lambda d: {"q": torch.randn(10, 3, 32).to(d, torch.float16)}, ValueError,
     r"q heads = 3 must be a multiple of k/v heads = 2"),
    (lambda d: {"q": torch.randn(10, 4, 32).to(d)}, TypeError,
     r"q.dtype must be torch.float16 or torch.bfloat16, got torch.float32"),
    (lambda d: {"causal": 1}, TypeError, r"causal must be a bool, got 1"),
    (lambda d: {"deterministic": "yes"}, TypeError, r"deterministic must be a bool"),
])
def test_flash_attn_varlen_func_bad_arguments(over, exc, match, device: str) -> None:  # type: ignore
    with pytest.raises(exc, match=match):
        flash_attn_varlen_func(**_bad(device, **over(device)))  # type: ignore[arg-type]


def test_flash_attn_varlen_func_rejects_infeasible_forced_config(device: str) -> None:
    from flashtune.exceptions import InfeasibleConfigError

    with pytest.raises(InfeasibleConfigError, match="warps"):
        flash_attn_varlen_func(**_bad(device), config=BwdConfig(dkdv_block_n=16,  # type: ignore
                                                                 dkdv_warps=16))
