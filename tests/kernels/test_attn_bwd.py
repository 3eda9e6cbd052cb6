"""Backward kernels (delta, dK/dV, dQ) vs the fp32 reference, GQA group sums, determinism,
for every portable backward variant (two kernels, atomic dQ, one launch, fused)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from flashtune.exceptions import InfeasibleConfigError
from flashtune.kernels.attention import flash_attention
from flashtune.kernels.attn_bwd import attn_bwd
from flashtune.kernels.attn_fwd import attn_fwd
from flashtune.kernels.config import (
    BWD_ATOMIC,
    BWD_FUSED,
    BWD_ONE_LAUNCH,
    BWD_TWO_KERNEL,
    BwdConfig,
    FwdConfig,
    default_bwd,
    default_fwd,
    is_feasible,
)
from flashtune.problem import Problem, default_scale

from .helpers import case_id, case_problem, check_case, make_qkv, random_config

# (B, Hq, Hkv, Sq, Sk, D, dtype, causal, window, softcap, layout)
CASES = [
    (1, 2, 2, 1, 33, 32, "fp16", True, (-1, -1), 0.0, "bhsd"),
    (2, 4, 1, 17, 45, 32, "bf16", False, (-1, -1), 0.0, "bshd"),     # GQA 4:1
    (1, 4, 1, 97, 130, 80, "fp16", True, (-1, -1), 0.0, "bhsd"),     # MQA, Sq < Sk
    (1, 2, 1, 130, 97, 32, "bf16", True, (-1, -1), 0.0, "bshd"),     # empty rows
    (1, 2, 2, 97, 61, 128, "fp16", False, (16, 8), 0.0, "dpad"),     # window
    (1, 2, 2, 130, 130, 32, "bf16", True, (24, -1), 0.0, "bhsd"),    # causal + window
    (1, 4, 2, 17, 130, 80, "fp16", False, (-1, -1), 30.0, "bshd"),   # softcap, GQA 2:1
    (1, 2, 2, 61, 61, 128, "bf16", True, (-1, -1), 5.0, "bhsd"),     # softcap + causal
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_backward_matches_reference(case: tuple, device: str, seed: int) -> None:
    p, layout = case_problem(case), case[-1]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    configs = [default_bwd(p)] + [random_config(BwdConfig, p, rng) for _ in range(2)]
    for cfg in configs:
        fwd = random_config(FwdConfig, p, rng)
        check_case(p, device, fwd=fwd, bwd=cfg, layout=layout, backward=True, gen=gen)


VARIANTS = [BWD_TWO_KERNEL, BWD_ATOMIC, BWD_ONE_LAUNCH, BWD_FUSED]
# Odd lengths, Sq != Sk both ways, causal bottom-right, window, softcap, GQA / MQA, padded D.
VARIANT_CASES = [
    (1, 4, 2, 37, 53, 40, "bf16", True, (-1, -1), 0.0, "bshd"),    # GQA 2:1, Sq < Sk
    (2, 2, 1, 61, 29, 32, "fp16", True, (-1, -1), 3.0, "bhsd"),    # MQA, Sq > Sk, softcap
    (1, 2, 2, 45, 70, 64, "bf16", False, (9, 4), 0.0, "dpad"),     # window, strided rows
]


def variant_problem(p: Problem, variant: int) -> Problem:
    """``p`` as the variant can serve it: the atomic one only with deterministic=False."""
    return dataclasses.replace(p, deterministic=variant != BWD_ATOMIC)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", VARIANT_CASES, ids=case_id)
def test_each_backward_variant_matches_reference(case: tuple, variant: int, device: str,
                                                 seed: int) -> None:
    p = variant_problem(case_problem(case), variant)
    rng = random.Random(seed)
    cfg = random_config(BwdConfig, p, rng, variant=variant)
    check_case(p, device, bwd=cfg, layout=case[-1], backward=True,
               gen=torch.Generator().manual_seed(seed), deterministic=p.deterministic)


def _grads(p: Problem, device: str, cfg: BwdConfig, seed: int) -> tuple[torch.Tensor, ...]:
    q, k, v, do = make_qkv(p, device, "bhsd", torch.Generator().manual_seed(seed))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flash_attention(q, k, v, causal=p.causal, config=cfg, deterministic=p.deterministic)
    return torch.autograd.grad(o, (q, k, v), do)


@pytest.mark.parametrize("variant", [BWD_TWO_KERNEL, BWD_ONE_LAUNCH, BWD_FUSED])
@pytest.mark.parametrize("gqa", [1, 4])
def test_backward_bit_identical_across_runs(gqa: int, variant: int, device: str,
                                            seed: int) -> None:
    p = Problem(1, 4, 4 // gqa, 70, 90, 32, "bf16", True)
    cfg = BwdConfig(dkdv_block_m=16, dkdv_block_n=32, dq_block_m=32, dq_block_n=16,
                    variant=variant)
    a = _grads(p, device, cfg, seed)
    b = _grads(p, device, cfg, seed)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_gqa_dk_dv_are_group_sums(device: str, seed: int) -> None:
    """dk/dv of a GQA call equal the sums over the group of the expanded (MHA) call."""
    p = Problem(1, 4, 2, 33, 47, 32, "fp16", False)
    q, k, v, do = make_qkv(p, device, "bhsd", torch.Generator().manual_seed(seed))
    cfg = BwdConfig(dkdv_block_m=16, dkdv_block_n=16, dq_block_m=16, dq_block_n=16)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    o = flash_attention(qa, ka, va, config=cfg)
    dq, dk, dv = torch.autograd.grad(o, (qa, ka, va), do)
    ke = k.repeat_interleave(2, dim=1).requires_grad_()
    ve = v.repeat_interleave(2, dim=1).requires_grad_()
    qe = q.clone().requires_grad_()
    oe = flash_attention(qe, ke, ve, config=cfg)
    dqe, dke, dve = torch.autograd.grad(oe, (qe, ke, ve), do)
    assert torch.equal(o, oe) and torch.equal(dq, dqe)
    sum_k = dke.float().view(1, 2, 2, 47, 32).sum(2)
    sum_v = dve.float().view(1, 2, 2, 47, 32).sum(2)
    torch.testing.assert_close(dk.float(), sum_k, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(dv.float(), sum_v, atol=2e-3, rtol=2e-3)


def test_atomic_variant_is_refused_when_deterministic(device: str, seed: int) -> None:
    p = Problem(1, 2, 2, 33, 33, 32, "bf16", True)
    q, k, v, do = make_qkv(p, device, "bhsd", torch.Generator().manual_seed(seed))
    cfg = BwdConfig(variant=BWD_ATOMIC, dkdv_block_m=16, dkdv_block_n=16)
    # A forced config is checked against the call's problem, deterministic=True by default.
    with pytest.raises(InfeasibleConfigError, match="deterministic=False"):
        flash_attention(q.requires_grad_(), k, v, causal=True, config=cfg)
    # The launcher refuses it too, whoever picked the config.
    kw = dict(causal=True, sm_scale=default_scale(32), window=(-1, -1), softcap=0.0)
    o, lse = attn_fwd(q.detach(), k, v, config=default_fwd(p), **kw)
    with pytest.raises(InfeasibleConfigError, match="deterministic=False"):
        attn_bwd(do, q.detach(), k, v, o, lse, config=cfg, deterministic=True, **kw)
    dq, dk, dv = attn_bwd(do, q.detach(), k, v, o, lse, config=cfg, deterministic=False, **kw)
    ref = attn_bwd(do, q.detach(), k, v, o, lse, config=default_bwd(p), **kw)
    for a, b in zip((dq, dk, dv), ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    # dK and dV are summed in the dK/dV kernel's fixed order in every portable variant: the
    # same as the two-kernel variant's with the same dK/dV tiles (other tiles sum the query
    # blocks in another order, which may differ in the last bit).
    same_tiles = BwdConfig(variant=BWD_TWO_KERNEL, dkdv_block_m=16, dkdv_block_n=16)
    _, dk2, dv2 = attn_bwd(do, q.detach(), k, v, o, lse, config=same_tiles, **kw)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


GPU_CASES = [
    (1, 16, 16, 16384, 16384, 128, "bf16", True, (-1, -1), 0.0, "bhsd"),
    (1, 8, 2, 8192, 8192, 64, "bf16", False, (-1, -1), 0.0, "bshd"),
    (1, 8, 8, 4096, 4096, 256, "fp16", True, (-1, -1), 0.0, "bhsd"),
    (2, 16, 4, 4000, 3001, 128, "bf16", True, (512, -1), 0.0, "bshd"),
    (1, 8, 8, 2049, 8191, 64, "bf16", False, (-1, -1), 50.0, "bhsd"),
    (1, 4, 4, 1000, 1000, 80, "fp16", True, (128, 0), 0.0, "dpad"),
    (1, 4, 4, 3000, 3000, 192, "bf16", False, (-1, -1), 0.0, "bhsd"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_backward_gpu_realistic(case: tuple, variant: int, seed: int) -> None:
    p, layout = variant_problem(case_problem(case), variant), case[-1]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cfgs = [default_bwd(p, variant),
            random_config(BwdConfig, p, rng, max_block=128, max_stages=4, variant=variant)]
    if variant == BWD_ATOMIC:  # both dQ paths: pointer atomics and TMA reduce-add (sm90+)
        cfgs.append(dataclasses.replace(cfgs[0], dkdv_atomic_tma=1))
    for cfg in cfgs:
        ok, why = is_feasible(cfg, p)
        if not ok:  # e.g. the TMA reduce-add below sm90: must say why
            assert cfg.dkdv_atomic_tma and "sm" in why, why
            continue
        check_case(p, "cuda", bwd=cfg, layout=layout, backward=True, gen=gen,
                   deterministic=p.deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [BWD_TWO_KERNEL, BWD_ONE_LAUNCH, BWD_FUSED])
def test_backward_bit_identical_gpu_large(variant: int, seed: int) -> None:
    p = Problem(2, 16, 4, 4096, 4096, 128, "bf16", True)
    cfg = default_bwd(p, variant)
    a = _grads(p, "cuda", cfg, seed)
    b = _grads(p, "cuda", cfg, seed)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_backward_variants_build_for_sm90_without_a_gpu() -> None:
    """The atomic variant's two dQ paths, the one-launch kernel and the fused one compile for
    Hopper (Triton's own ptxas, no GPU: benchmarks/probe_ptxas.py --bwd), the dK/dV kernel
    adds dQ the way its knob says (TMA reduce-add, or pointer atomics), and the fused
    variant launches no preprocess."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).parents[2]
    script = ("import json, sys; sys.path.insert(0, 'benchmarks'); import probe_ptxas as p; "
              "p._install_compile_only(); "
              "print(json.dumps([p.build_bwd(1, 1, False), p.build_bwd(2, 0, False), "
              "p.build_bwd(4, 0, True)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, text=True,
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    tma, one, fused = json.loads(out.stdout.strip().splitlines()[-1])
    assert tma["result"] == "ok" and one["result"] == "ok", (tma, one)
    assert fused["result"] == "ok" and fused["kernels"] == ["_attn_bwd_one_launch_kernel"], fused
    assert tma["dq_adds"] == ["cp.reduce.async.bulk.tensor"]
    assert "_attn_bwd_dq_finish" in tma["kernels"] and "_attn_bwd_dq_kernel" not in tma["kernels"]
    assert one["kernels"] == ["_attn_bwd_one_launch_kernel", "_attn_bwd_preprocess"]
    assert one["dq_adds"] == []


@pytest.mark.parametrize("block_m, chunk, head_dim", [(64, 64, 128), (64, 128, 128),
                                                       (128, 32, 64), (64, 32, 64)])
def test_register_order_dq_accumulator_comes_back_in_rows(block_m: int, chunk: int,
                                                          head_dim: int) -> None:
    """``hopper_dq_frag``: the Hopper backward keeps each (query tile, column chunk) of the
    fp32 dQ accumulator as one block in the order the consumers' wgmma registers hold it
    (``attn_bwd_hopper._fragments``: rows split [blocks of 64, warp, pair, row of 8],
    columns [group of 8, lane, pair], gathered [block, group, warp, row, lane, pair,
    pair]); the cast at the end (a portable Triton kernel, run here in the interpreter)
    must put every value back at its row and column, a padded last tile's rows left out."""
    from flashtune.kernels.attn_bwd_hopper import _dq_finish_fragments

    b, h, s = 2, 3, 150  # 150 rows: a padded last query tile
    n_m = -(-s // block_m)
    dq = torch.randn(b * h, n_m * block_m, head_dim, generator=torch.Generator().manual_seed(7))
    blocks = []
    for bh in range(b * h):
        for m in range(n_m):
            for c in range(head_dim // chunk):
                tile = dq[bh, m * block_m:(m + 1) * block_m, c * chunk:(c + 1) * chunk]
                x = tile.reshape(block_m // 64, 4, 2, 8, chunk // 8, 4, 2)
                blocks.append(x.permute(0, 4, 1, 3, 5, 2, 6).reshape(-1))
    acc = torch.stack(blocks).reshape(b * h, n_m * (head_dim // chunk), -1, 256).contiguous()
    out = torch.full((b, h, s, head_dim), float("nan"))
    _dq_finish_fragments[(n_m, b * h)](acc, out, *out.stride(), h, s, n_m, HEAD_DIM=head_dim,
                                       BLOCK_M=block_m, CHUNK=chunk)
    assert torch.equal(out, dq[:, :s].reshape(b, h, s, head_dim))
