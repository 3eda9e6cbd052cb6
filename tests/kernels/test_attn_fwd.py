"""Forward kernel vs the fp32 reference (2x rule), under the interpreter in CI and at
realistic sizes on a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from flashtune.kernels.config import FwdConfig, default_fwd
from flashtune.problem import Problem

from .helpers import case_id, case_problem, check_case, random_config

# (B, Hq, Hkv, Sq, Sk, D, dtype, causal, window, softcap, layout)
CASES = [
    (1, 2, 2, 1, 33, 32, "fp16", False, (-1, -1), 0.0, "bhsd"),
    (1, 2, 2, 1, 33, 32, "bf16", True, (-1, -1), 0.0, "bshd"),
    (2, 4, 1, 17, 45, 32, "bf16", False, (-1, -1), 0.0, "bhsd"),     # GQA 4:1
    (1, 4, 1, 97, 130, 80, "fp16", True, (-1, -1), 0.0, "bshd"),     # Sq < Sk, causal
    (1, 3, 1, 130, 97, 80, "bf16", True, (-1, -1), 0.0, "bhsd"),     # MQA, Sq > Sk: empty rows
    (1, 2, 1, 97, 61, 128, "fp16", False, (16, 8), 0.0, "dpad"),     # window
    (1, 2, 2, 130, 130, 32, "bf16", True, (24, -1), 0.0, "bshd"),    # causal + window
    (1, 4, 2, 17, 130, 128, "fp16", False, (-1, -1), 30.0, "bhsd"),  # softcap
    (1, 2, 1, 97, 97, 80, "bf16", True, (-1, -1), 5.0, "dpad"),      # softcap + causal
    (1, 2, 2, 130, 17, 32, "fp16", False, (3, 40), 0.0, "bhsd"),     # lopsided window
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_matches_reference(case: tuple, device: str, seed: int) -> None:
    p, layout = case_problem(case), case[-1]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # The heuristic default plus two random feasible configs: the kernel must be right for
    # any config the tuner may pick, not only the default.
    configs = [default_fwd(p)] + [random_config(FwdConfig, p, rng) for _ in range(2)]
    for cfg in configs:
        check_case(p, device, fwd=cfg, layout=layout, backward=False, gen=gen)


def test_forward_output_written_everywhere(device: str, seed: int) -> None:
    """Fully masked rows (Sq > Sk, causal) give 0 output and +inf LSE, never NaN."""
    import flashtune.kernels.attention as A

    p = Problem(1, 2, 2, 40, 8, 32, "fp16", True)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 40, 32, generator=g).to(device, torch.float16)
    k = torch.randn(1, 2, 8, 32, generator=g).to(device, torch.float16)
    v = torch.randn(1, 2, 8, 32, generator=g).to(device, torch.float16)
    out, lse = A.flash_attention(q, k, v, causal=True, return_lse=True,
                                 config=FwdConfig(block_m=16, block_n=16))
    assert not torch.isnan(out).any()
    empty = torch.arange(40, device=device) < 40 - 8  # rows i with i + (Sk - Sq) < 0
    assert torch.equal(out[:, :, empty].float(), torch.zeros_like(out[:, :, empty].float()))
    assert torch.isinf(lse[:, :, empty]).all() and (lse[:, :, empty] > 0).all()
    assert torch.isfinite(lse[:, :, ~empty]).all()
    assert p.flops() > 0


GPU_CASES = [
    (1, 16, 16, 16384, 16384, 128, "bf16", True, (-1, -1), 0.0, "bhsd"),
    (1, 8, 2, 8192, 8192, 64, "bf16", False, (-1, -1), 0.0, "bshd"),
    (2, 8, 8, 4096, 4096, 256, "fp16", True, (-1, -1), 0.0, "bhsd"),
    (2, 16, 4, 4000, 3001, 128, "bf16", True, (512, -1), 0.0, "bshd"),
    (1, 8, 8, 2049, 8191, 64, "bf16", False, (-1, -1), 50.0, "bhsd"),
    (4, 8, 1, 1, 16384, 128, "bf16", True, (-1, -1), 0.0, "bhsd"),   # decode-like, MQA
    (1, 4, 4, 1000, 1000, 80, "fp16", True, (128, 0), 0.0, "dpad"),
    (1, 4, 4, 3000, 3000, 192, "bf16", False, (-1, -1), 0.0, "bhsd"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_forward_gpu_realistic(case: tuple, seed: int) -> None:
    p, layout = case_problem(case), case[-1]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for cfg in [default_fwd(p), random_config(FwdConfig, p, rng, max_block=128, max_stages=4)]:
        check_case(p, "cuda", fwd=cfg, layout=layout, backward=False, gen=gen)


@pytest.mark.gpu
def test_forward_gpu_config_once_miscompiled(seed: int) -> None:
    """A variant of the forward (softmax scale folded into exp2's FMA) made Triton 3.6 build
    a kernel that hit an illegal memory access for exactly this config at D=64, non-causal,
    every time (BENCHMARKS.md). The shipped kernel must run it and match the reference."""
    p = Problem(4, 32, 32, 2048, 2048, 64, "bf16", False, (-1, -1))
    cfg = FwdConfig(block_m=128, block_n=32, num_warps=4, num_stages=3)
    check_case(p, "cuda", fwd=cfg, layout="bhsd", backward=False,
               gen=torch.Generator().manual_seed(seed))


def test_tma_descriptor_path_matches_pointer_path(device: str, seed: int) -> None:
    """use_tma=1 (tensor descriptors) gives the same output as the pointer path, including
    the ragged K/V end that the descriptor bounds zero-fill; odd strides fall back."""
    import flashtune.kernels.attention as A

    for layout in ("bhsd", "bshd"):
        p = Problem(1, 4, 2, 97, 130, 64, "bf16", True, (40, -1))
        q, k, v, _ = make_qkv_for(p, device, layout, seed)
        a = A.flash_attention(q, k, v, causal=True, window_size=(40, -1),
                              config=FwdConfig(block_m=32, block_n=32, use_tma=0))
        b = A.flash_attention(q, k, v, causal=True, window_size=(40, -1),
                              config=FwdConfig(block_m=32, block_n=32, use_tma=1))
        assert torch.equal(a, b)


def make_qkv_for(p: Problem, device: str, layout: str, seed: int):  # type: ignore[no-untyped-def]
    from .helpers import make_qkv

    return make_qkv(p, device, layout, torch.Generator().manual_seed(seed))
