"""Packed (varlen) attention on the GPU at realistic sizes: the 2x rule per sequence,
bit-identical backward, CUDA graphs, inductor, and torch's SDPA routed to flashtune."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from flashtune.kernels.config import (
    BWD_ATOMIC,
    BWD_FUSED,
    BWD_ONE_LAUNCH,
    BWD_TWO_KERNEL,
    BwdConfig,
    FwdConfig,
    default_bwd,
)
from flashtune.kernels.varlen import flash_attn_varlen_func
from flashtune.problem import Problem

from .helpers import check_graph_replay, random_config
from .test_varlen import check_varlen, cu_seqlens, make_packed, random_lengths

pytestmark = pytest.mark.gpu

# (Hq, Hkv, D, causal, window, softcap, same lengths for q and k)
CASES = [
    (32, 8, 128, True, (-1, -1), 0.0, True),
    (16, 16, 64, False, (-1, -1), 0.0, False),
    (32, 8, 128, True, (-1, -1), 0.0, False),
    (8, 2, 128, True, (511, 0), 0.0, True),
    (8, 8, 96, True, (-1, -1), 30.0, True),
    (16, 4, 256, True, (-1, -1), 0.0, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}k{c[1]}-d{c[2]}-c{int(c[3])}"
                         f"-w{c[4][0]}-cap{c[5]:g}-{'same' if c[6] else 'diff'}")
def test_varlen_realistic_sizes(case: tuple, seed: int) -> None:
    hq, hk, d, causal, win, cap, same = case
    rng = random.Random(seed)
    lens_q = random_lengths(rng, 12, 1, 3000)
    lens_k = list(lens_q) if same else random_lengths(rng, 12, 1, 3000)
    for dtype in ("bf16", "fp16"):
        check_varlen(lens_q, lens_k, hq, hk, d, dtype, causal, win, cap, "cuda", seed)


def test_varlen_random_large_configs(seed: int) -> None:
    rng = random.Random(seed)
    lens = random_lengths(rng, 8, 100, 2000)
    p = Problem(8, 16, 4, max(lens), max(lens), 128, "bf16", True)
    for _ in range(4):
        check_varlen(lens, lens, 16, 4, 128, "bf16", True, (-1, -1), 0.0, "cuda", seed,
                     fwd=random_config(FwdConfig, p, rng, max_block=128, max_stages=4),
                     bwd=random_config(BwdConfig, p, rng, max_block=128, max_stages=4))


@pytest.mark.parametrize("variant", [BWD_TWO_KERNEL, BWD_ATOMIC, BWD_ONE_LAUNCH, BWD_FUSED])
def test_varlen_every_backward_variant_large(variant: int, seed: int) -> None:
    rng = random.Random(seed)
    lens = random_lengths(rng, 8, 100, 2000)
    det = variant != BWD_ATOMIC
    p = Problem(8, 16, 4, max(lens), max(lens), 128, "bf16", True, deterministic=det,
                total_q=sum(lens), total_k=sum(lens))
    for _ in range(3):
        check_varlen(lens, lens, 16, 4, 128, "bf16", True, (-1, -1), 0.0, "cuda", seed,
                     bwd=random_config(BwdConfig, p, rng, max_block=128, max_stages=4,
                                       variant=variant), deterministic=det)


@pytest.mark.parametrize("variant", [None, BWD_TWO_KERNEL, BWD_ONE_LAUNCH, BWD_FUSED])
def test_varlen_64_sequences_64k_tokens_bit_identical(variant: int | None, seed: int) -> None:
    """The benchmark's shape: gradients bit-identical from run to run, outputs finite, for
    the default backward and each deterministic variant."""
    import math

    rng = random.Random(seed)
    lens = [int(math.exp(rng.uniform(math.log(128), math.log(2048)))) for _ in range(64)]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = make_packed(lens, lens, 32, 8, 128, "bf16", "cuda", gen)
    cu = cu_seqlens(lens, "cuda")
    cfg = None
    if variant is not None:
        p = Problem(64, 32, 8, max(lens), max(lens), 128, "bf16", True, total_q=sum(lens),
                    total_k=sum(lens))
        cfg = default_bwd(p, variant)

    def run() -> tuple[torch.Tensor, ...]:
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        o = flash_attn_varlen_func(*xs, cu, cu, max(lens), max(lens), causal=True, config=cfg)
        return (o, *torch.autograd.grad(o, xs, do))

    a, b = run(), run()
    for x, y in zip(a, b, strict=True):
        assert torch.isfinite(x).all() and torch.equal(x, y)


def test_varlen_cuda_graph_and_inductor(seed: int) -> None:
    lens = [300, 1, 0, 1000, 77]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = make_packed(lens, lens, 8, 2, 128, "bf16", "cuda", gen)
    cu = cu_seqlens(lens, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step() -> tuple[torch.Tensor, ...]:
        o = flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, causal=True)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    check_graph_replay(step, (q, k, v), gen)

    compiled = torch.compile(lambda a, b, c: flash_attn_varlen_func(
        a, b, c, cu, cu, 1000, 1000, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), step()[0])


@pytest.mark.skipif(not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
                    reason="this torch has no flash-attention registry (before 2.13)")
def test_activate_routes_cuda_sdpa_to_flashtune(seed: int) -> None:
    from torch.nn import attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtune import sdpa

    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(2, 16, 1024, 128, generator=g).to("cuda", torch.bfloat16)
                   for _ in range(4))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    before = sdpa.calls["torch_fwd"]
    attention.activate_flash_attention_impl("flashtune")
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        attention.restore_flash_attention_impl()
    assert sdpa.calls["torch_fwd"] == before + 1
    assert (out.float() - ref).abs().max().item() < 2e-2
