"""The search space is the config dataclasses' metadata, as data."""

from __future__ import annotations

import dataclasses

import pytest
from optuna.distributions import CategoricalDistribution

from flashtune.autotune import SearchSpace
from flashtune.autotune.tuner import study_name
from flashtune.kernels.config import BwdConfig, FwdConfig, config_fields, default_config
from flashtune.problem import Problem

P = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32, dtype="fp16")


@pytest.mark.parametrize("direction,cls", [("fwd", FwdConfig), ("bwd", BwdConfig)])
def test_space_has_every_config_field(direction: str, cls: type) -> None:
    space = SearchSpace.full(direction)
    assert [n for n, _ in space.choices] == [f.name for f in dataclasses.fields(cls)]
    dists = space.distributions()
    for name, vals in config_fields(cls).items():
        assert isinstance(dists[name], CategoricalDistribution)
        assert tuple(dists[name].choices) == vals
    assert space.is_full and space.signature == "full"


def test_restrict_validates_and_changes_signature() -> None:
    full = SearchSpace.full("fwd")
    sub = full.restrict(block_m=(32, 64), num_warps=4)
    assert sub.fields["block_m"] == (32, 64) and sub.fields["num_warps"] == (4,)
    n_block_m = len(full.fields["block_m"])
    assert sub.size * n_block_m // 2 == full.size // len(full.fields["num_warps"])
    assert not sub.is_full and sub.signature != "full"
    with pytest.raises(ValueError, match="block_m"):
        full.restrict(block_m=(48,))
    with pytest.raises(ValueError, match="unknown"):
        full.restrict(nonsense=1)


def test_project_and_defaults() -> None:
    sub = SearchSpace.full("fwd").restrict(num_stages=(2, 3))
    d = dataclasses.asdict(default_config("fwd", P))
    assert sub.project(d) == d  # the default uses 3 stages
    assert sub.project({**d, "num_stages": 5}) is None
    assert sub.project({"block_m": 32})["block_n"] == FwdConfig().block_n


def test_feasibility_rejects_with_reason() -> None:
    space = SearchSpace.full("fwd")
    ok, reason = space.feasible(FwdConfig(block_m=16, num_warps=16), P)
    assert not ok and "16 warps" in reason
    ok, reason = space.feasible(FwdConfig(block_m=256, block_n=256, num_warps=1, num_stages=6),
                                Problem(1, 1, 1, 64, 64, 256))
    assert not ok and reason
    # The grid filter, on a sub-grid (the full forward grid takes over a minute here):
    # the point rejected above is left out, the default kept.
    sub = SearchSpace.subgrid("fwd", block_m=(16, 64), num_warps=(4, 16), num_stages=(2, 3))
    feasible = sub.feasible_grid(P)
    assert 0 < len(feasible) < sub.size == 8
    picked = {(f["block_m"], f["num_warps"]) for f in feasible}
    assert (16, 16) not in picked and (64, 4) in picked


def test_study_name_distinguishes_spaces_and_problems() -> None:
    full, sub = SearchSpace.full("fwd"), SearchSpace.full("fwd").restrict(block_m=64)
    a = study_name("dev", "sw", P, "fwd", full, "tpe")
    assert a != study_name("dev", "sw", P, "fwd", sub, "tpe")
    assert a != study_name("dev", "sw", dataclasses.replace(P, causal=True), "fwd", full, "tpe")
    assert a != study_name("dev", "sw", P, "fwd", full, "grid")


def test_subgrid_pins_every_other_knob_to_its_default() -> None:
    sub = SearchSpace.subgrid("bwd", dq_block_m=(64, 128))
    assert sub.size == 2
    for name, vals in sub.choices:
        if name != "dq_block_m":
            assert vals == (getattr(BwdConfig(), name),)


def test_neighbours_move_one_field_one_step() -> None:
    space = SearchSpace.subgrid("fwd", block_m=(32, 64, 128), num_warps=(4, 8))
    point = space.project({"block_m": 64, "num_warps": 4})
    assert point is not None
    nbrs = space.neighbours(point)
    assert {(n["block_m"], n["num_warps"]) for n in nbrs} == {(32, 4), (128, 4), (64, 8)}
    two = space.neighbours(point, radius=2)
    assert {(n["block_m"], n["num_warps"]) for n in two} == {(32, 8), (128, 8)}
    only = space.neighbours(point, among=["num_warps"])
    assert [(n["block_m"], n["num_warps"]) for n in only] == [(64, 8)]


def test_a_coupled_pair_moves_as_one_step_after_the_single_moves() -> None:
    from flashtune.kernels.config import HOPPER

    space = SearchSpace.subgrid("fwd", variant=(HOPPER,), persistent=(0, 1),
                                tile_order=(0, 1, 2), pingpong=(0, 1))
    point = space.project({"variant": HOPPER, "persistent": 0, "tile_order": 1})
    assert point is not None

    def moved(n: dict) -> tuple:
        return n["persistent"], n["tile_order"], n["pingpong"]

    nbrs = [moved(n) for n in space.neighbours(point)]
    singles = {(1, 1, 0), (0, 0, 0), (0, 2, 0), (0, 1, 1)}
    assert set(nbrs[:4]) == singles  # the single moves come first
    assert set(nbrs[4:]) == {(1, 0, 0), (1, 2, 0)}  # then the pair, both fields moved
    # Radius 2 is unchanged: any two fields, the pair among them.
    two = {moved(n) for n in space.neighbours(point, radius=2)}
    assert {(1, 0, 0), (1, 2, 0), (1, 1, 1), (0, 0, 1), (0, 2, 1)} == two
    # A pair with a field held fixed is no step.
    pinned = SearchSpace.subgrid("fwd", variant=(HOPPER,), persistent=(0, 1), pingpong=(0, 1))
    p2 = pinned.project({"variant": HOPPER})
    assert p2 is not None and len(pinned.neighbours(p2)) == 2


def test_every_register_cap_is_one_step_from_the_compilers_choice() -> None:
    space = SearchSpace.subgrid("bwd", maxnreg=(0, 128, 168, 200, 232, 255))
    point = space.project({"maxnreg": 0})
    assert point is not None
    caps = sorted(n["maxnreg"] for n in space.neighbours(point))
    assert caps == [128, 168, 200, 232, 255]
    # From a cap, every other cap and the compiler's choice are one step away.
    mid = space.project({"maxnreg": 200})
    assert mid is not None and sorted(n["maxnreg"] for n in space.neighbours(mid)) == \
        [0, 128, 168, 232, 255]


def test_parts_group_the_backward_fields_by_launch() -> None:
    assert SearchSpace.full("fwd").parts == {}
    parts = SearchSpace.full("bwd").parts
    assert set(parts) == {"pre", "dkdv", "dq"}
    assert all(f.startswith(p) for p, fs in parts.items() for f in fs)
    owned = {f for fs in parts.values() for f in fs}
    # shared by every launch: the register cap, and the variant that picks the launches
    # Shared: the variant, and the knobs of the one-launch Hopper kernel.
    hopper = {f for f in config_fields(BwdConfig) if f.startswith("hopper_")}
    assert set(config_fields(BwdConfig)) - owned == {"maxnreg", "variant"} | hopper
    # Parts are the launches whose fields a space holds, even with those fields pinned.
    assert set(SearchSpace.subgrid("bwd", dq_block_n=(16, 32)).parts) == {"pre", "dkdv", "dq"}
    assert SearchSpace.full("fwd").compose([({"block_m": 64}, {"fwd": 1.0})]) == []


def test_compose_finds_the_optimum_of_an_additive_cost_from_few_records() -> None:
    import random

    space = SearchSpace.subgrid("bwd", dkdv_block_m=(16, 32, 64), dkdv_block_n=(32, 64, 128),
                                dq_block_n=(16, 32, 64), dq_warps=(4, 8), maxnreg=(0, 128))
    rng = random.Random(1234)
    parts = space.parts
    cost: dict[tuple, float] = {}

    def part_cost(part: str, params: dict) -> float:
        key = (part, *(params[f] for f in parts[part]), params["maxnreg"])
        return cost.setdefault(key, rng.uniform(0.1, 1.0))

    def times(params: dict) -> dict[str, float]:
        return {part: part_cost(part, params) for part in parts}

    grid = list(space.grid())
    truth = min(grid, key=lambda g: sum(times(g).values()))
    # Records: every part setting seen (per maxnreg) in few configs: each dK/dV setting
    # paired with two dQ settings in turn, not crossed with all six; the optimum itself
    # is left out, so it can only be found by recombining.
    dk = [g for g in grid if g["dq_block_n"] == 16 and g["dq_warps"] == 4]
    dq = [g for g in grid if g["dkdv_block_m"] == 16 and g["dkdv_block_n"] == 32]
    records = []
    seen: dict[int, int] = {}
    for g in dk:
        i = seen[g["maxnreg"]] = seen.get(g["maxnreg"], -1) + 1
        mates = [d for d in dq if d["maxnreg"] == g["maxnreg"]]
        for mate in (mates[i % 6], mates[(i + 1) % 6]):
            p = {**g, "dq_block_n": mate["dq_block_n"], "dq_warps": mate["dq_warps"]}
            if p != truth:
                records.append((p, times(p)))
    assert len(records) < len(grid) // 3
    ranked = space.compose(records)
    assert len(ranked) == 2  # one candidate per maxnreg setting
    predicted, best = ranked[0]
    assert best == truth
    assert predicted == pytest.approx(sum(times(truth).values()))
    assert ranked[1][0] >= predicted
    # Records without part times (or outside the space) are ignored, not guessed at.
    assert space.compose([(truth, {"dq": 0.1})]) == []


def test_part_moves_step_every_launch_to_an_untried_neighbour() -> None:
    space = SearchSpace.subgrid("bwd", dkdv_block_m=(16, 32, 64), dkdv_warps=(4, 8),
                                dq_block_n=(16, 32, 64), maxnreg=(0, 128))
    base = space.project({"dkdv_block_m": 32, "dkdv_warps": 4, "dq_block_n": 32})
    assert base is not None
    tried = {space.part_setting(part, base) for part in space.parts}
    cand = space.part_moves(base, tried)
    assert cand is not None
    # One trial moves one field of dK/dV and one of dQ, never a shared field (maxnreg).
    assert (cand["dkdv_block_m"], cand["dkdv_warps"]) in {(16, 4), (64, 4), (32, 8)}
    assert cand["dq_block_n"] in (16, 64)
    assert cand["maxnreg"] == base["maxnreg"] and cand["pre_block_m"] == base["pre_block_m"]
    # Tried settings are skipped; a launch with none left stays put while the other moves.
    seen = set(tried)
    for _ in range(2):
        assert cand is not None
        seen |= {space.part_setting(part, cand) for part in space.parts}
        cand = space.part_moves(base, seen)
    assert cand is not None and cand["dq_block_n"] == base["dq_block_n"]
    assert (cand["dkdv_block_m"], cand["dkdv_warps"]) != (base["dkdv_block_m"], 4)
    seen |= {space.part_setting(part, cand) for part in space.parts}
    assert space.part_moves(base, seen) is None
    # The same launch setting under another shared value is a different setting.
    other = {**base, "maxnreg": 128}
    assert space.part_setting("dq", other) != space.part_setting("dq", base)
    assert space.part_moves(other, seen) is not None
    assert SearchSpace.full("fwd").part_moves({}, set()) is None


def test_backward_variants_sampled_are_those_the_problem_allows() -> None:
    import optuna

    from flashtune.kernels.config import (
        BWD_ATOMIC,
        BWD_FUSED,
        BWD_ONE_LAUNCH,
        BWD_TWO_KERNEL,
        active_fields,
    )

    space = SearchSpace.full("bwd")
    det, free = P, dataclasses.replace(P, deterministic=False)
    assert space.variants() == [0, 1, 2, 3, 4]  # all declared; 3 is the Hopper kernel
    assert space.variants(det) == [BWD_TWO_KERNEL, BWD_ONE_LAUNCH, BWD_FUSED]
    assert space.variants(free) == [BWD_TWO_KERNEL, BWD_ATOMIC, BWD_ONE_LAUNCH, BWD_FUSED]
    assert SearchSpace.full("fwd").variants(det) == list(config_fields(FwdConfig)["variant"])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for problem, expect in ((det, {0, 2, 4}), (free, {0, 1, 2, 4})):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        seen = set()
        for _ in range(60):
            trial = study.ask()
            cfg = space.suggest(trial, problem)
            seen.add(cfg.variant)
            # Define-by-run: only the variant's own knobs are asked for.
            assert set(trial.params) == set(active_fields(BwdConfig, cfg.variant))
            study.tell(trial, 1.0)
        assert seen == expect, (problem.deterministic, seen)


def test_compose_never_splits_the_one_launch_backward() -> None:
    """The one-launch variant's time depends on the dK/dV and dQ fields at once: its
    records ("pre" and "dkdv+dq") are not recombined part by part."""
    from flashtune.kernels.attn_bwd import ONE_LAUNCH_PART
    from flashtune.kernels.config import BWD_ONE_LAUNCH, BWD_TWO_KERNEL

    space = SearchSpace.full("bwd")
    one = space.complete({"variant": BWD_ONE_LAUNCH, "dq_block_n": 64})
    two = space.complete({"variant": BWD_TWO_KERNEL})
    assert space.compose([(one, {"pre": 0.1, ONE_LAUNCH_PART: 1.0})]) == []
    ranked = space.compose([(one, {"pre": 0.1, ONE_LAUNCH_PART: 1.0}),
                            (two, {"pre": 0.1, "dkdv": 0.5, "dq": 0.6})])
    assert [p for _, p in ranked] == [two]


def test_two_and_three_consumers_are_one_coupled_step_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A third consumer warpgroup (block_m 128 -> 192) is feasible only at 152-160 consumer
    registers, two consumers only above them: the pair moves as one step, any register
    count being one step from any other, so a search polishing a two-consumer incumbent
    reaches the three-consumer tiles, and back."""
    from flashtune.autotune.space import COUPLED, UNORDERED
    from flashtune.kernels import config
    from flashtune.kernels.config import HOPPER, config_from_dict, config_to_dict, is_feasible

    monkeypatch.setattr(config, "hopper_support", lambda: "")  # the target checks pass
    assert ("block_m", "consumer_regs") in COUPLED and "consumer_regs" in UNORDERED
    space = SearchSpace.full("fwd")
    p = Problem(1, 32, 32, 16384, 16384, 64, "bf16", False)

    def feasible_moves(cfg: FwdConfig) -> set[tuple[int, int]]:
        point = space.project(config_to_dict(cfg))
        assert point is not None
        return {(n["block_m"], n["consumer_regs"]) for n in space.neighbours(point)
                if is_feasible(config_from_dict("fwd", n), p)[0]}

    two = FwdConfig(variant=HOPPER, block_m=128, block_n=128, consumer_regs=232, persistent=1,
                    tile_order=1)
    assert {(192, 152), (192, 160)} <= feasible_moves(two)
    three = FwdConfig(variant=HOPPER, block_m=192, block_n=128, consumer_regs=160)
    assert {(128, 216), (128, 232), (128, 240)} <= feasible_moves(three)
