"""Packed (varlen) problems: their key, representative lengths, FLOPs, label and dict."""

from __future__ import annotations

import pytest

from flashtune.problem import Problem


def _packed(**kw: int) -> Problem:
    base = dict(batch=4, heads_q=8, heads_kv=2, seqlen_q=100, seqlen_k=100, head_dim=64,
                causal=True, total_q=250, total_k=250)
    return Problem(**{**base, **kw})  # type: ignore[arg-type]


def test_a_packed_problem_shares_the_key_of_its_dense_equivalent() -> None:
    p = _packed()
    dense = Problem(4, 8, 2, 100, 100, 64, causal=True)
    assert p.packed and not dense.packed
    assert p.key("fwd") == dense.key("fwd")  # sequences x heads, longest lengths
    assert p.label() == "4x8/2x100x64 bf16 causal packed 250 tok"


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
