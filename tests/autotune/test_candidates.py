"""Recombination and polishing, alone: functions of what the search has seen."""

from __future__ import annotations

from typing import Any

from flashtune.autotune.candidates import (
    Seen,
    compose_point,
    moves,
    polish_point,
    sig,
    usable,
)
from flashtune.autotune.space import SearchSpace
from flashtune.kernels.config import FwdConfig, config_to_dict, default_bwd, default_fwd
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


def _trial(params: dict[str, Any], value: float, state: str = "COMPLETE") -> Any:
    from types import SimpleNamespace

    from optuna.trial import TrialState

    return SimpleNamespace(params=params, value=value, state=TrialState[state])


def test_the_rival_is_the_other_kernel_familys_best_while_within_the_margin() -> None:
    from flashtune.autotune.candidates import RIVAL_MARGIN, rival
    from flashtune.kernels.config import FwdConfig

    hopper = config_to_dict(FwdConfig(variant=1, block_m=128, block_n=128, num_stages=2))
    near = config_to_dict(FwdConfig(block_m=64, block_n=64, num_stages=3))
    nearer_but_failed = config_to_dict(FwdConfig(block_m=64, block_n=32, num_stages=3))
    far = config_to_dict(FwdConfig(block_m=128, block_n=64, num_warps=8))
    best_ms = 1.0
    done = {sig(hopper): _trial(hopper, best_ms),
            sig(near): _trial(near, best_ms * (1 + RIVAL_MARGIN / 2)),
            sig(nearer_but_failed): _trial(nearer_but_failed, 0.5, "FAIL"),
            sig(far): _trial(far, best_ms * (1 + 2 * RIVAL_MARGIN))}
    assert rival("fwd", done, hopper, best_ms) == near
    # The incumbent's own family is never its rival; nor is a family too far behind.
    assert rival("fwd", done, near, best_ms) == hopper
    del done[sig(near)]
    assert rival("fwd", done, hopper, best_ms) == {}
    assert rival("fwd", done, {}, best_ms) == {}


def test_the_backwards_portable_variants_are_one_family() -> None:
    from flashtune.autotune.candidates import family, rival
    from flashtune.kernels.config import BWD_HOPPER, BWD_ONE_LAUNCH, BWD_TWO_KERNEL

    two = config_to_dict(default_bwd(P, BWD_TWO_KERNEL))
    one = {**two, "variant": BWD_ONE_LAUNCH}
    assert two["variant"] == BWD_TWO_KERNEL
    assert family("bwd", two) == family("bwd", one) == "portable"
    assert family("bwd", {**two, "variant": BWD_HOPPER}) == "hopper"
    done = {sig(two): _trial(two, 1.0), sig(one): _trial(one, 1.01)}
    assert rival("bwd", done, two, 1.0) == {}


def test_the_final_retiming_takes_the_other_familys_best_within_the_margin() -> None:
    from flashtune.autotune.candidates import RIVAL_MARGIN
    from flashtune.autotune.tuner import NEAR_TIE, _finalists
    from flashtune.kernels.config import FwdConfig

    space = SearchSpace.full("fwd")
    hoppers = [config_to_dict(FwdConfig(variant=1, block_m=128, block_n=128, num_stages=s,
                                        persistent=1, tile_order=o))
               for s in (2, 3) for o in (0, 1)]
    portable = config_to_dict(FwdConfig(block_m=64, block_n=64, num_stages=3))
    default = config_to_dict(FwdConfig(block_m=128, block_n=64, num_stages=3))
    for lag, joins in ((RIVAL_MARGIN / 2, True), (2 * RIVAL_MARGIN, False)):
        # The fourth Hopper trial lies past the near ties: the top 3 are the finalists.
        ok = [_trial(h, 1.0 + 0.001 * i) for i, h in enumerate(hoppers[:3])]
        ok.append(_trial(hoppers[3], 1.0 + 2 * NEAR_TIE))
        ok.append(_trial(portable, 1.0 + lag))
        ok.sort(key=lambda t: t.value)
        picked = [t.params for t in _finalists(space, ok, default, 3, "fwd")]
        assert picked[:3] == hoppers[:3]
        assert (portable in picked) == joins
        assert len(picked) == 3 + joins
        # With no final re-timing (top_k 1) the fastest trial stands alone.
        assert [t.params for t in _finalists(space, ok, default, 1, "fwd")] == hoppers[:1]


def test_the_final_retiming_takes_the_near_ties_up_to_a_limit() -> None:
    from flashtune.autotune.tuner import NEAR_TIE, NEAR_TIE_MAX, _finalists
    from flashtune.kernels.config import FwdConfig

    space = SearchSpace.full("fwd")
    points = [config_to_dict(FwdConfig(variant=1, block_m=128, block_n=128, num_stages=s,
                                       consumer_regs=r, pingpong=pp))
              for s in (2, 3) for r in (232, 240) for pp in (0, 1)]
    default = config_to_dict(FwdConfig(block_m=128, block_n=64, num_stages=3))
    # Two near ties past the top 3, then one just outside the margin.
    times = [1.0, 1.005, 1.01, 1.02, 1.035, 1.0 + 1.2 * NEAR_TIE]
    ok = [_trial(p, t) for p, t in zip(points, times, strict=False)]
    picked = [t.params for t in _finalists(space, ok, default, 3, "fwd")]
    assert picked == points[:5]
    # Many near ties: no more than NEAR_TIE_MAX finalists (the default aside).
    ok = [_trial(p, 1.0 + 0.001 * i) for i, p in enumerate(points)]
    picked = [t.params for t in _finalists(space, ok, default, 3, "fwd")]
    assert picked == points[:NEAR_TIE_MAX] and NEAR_TIE_MAX < len(points)
    # A larger top-k still takes its k, ties or not.
    ok = [_trial(p, 1.0 + 0.1 * i) for i, p in enumerate(points)]
    assert len(_finalists(space, ok, default, 4, "fwd")) == 4
    assert len(_finalists(space, ok, default, 3, "fwd")) == 3


def test_polishing_moves_the_least_polished_fields_first() -> None:
    """Each new incumbent would otherwise restart at the first field: the order follows
    the moves the search has made so far, whatever the centre."""
    space = SearchSpace.full("fwd").restrict(variant=0)
    p = Problem(batch=2, heads_q=4, heads_kv=4, seqlen_q=512, seqlen_k=512, head_dim=64)
    centre = config_to_dict(FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=2))
    seen = Seen(space, p, {}, {}, centre, [])
    first = polish_point(seen, set())
    assert first is not None and moves(space, centre, first) == ("block_m",)
    moved = {"block_m": 2, "block_n": 2, "num_warps": 1}
    point = polish_point(Seen(space, p, {}, {}, centre, [], moved), set())
    assert point is not None
    (field,) = moves(space, centre, point)
    assert field not in moved
    assert moves(space, centre, {**centre, "variant": 1}) == ("variant",)
