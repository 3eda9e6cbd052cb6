"""The public wrapper: argument errors, strides, torch.compile, CUDA graphs, random configs."""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys

import pytest
import torch

from flashtune.exceptions import InfeasibleConfigError
from flashtune.kernels.attention import flash_attention
from flashtune.kernels.config import BwdConfig, FwdConfig, default_bwd, default_fwd
from flashtune.problem import Problem
from flashtune.timing import standard_matrix

from .helpers import check_case, check_graph_replay, make_qkv, random_config


def _t(*shape: int, dtype: torch.dtype = torch.float16, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape).to(device=device, dtype=dtype)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda d: (_t(2, 8, 32, device=d), _t(1, 2, 8, 32, device=d), _t(1, 2, 8, 32, device=d)),
         ValueError, r"q must be 4-D .* got shape \(2, 8, 32\)"),
        (lambda d: (_t(1, 3, 8, 32, device=d), _t(1, 2, 8, 32, device=d),
                    _t(1, 2, 8, 32, device=d)),
         ValueError, r"q heads = 3 must be a multiple of k/v heads = 2"),
        (lambda d: (_t(1, 2, 8, 32, device=d), _t(1, 2, 8, 32, dtype=torch.bfloat16, device=d),
                    _t(1, 2, 8, 32, device=d)),
         TypeError, r"q, k, v must share one dtype.*bfloat16"),
        (lambda d: (_t(1, 2, 8, 32, dtype=torch.float32, device=d),) * 3,
         TypeError, r"q.dtype must be torch.float16 or torch.bfloat16, got torch.float32"),
        (lambda d: (_t(1, 2, 8, 36, device=d),) * 3,
         ValueError, r"head_dim = 36 is not supported: use a multiple of 8 in \[16, 256\]"),
        (lambda d: (_t(1, 2, 8, 264, device=d),) * 3,
         ValueError, r"head_dim = 264 is not supported"),
        (lambda d: (_t(1, 2, 8, 32, device=d), _t(1, 2, 8, 64, device=d),
                    _t(1, 2, 8, 64, device=d)),
         ValueError, r"k.shape\[3\] \(head_dim\) = 64 must equal q.shape\[3\] = 32"),
        (lambda d: (_t(2, 2, 8, 32, device=d), _t(1, 2, 8, 32, device=d),
                    _t(1, 2, 8, 32, device=d)),
         ValueError, r"k.shape\[0\] \(batch\) = 1 must equal q.shape\[0\] = 2"),
        (lambda d: (_t(1, 2, 8, 32, device=d), _t(1, 2, 8, 32, device=d),
                    _t(1, 2, 9, 32, device=d)),
         ValueError, r"k and v must have one shape"),
        (lambda d: (_t(1, 2, 0, 32, device=d), _t(1, 2, 8, 32, device=d),
                    _t(1, 2, 8, 32, device=d)),
         ValueError, r"seqlen_q=0"),
        (lambda d: (_t(1, 2, 8, 32, device=d), _t(1, 2, 8, 32, device="meta"),
                    _t(1, 2, 8, 32, device=d)),
         ValueError, r"q, k, v must be on one device, got .*meta"),
        (lambda d: ([[1.0]], _t(1, 2, 8, 32, device=d), _t(1, 2, 8, 32, device=d)),
         TypeError, r"q must be a torch.Tensor, got list"),
    ],
)
def test_bad_tensors_raise_naming_argument(make, exc, match, device: str) -> None:  # type: ignore
    q, k, v = make(device)
    with pytest.raises(exc, match=match):
        flash_attention(q, k, v)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"window_size": (-2, 0)}, ValueError, r"window_size entries must be >= 0.*\(-2, 0\)"),
        ({"window_size": (1,)}, TypeError, r"window_size must be a pair of ints.*\(1,\)"),
        ({"window_size": (1.5, 2)}, TypeError, r"window_size must be a pair of ints"),
        ({"softcap": -1.0}, ValueError, r"softcap must be a number >= 0.*-1.0"),
        ({"softcap": float("nan")}, ValueError, r"softcap must be a number >= 0"),
        ({"softmax_scale": 0.0}, ValueError, r"softmax_scale must be finite and > 0.*got 0.0"),
        ({"softmax_scale": "x"}, TypeError, r"softmax_scale must be a float or None, got 'x'"),
        ({"causal": 1}, TypeError, r"causal must be a bool, got 1"),
        ({"config": {"block_m": 64}}, TypeError, r"config must be None, a FwdConfig"),
    ],
)
def test_bad_arguments_raise_naming_argument(kw, exc, match, device: str) -> None:  # type: ignore
    q = _t(1, 2, 8, 32, device=device)
    with pytest.raises(exc, match=match):
        flash_attention(q, q, q, **kw)


def test_infeasible_forced_config_is_rejected_before_launch(device: str) -> None:
    q = _t(1, 2, 8, 256, device=device)
    big = FwdConfig(block_m=256, block_n=256, num_warps=4, num_stages=4)
    with pytest.raises(InfeasibleConfigError, match="fwd: estimated shared memory"):
        flash_attention(q, q, q, config=big)
    with pytest.raises(InfeasibleConfigError, match="warps"):
        flash_attention(q, q, q, config=BwdConfig(dkdv_block_n=16, dkdv_warps=16))


def test_cpu_tensors_without_interpreter_get_a_clear_error() -> None:
    code = ("import torch, flashtune\n"
            "q = torch.randn(1, 2, 8, 32, dtype=torch.float16)\n"
            "try:\n    flashtune.flash_attention(q, q, q)\n"
            "except ValueError as e:\n    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "ERR q is a CPU tensor" in out.stdout, out.stdout + out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout


def test_output_keeps_input_layout_and_lse_is_natural_log(device: str, seed: int) -> None:
    p = Problem(1, 2, 2, 24, 40, 32, "fp16")
    q, k, v, _ = make_qkv(p, device, "bshd", torch.Generator().manual_seed(seed))
    o, lse = flash_attention(q, k, v, return_lse=True)
    assert o.stride() == q.stride()  # (B, S, H, D) storage in, (B, S, H, D) storage out
    s = (q.float() @ k.float().transpose(-1, -2)) / 32 ** 0.5
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-3, rtol=1e-3)


def test_no_grad_inference_path_matches_training_path(device: str, seed: int) -> None:
    p = Problem(1, 2, 1, 33, 33, 32, "bf16", True)
    q, k, v, _ = make_qkv(p, device, "bhsd", torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a = flash_attention(q, k, v, causal=True)
    b = flash_attention(q.requires_grad_(), k, v, causal=True)
    assert torch.equal(a, b.detach())


def _compile_case(device: str, backend: str, seed: int) -> None:
    p = Problem(1, 4, 2, 40, 56, 32, "bf16", True)
    q, k, v, do = make_qkv(p, device, "bshd", torch.Generator().manual_seed(seed))

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attention(q, k, v, causal=True, window_size=(16, -1)) * 2.0

    dynamo = importlib.import_module("torch._dynamo")
    dynamo.reset()
    explained = dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ys = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    oc = compiled(*xs)
    oe = f(*ys)
    gc = torch.autograd.grad(oc, xs, do)
    ge = torch.autograd.grad(oe, ys, do)
    assert torch.equal(oc, oe)
    for a, b in zip(gc, ge, strict=True):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_interpreter(seed: int) -> None:
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU variant")
    _compile_case("cpu", "aot_eager", seed)


@pytest.mark.gpu
def test_torch_compile_fullgraph_inductor_gpu(seed: int) -> None:
    _compile_case("cuda", "inductor", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("bwd_variant", ["default", "hopper"])
def test_cuda_graph_capture_replay_fwd_bwd(bwd_variant: str, seed: int) -> None:
    """Capture and replay a training step; "hopper" forces the Hopper backward (its
    prepared launch, bound before capture by the eager warm-up, replays with new data)."""
    from flashtune.kernels.config import BWD_HOPPER, hopper_support

    p = Problem(2, 8, 2, 1000, 1000, 128, "bf16", True)
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = make_qkv(p, "cuda", "bhsd", g)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if bwd_variant == "hopper" and hopper_support():
        pytest.skip(f"Hopper kernels cannot run here: {hopper_support()}")
    cfg = (default_fwd(p), default_bwd(p, BWD_HOPPER) if bwd_variant == "hopper"
           else default_bwd(p))

    def step() -> tuple[torch.Tensor, ...]:
        o = flash_attention(q, k, v, causal=True, config=cfg)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    check_graph_replay(step, (q, k, v), g)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_random_feasible_configs_across_standard_matrix(direction: str, seed: int) -> None:
    """30 random feasible configs per kernel, each on a shape of the standard matrix (batch cut
    to keep the fp32 reference small), all pass the reference check."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    matrix = standard_matrix()
    for i in range(30):
        m = matrix[i % len(matrix)]
        p = Problem(1, min(m.heads_q, 4), min(m.heads_kv, 4) if m.heads_kv < m.heads_q
                    else min(m.heads_q, 4), min(m.seqlen_q, 4096), min(m.seqlen_k, 4096),
                    m.head_dim, m.dtype, m.causal)
        if direction == "fwd":
            cfg = random_config(FwdConfig, p, rng, max_block=256, max_stages=5)
            check_case(p, "cuda", fwd=cfg, backward=False, gen=gen)
        else:
            cfg = random_config(BwdConfig, p, rng, max_block=256, max_stages=5)
            check_case(p, "cuda", bwd=cfg, backward=True, gen=gen)


# ----------------------------------------------------------------------------- flash-attn layout


def test_flash_attn_func_takes_bshd_and_equals_the_dense_path(device: str, seed: int) -> None:
    from flashtune.kernels.attention import flash_attn_func

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 37, 4, 32, generator=g).to(device, torch.bfloat16)  # (B, S, H, D)
    k = torch.randn(2, 45, 2, 32, generator=g).to(device, torch.bfloat16)
    v = torch.randn(2, 45, 2, 32, generator=g).to(device, torch.bfloat16)
    do = torch.randn(2, 37, 4, 32, generator=g).to(device, torch.bfloat16)
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ys = [t.detach().transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*xs, causal=True, window_size=(9, 2), softcap=2.0)
    ref = flash_attention(*ys, causal=True, window_size=(9, 2), softcap=2.0)
    assert out.shape == q.shape and torch.equal(out, ref.transpose(1, 2))
    for a, b in zip(torch.autograd.grad(out, xs, do),
                    torch.autograd.grad(ref, ys, do.transpose(1, 2)), strict=True):
        assert torch.equal(a, b.transpose(1, 2))


@pytest.mark.parametrize("kw, match", [
    ({"dropout_p": 0.1}, r"dropout_p=0.1: flashtune has no attention dropout"),
    ({"alibi_slopes": torch.ones(2)}, r"alibi_slopes is not supported"),
    ({"return_attn_probs": True}, r"return_attn_probs=True is not supported"),
])
def test_flash_attn_func_unsupported_arguments_name_themselves(kw, match, device) -> None:  # type: ignore
    from flashtune.kernels.attention import flash_attn_func

    q = _t(1, 8, 2, 32, device=device)
    with pytest.raises(ValueError, match=match):
        flash_attn_func(q, q, q, **kw)
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, seqlen, heads, head_dim\)"):
        flash_attn_func(q[0], q, q)


def test_deterministic_is_accepted_and_checked(device: str) -> None:
    q = _t(1, 2, 8, 32, device=device)
    assert torch.equal(flash_attention(q, q, q, deterministic=False),
                       flash_attention(q, q, q, deterministic=True))
    with pytest.raises(TypeError, match=r"deterministic must be a bool, got 1"):
        flash_attention(q, q, q, deterministic=1)  # type: ignore[arg-type]
