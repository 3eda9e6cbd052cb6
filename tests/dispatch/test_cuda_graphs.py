"""CUDA-graph capture and replay of forward+backward through the dispatcher: the eager
results, and no database access (nor a first-sight ladder walk) inside the capture."""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune import dispatch
from flashtune.kernels import attention
from flashtune.kernels.config import default_bwd, default_fwd
from tests.dispatch.test_dispatch import BWD_A, FWD_A, fresh_db, prob, put

pytestmark = pytest.mark.gpu


@pytest.fixture
def db(tmp_path, monkeypatch):
    yield from fresh_db(tmp_path, monkeypatch)


def _inputs(p, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape_q = (p.batch, p.heads_q, p.seqlen_q, p.head_dim)
    shape_kv = (p.batch, p.heads_kv, p.seqlen_k, p.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g)
    return [t.requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]


def _step(q, k, v, do, fn):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v, causal=True)
    out.backward(do)
    return out, q.grad, k.grad, v.grad


def _capture(q, k, v, do, fn, warmup: int):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            _step(q, k, v, do, fn)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    for t in (q, k, v):
        t.grad = None
    with torch.cuda.graph(graph):
        static = _step(q, k, v, do, fn)
    return graph, static


def _replays_match(p, graph, captured, static, eager) -> None:
    """Replays on new inputs (seeds 1 and 2, copied into the captured buffers) give the
    bits of ``eager`` on those inputs."""
    for seed in (1, 2):
        fresh = _inputs(p, seed)
        with torch.no_grad():
            for dst, src in zip(captured, fresh, strict=True):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = [t.clone() for t in _step(*fresh, eager)]
        for got, ref in zip(static, want, strict=True):
            assert torch.equal(got, ref)


def test_graph_replay_matches_eager_and_reads_nothing(db):
    p = prob(seqlen_q=512, seqlen_k=512, head_dim=64)
    put(db, p, "fwd", FWD_A)
    put(db, p, "bwd", BWD_A)
    q, k, v, do = _inputs(p)
    _step(*_inputs(p, 3), flashtune.flash_attention)  # eager first: loads the table
    before = dispatch.stats()
    graph, static = _capture(q, k, v, do, flashtune.flash_attention, warmup=2)
    # Same kernels, same configs: the same bits.
    _replays_match(p, graph, (q, k, v, do), static, flashtune.flash_attention)
    after = dispatch.stats()
    assert after["db_reads"] == before["db_reads"] == 1
    assert after["table_loads"] == before["table_loads"]
    assert dispatch.explain(q, k, v, causal=True).source == "tuned"


def test_first_sight_inside_capture_touches_no_database(db):
    """No warm-up through the dispatcher: the capture gets the heuristic default from
    memory, reads no database, and remembers nothing for later eager calls."""
    p = prob(seqlen_q=256, seqlen_k=256, head_dim=64)
    put(db, p, "fwd", FWD_A)
    q, k, v, do = _inputs(p)
    pair = (default_fwd(p), default_bwd(p))
    forced = lambda q, k, v, causal: attention.flash_attention(  # noqa: E731
        q, k, v, causal=causal, config=pair)
    _capture(q, k, v, do, forced, warmup=2)  # compiles the default kernels, off the dispatcher
    dispatch.reload()
    with pytest.warns(RuntimeWarning, match="CUDA-graph capture"):
        graph, static = _capture(q, k, v, do, flashtune.flash_attention, warmup=0)
    graph.replay()
    torch.cuda.synchronize()
    stats = dispatch.stats()
    assert stats["db_reads"] == 0 and stats["table_loads"] == 0 and stats["uncached"] == 2
    want = _step(*[t.detach().clone().requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))],
                 forced)
    for got, ref in zip(static, want, strict=True):
        assert torch.equal(got, ref)
    # Outside capture the table loads and the tuned config is served.
    assert dispatch.resolve("fwd", q, k, True, (-1, -1), 0.0) == FWD_A


def test_graph_replay_of_a_split_hopper_backward():
    """The Hopper backward in two halves (``hopper_split=2``) forks a side stream inside
    the capture and joins it back: replays on fresh inputs give the eager whole call's
    gradients, bit for bit (deterministic: each half sums dQ in the whole call's order),
    with the eager call run after the replay, on a stream that did not capture."""
    import dataclasses

    from flashtune.kernels.config import BWD_HOPPER, hopper_support

    reason = hopper_support()
    if reason:
        pytest.skip(f"Hopper kernels cannot run here: {reason}")
    p = prob(seqlen_q=1000, seqlen_k=1000, head_dim=128)
    whole = dataclasses.replace(default_bwd(p, BWD_HOPPER), hopper_split=1)
    split = dataclasses.replace(whole, hopper_split=2)

    def forced(cfg):
        return lambda q, k, v, causal: attention.flash_attention(
            q, k, v, causal=causal, config=(default_fwd(p), cfg))

    q, k, v, do = _inputs(p)
    graph, static = _capture(q, k, v, do, forced(split), warmup=2)
    _replays_match(p, graph, (q, k, v, do), static, forced(whole))
