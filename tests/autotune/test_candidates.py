"""Recombination and polishing, alone: functions of what the search has seen."""

from __future__ import annotations

from typing import Any

from flashtune.autotune.candidates import Seen, compose_point, polish_point, sig, usable
from flashtune.autotune.space import SearchSpace
from flashtune.kernels.config import config_to_dict, default_bwd, default_fwd
from flashtune.problem import Problem

P = Problem(batch=2, heads_q=4, heads_kv=4, seqlen_q=128, seqlen_k=128, head_dim=64)


def seen(space: SearchSpace, best: dict[str, Any], *, done: tuple[dict[str, Any], ...] = (),
         parts: tuple[tuple[dict[str, Any], dict[str, float]], ...] = (),
         queued: tuple[dict[str, Any], ...] = ()) -> Seen:
    return Seen(space, P, {sig(d): object() for d in done},
                {sig(p): (p, t) for p, t in parts}, best, list(queued))


def test_polish_moves_one_field_of_the_incumbent_to_an_untried_feasible_neighbour() -> None:
    space = SearchSpace.full("fwd")
    best = config_to_dict(default_fwd(P))
    point = polish_point(seen(space, best, done=(best,)), set())
    assert point is not None and usable(seen(space, best, done=(best,)), point)
    assert sum(point[k] != best[k] for k in best) == 1


def test_polish_skips_what_is_measured_or_queued() -> None:
    space = SearchSpace.full("fwd")
    best = config_to_dict(default_fwd(P))
    first = polish_point(seen(space, best, done=(best,)), set())
    assert first is not None
    second = polish_point(seen(space, best, done=(best,), queued=(first,)), set())
    assert second is not None and second not in (first, best)


def test_compose_needs_part_times_of_the_incumbent() -> None:
    space = SearchSpace.full("bwd")
    best = config_to_dict(default_bwd(P))
    assert compose_point(seen(space, best)) is None


def test_compose_puts_the_fastest_launch_settings_together() -> None:
    space = SearchSpace.full("bwd")
    a = config_to_dict(default_bwd(P))
    b = {**a, "dq_block_m": 64, "dkdv_block_n": 64}
    assert usable(seen(space, a), b)
    # a has the faster dkdv launch, b the faster dq launch: together, faster than either.
    parts = ((a, {"dkdv": 1.0, "dq": 2.0, "pre": 0.1}), (b, {"dkdv": 1.5, "dq": 1.0, "pre": 0.1}))
    point = compose_point(seen(space, a, done=(a, b), parts=parts))
    assert point is not None
    assert point["dq_block_m"] == b["dq_block_m"]
    assert {k: point[k] for k in space.parts["dkdv"]} == {k: a[k] for k in space.parts["dkdv"]}


def test_compose_offers_nothing_that_is_not_faster() -> None:
    space = SearchSpace.full("bwd")
    a = config_to_dict(default_bwd(P))
    b = {**a, "dq_block_m": 64}
    parts = ((a, {"dkdv": 1.0, "dq": 1.0, "pre": 0.1}), (b, {"dkdv": 1.0, "dq": 1.5, "pre": 0.1}))
    assert compose_point(seen(space, a, done=(a, b), parts=parts)) is None
