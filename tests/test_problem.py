"""Packed (varlen) problems: their key, representative lengths, FLOPs, label and dict."""

from __future__ import annotations

import dataclasses

import pytest

from flashtune.problem import Problem


def _packed(**kw: int) -> Problem:
    base = dict(batch=4, heads_q=8, heads_kv=2, seqlen_q=100, seqlen_k=100, head_dim=64,
                causal=True, total_q=250, total_k=250)
    return Problem(**{**base, **kw})  # type: ignore[arg-type]


def test_a_packed_problem_has_a_key_of_its_own() -> None:
    p = _packed()
    dense = Problem(4, 8, 2, 100, 100, 64, causal=True)
    assert p.packed and not dense.packed
    pk, dk = p.key("fwd"), dense.key("fwd")
    assert pk != dk and pk.family() != dk.family()  # never served for one another
    assert (pk.packed, pk.tokens_bucket) == (True, 256) and (dk.packed, dk.tokens_bucket) == (
        False, 0)
    # The other buckets mean what they mean for a dense batch: sequences x heads, and the
    # longest sequence's lengths.
    assert dataclasses.replace(pk, packed=False, tokens_bucket=0) == dk
    assert pk.distance(dk) == dk.distance(pk) == float("inf")
    assert pk.distance(_packed(total_q=400, total_k=400).key("fwd")) == 1.0  # 256 -> 512
    assert pk.short().endswith("packed tok256")
    assert p.label() == "4x8/2x100x64 bf16 causal packed 250 tok"


def test_determinism_is_in_the_backward_key_only() -> None:
    det = Problem(2, 8, 8, 512, 512, 64)
    free = dataclasses.replace(det, deterministic=False)
    assert det.key("fwd") == free.key("fwd") and free.key("fwd").deterministic
    kd, kf = det.key("bwd"), free.key("bwd")
    assert kd != kf and (kd.deterministic, kf.deterministic) == (True, False)
    assert kf.short().endswith("nondet") and "nondet" not in kd.short()
    # Nearest serving: a non-deterministic entry never serves a deterministic call; a
    # deterministic entry may serve a non-deterministic one, at a cost.
    assert not kf.serves(kd) and kf.distance(kd) == float("inf")
    assert kd.serves(kf) and kd.distance(kf) == 1.0
    assert Problem.from_dict(free.as_dict()) == free
    assert "deterministic" not in det.as_dict()  # a default problem's dict is unchanged
    with pytest.raises(ValueError, match="deterministic must be true or false"):
        Problem(2, 8, 8, 512, 512, 64, deterministic=1)  # type: ignore[arg-type]


def test_packed_lengths_flops_and_dict() -> None:
    p = _packed()
    assert p.packed_lengths() == ([100, 50, 50, 50], [100, 50, 50, 50])
    one = 4.0 * 8 * 64 / 2  # causal, per query-key pair
    assert p.flops("fwd") == pytest.approx(one * (100 * 100 + 3 * 50 * 50))
    assert p.flops("bwd") == pytest.approx(2.5 * p.flops("fwd"))
    assert Problem.from_dict(p.as_dict()) == p
    assert "total_q" not in Problem(1, 2, 2, 8, 8, 32).as_dict()  # dense dicts unchanged
    assert _packed(batch=1, total_q=30, total_k=30).packed_lengths() == ([30], [30])


@pytest.mark.parametrize("kw, match", [
    ({"total_q": -1}, r"total_q must be an int >= 0"),
    ({"total_k": 0}, r"total_q and total_k are both 0 \(dense\) or both > 0"),
])
def test_bad_totals_are_rejected(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _packed(**kw)
