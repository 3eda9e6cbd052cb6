"""flashtune.explain: the key, both configs, the source and the entry; launches nothing."""

from __future__ import annotations

import json

import pytest

import flashtune
from flashtune import dispatch
from flashtune.db import exchange, open_storage
from flashtune.kernels._bound import BoundLaunch
from flashtune.kernels.config import config_to_dict, default_bwd, default_fwd, host_bound
from tests.dispatch.test_dispatch import BWD_A, FWD_A, FWD_B, fresh_db, prob, put, qkv


@pytest.fixture
def db(tmp_path, monkeypatch):
    yield from fresh_db(tmp_path, monkeypatch)


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch fails the test."""
    def boom(*a, **kw):
        raise AssertionError("explain launched a kernel")

    monkeypatch.setattr(BoundLaunch, "__call__", boom)  # every kernel launch goes through it


def test_tuned(db, device, no_launch):
    p = prob()
    put(db, p, "fwd", FWD_A, median_ms=0.25)
    put(db, p, "bwd", BWD_A)
    ex = flashtune.explain(*qkv(p, device), causal=True)
    assert ex.key == p.key("fwd")  # the tuner's key
    assert ex.source == "tuned" and ex.fwd.source == ex.bwd.source == "tuned"
    assert ex.fwd_config == FWD_A and ex.bwd_config == BWD_A
    assert ex.entry is not None and ex.entry.key == p.key("fwd")
    assert ex.entry.median_ms == 0.25 and ex.fwd.layer == "user"
    assert ex.bwd.entry.key == p.key("bwd")
    assert "tuned" in str(ex)
    json.dumps(ex.as_dict())  # machine-readable as is


def test_nearest_and_default(db, device, no_launch):
    p = prob(seqlen_q=32, seqlen_k=32)
    near = prob(seqlen_q=64, seqlen_k=64)
    put(db, near, "fwd", FWD_B)
    ex = flashtune.explain(*qkv(p, device), causal=True)
    assert ex.fwd.source == "nearest" and ex.fwd_config == FWD_B
    assert ex.entry.key == near.key("fwd")
    assert ex.bwd.source == "default" and ex.bwd_config == default_bwd(p)
    assert ex.source == "default"  # the weaker of the two
    ex = flashtune.explain(*qkv(p, device), causal=False)
    assert ex.source == "default" and ex.entry is None
    assert ex.fwd_config == default_fwd(prob(seqlen_q=32, seqlen_k=32, causal=False))


def test_nearest_never_crosses_the_host_bound_line(db, device, no_launch):
    """A config tuned where the kernel's time decides is not served as nearest to a call
    so small that host time decides (the shipped layer's Hopper configs at B=1, H=1,
    S=128 doubled its host time), nor the other way round; each side's own nearest is."""
    small = prob(batch=1, heads_q=1, heads_kv=1, seqlen_q=128, seqlen_k=128)
    big = prob(batch=1, heads_q=1, heads_kv=1, seqlen_q=4096, seqlen_k=4096)
    assert host_bound(small) and not host_bound(big)
    put(db, prob(batch=1, heads_q=1, heads_kv=1, seqlen_q=2048, seqlen_k=2048), "fwd", FWD_A)
    ex = flashtune.explain(*qkv(small, device), causal=True)
    assert ex.fwd.source == "default" and ex.fwd_config == default_fwd(small)
    ex = flashtune.explain(*qkv(big, device), causal=True)
    assert ex.fwd.source == "nearest" and ex.fwd_config == FWD_A
    # A host-bound entry (with the key of another bucket) serves the small call only.
    put(db, prob(batch=1, heads_q=1, heads_kv=1, seqlen_q=512, seqlen_k=512), "fwd", FWD_B)
    dispatch.reload()
    assert flashtune.explain(*qkv(small, device), causal=True).fwd_config == FWD_B
    assert flashtune.explain(*qkv(big, device), causal=True).fwd_config == FWD_A


def test_explain_records_no_miss_and_ignores_strict(db, device, monkeypatch, no_launch):
    monkeypatch.setenv("FLASHTUNE_STRICT", "1")
    ex = flashtune.explain(*qkv(prob(), device), causal=True)
    assert ex.source == "default"
    assert dispatch.flush_misses(10)
    with open_storage(db, read_only=True) as st:
        assert st.misses() == []
    assert dispatch.stats()["misses"] == 0


def test_window_and_softcap_are_part_of_the_key(db, device, no_launch):
    p = prob(window=(8, 0), softcap=30.0)
    put(db, p, "fwd", FWD_A)
    ex = flashtune.explain(*qkv(p, device), causal=True, window_size=(8, 0), softcap=30.0)
    assert ex.key.window and ex.key.softcap and ex.fwd.source == "tuned"
    assert flashtune.explain(*qkv(p, device), causal=True).fwd.source == "default"


def test_user_layer_over_shipped_layer(db, tmp_path, device, monkeypatch, no_launch):
    p = prob()
    other = tmp_path / "team.db"
    put(other, p, "fwd", FWD_B)  # the package's layer, as `autotune export` writes it
    put(other, p, "bwd", BWD_A)
    with open_storage(other) as st:
        shipped = tuple(exchange.validate_export(exchange.export_json(st)))
    monkeypatch.setattr(exchange, "_shipped", lambda: shipped)
    ex = flashtune.explain(*qkv(p, device), causal=True)
    assert (ex.fwd.layer, ex.fwd_config) == ("shipped", FWD_B)
    put(db, p, "fwd", FWD_A)
    dispatch.reload()
    ex = flashtune.explain(*qkv(p, device), causal=True)
    assert (ex.fwd.layer, ex.fwd_config) == ("user", FWD_A)
    assert (ex.bwd.layer, ex.bwd_config) == ("shipped", BWD_A)
    assert config_to_dict(ex.fwd_config) == ex.as_dict()["fwd"]["config"]


def test_bad_inputs_raise_like_flash_attention(db, device):
    q, k, v = qkv(prob(), device)
    with pytest.raises(ValueError, match="head_dim"):
        flashtune.explain(q[..., :12], k[..., :12], v[..., :12])
    with pytest.raises(TypeError, match="dtype"):
        flashtune.explain(q.float(), k.float(), v.float())


def _packed_qkv(p, device):
    """Packed tensors for ``p`` (its representative lengths) and their prefix sums."""
    import torch

    lq, lk = p.packed_lengths()
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[p.dtype]
    q = torch.randn(sum(lq), p.heads_q, p.head_dim, dtype=dt, device=device)
    k = torch.randn(sum(lk), p.heads_kv, p.head_dim, dtype=dt, device=device)
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                       device=device) for x in (lq, lk)]
    return q, k, torch.randn_like(k), cu[0], cu[1], max(lq), max(lk)


def test_packed_problems_are_explained_under_their_own_key(db, device, no_launch):
    packed = prob(batch=3, total_q=150, total_k=150)
    dense = prob(batch=3)
    put(db, packed, "fwd", FWD_A)
    q, k, v, cu_q, cu_k, mq, mk = _packed_qkv(packed, device)
    ex = flashtune.explain(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           max_seqlen_q=mq, max_seqlen_k=mk)
    assert ex.problem == packed and ex.key == packed.key("fwd") and ex.key.packed
    assert ex.fwd.source == "tuned" and ex.fwd_config == FWD_A
    # The dense batch of the same sequences x heads and lengths is another problem.
    dex = flashtune.explain(*qkv(dense, device), causal=True)
    assert not dex.key.packed and dex.fwd.source == "default" and dex.fwd.entry is None
    with pytest.raises(ValueError, match="needs all of cu_seqlens_q"):
        flashtune.explain(q, k, v, cu_seqlens_q=cu_q)


def test_determinism_is_served_on_its_own(db, device, no_launch):
    p = prob()
    free = prob(deterministic=False)
    put(db, free, "bwd", BWD_A)  # a non-deterministic backward entry only
    det = flashtune.explain(*qkv(p, device), causal=True)
    assert det.bwd.key.deterministic and det.bwd.source == "default"  # never served to it
    nd = flashtune.explain(*qkv(p, device), causal=True, deterministic=False)
    assert nd.bwd.source == "tuned" and nd.bwd_config == BWD_A
    assert nd.bwd.key == free.key("bwd") and nd.key == det.key  # one forward key for both
    # A deterministic entry of the next bucket serves a non-deterministic call as nearest.
    put(db, prob(seqlen_q=128, seqlen_k=128), "bwd", BWD_A)
    dispatch.reload()
    other = prob(seqlen_q=128, seqlen_k=128)
    ex = flashtune.explain(*qkv(other, device), causal=True, deterministic=False)
    assert ex.bwd.source == "nearest" and ex.bwd.entry.key.deterministic
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flashtune.explain(*qkv(p, device), deterministic=None)


def test_the_backward_of_a_call_looks_up_its_kind(db, device):
    from flashtune.dispatch._state import fast

    p = prob()
    put(db, prob(deterministic=False), "bwd", BWD_A)
    for flag in (False, True):
        q, k, v = qkv(p, device, grad=True)
        flashtune.flash_attention(q, k, v, causal=True, deterministic=flag).sum().backward()
    chosen = {fk[-1]: cfg for fk, cfg in fast.items() if fk[0] == "bwd"}
    assert chosen[False] == BWD_A and chosen[True] == default_bwd(p)


def test_a_packed_call_misses_and_is_recorded_under_its_packed_key(db, device):
    import flashtune.kernels.varlen  # noqa: F401  (the dispatcher resolves varlen calls)

    packed = prob(batch=3, total_q=150, total_k=150, deterministic=False)
    q, k, v, cu_q, cu_k, mq, mk = _packed_qkv(packed, device)
    for t in (q, k, v):
        t.requires_grad_(True)
    flashtune.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True,
                                     deterministic=False).sum().backward()
    assert dispatch.flush_misses(30)
    with open_storage(db, read_only=True) as st:
        got = {key: example for key, _, example in st.misses()}
    assert set(got) == {packed.key("fwd"), packed.key("bwd")}
    assert all(key.packed and key.tokens_bucket == 256 for key in got)
    assert not packed.key("bwd").deterministic and got[packed.key("bwd")] == packed
