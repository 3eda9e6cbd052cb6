"""torch.compile(fullgraph=True) over a small model that calls flashtune.flash_attention:
no graph breaks, the eager results, and the dispatcher's table read outside the graph.

On the CPU (Triton's interpreter) the model compiles with inductor when a C++ compiler is
there, else with aot_eager; on a GPU with the default inductor backend."""

from __future__ import annotations

import shutil

import pytest
import torch

import flashtune
from flashtune import dispatch
from flashtune.kernels.config import config_to_dict
from tests.dispatch.test_dispatch import FWD_A, fresh_db, prob, put


@pytest.fixture
def db(tmp_path, monkeypatch):
    yield from fresh_db(tmp_path, monkeypatch)


class TinyAttention(torch.nn.Module):
    """One attention block: GQA (4 query heads, 2 kv heads, head dim 32), causal."""

    def __init__(self, dim: int = 128, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        a = flashtune.flash_attention(q, k, v, causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


def _cpu_backend() -> str:
    return "inductor" if shutil.which("g++") or shutil.which("clang++") else "aot_eager"


def _run(model, x):
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def check_compiled_matches_eager(device: str, backend: str, seqlens: tuple[int, ...]) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyAttention().to(device=device, dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    for s in seqlens:
        x = torch.randn(2, s, 128, device=device, dtype=torch.bfloat16)
        want, want_g = _run(model, x)
        got, got_g = _run(compiled, x)
        # The same attention kernels and configs run in both; inductor may fuse the rest.
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        for g, w in zip(got_g, want_g, strict=True):
            torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


def test_compile_fullgraph_matches_eager(db, device):
    backend = _cpu_backend() if device == "cpu" else "inductor"
    p = prob(seqlen_q=32, seqlen_k=32)
    put(db, p, "fwd", FWD_A)  # the compiled model must pick the tuned config too
    dispatch.preload(device)
    reads = dispatch.stats()["db_reads"]
    check_compiled_matches_eager(device, backend, seqlens=(32,))
    assert dispatch.stats()["db_reads"] == reads  # nothing read inside the compiled region
    assert dispatch.stats()["uncached"] == 0
    q = torch.randn(2, 4, 32, 32, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 32, 32, device=device, dtype=torch.bfloat16)
    assert config_to_dict(dispatch.resolve("fwd", q, k, True, (-1, -1), 0.0)) == \
        config_to_dict(FWD_A)


def test_compile_without_preload_loads_at_run_time(db, device):
    """No preload: tracing never calls the resolver; the first compiled run loads once."""
    backend = _cpu_backend() if device == "cpu" else "inductor"
    check_compiled_matches_eager(device, backend, seqlens=(48,))
    assert dispatch.stats()["table_loads"] == 1
    assert dispatch.stats()["uncached"] == 0


@pytest.mark.gpu
def test_compile_fullgraph_inductor_gpu(db):
    p = prob(seqlen_q=256, seqlen_k=256)
    put(db, p, "fwd", FWD_A)
    dispatch.preload("cuda")
    reads = dispatch.stats()["db_reads"]
    check_compiled_matches_eager("cuda", "inductor", seqlens=(256, 1000))
    assert dispatch.stats()["db_reads"] == reads


@pytest.mark.gpu
def test_compile_reduce_overhead_with_a_split_hopper_backward(db):
    """torch.compile with CUDA graphs (``mode="reduce-overhead"``) over a model whose tuned
    backward is the Hopper kernel in two halves (``hopper_split=2``, the second on a side
    stream forked from the captured one and joined back): the eager results, run after
    run of the graph (warm-up, record, replays)."""
    import dataclasses

    from flashtune.kernels.config import BWD_HOPPER, default_bwd, hopper_support

    reason = hopper_support()
    if reason:
        pytest.skip(f"Hopper kernels cannot run here: {reason}")
    p = prob(seqlen_q=1000, seqlen_k=1000, head_dim=64)
    split = dataclasses.replace(default_bwd(p, BWD_HOPPER), hopper_split=2)
    put(db, p, "bwd", split)
    dispatch.preload("cuda")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyAttention(dim=256).to(device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead", dynamic=False)
    x = torch.randn(2, 1000, 256, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 1000, 64, device="cuda", dtype=torch.bfloat16)
    assert config_to_dict(dispatch.resolve("bwd", q, k, True, (-1, -1), 0.0)) == \
        config_to_dict(split)
    want, want_g = _run(model, x)
    for _ in range(4):
        got, got_g = _run(compiled, x)
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        for g, w in zip(got_g, want_g, strict=True):
            torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
