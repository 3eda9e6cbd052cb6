"""flashtune.explain: the key, both configs, the source and the entry; launches nothing."""

from __future__ import annotations

import json

import pytest

import flashtune
from flashtune import dispatch
from flashtune.db import exchange, open_storage
from flashtune.kernels._bound import BoundLaunch
from flashtune.kernels.config import config_to_dict, default_bwd, default_fwd
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
