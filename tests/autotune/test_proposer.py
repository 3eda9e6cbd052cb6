"""Where the search's candidates come from and what reaches the tuning database: the
sampler's in-memory proposer, polishing under a time budget, and the compiles of the next
polishing points started ahead of their turn.

The tuner runs for real (Optuna, the search loop, the SQLite record); the measurement
worker and the compile pool are stand-ins that answer at once and keep a log, so the
order of events can be checked without kernels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import optuna
import pytest

from flashtune.autotune import SearchSpace, TuneSession, tune
from flashtune.autotune.space import UNORDERED
from flashtune.kernels import config
from flashtune.kernels.config import (
    BWD_FUSED,
    BWD_ONE_LAUNCH,
    BWD_TWO_KERNEL,
    BwdConfig,
    FwdConfig,
    config_to_dict,
    default_bwd,
    default_config,
)
from flashtune.problem import Problem

PROBLEM = Problem(batch=2, heads_q=4, heads_kv=4, seqlen_q=256, seqlen_k=256, head_dim=64)


# Every field's default (the forward's and the backward's names do not clash but for
# ``variant``, whose default is the portable kernel in both).
_DEFAULTS = {**config_to_dict(FwdConfig()), **config_to_dict(BwdConfig())}


def _ms(cfg: dict[str, Any]) -> float:
    """A fixed landscape: a pseudo-random time per config, of the fields it sets away from
    their defaults, so that a knob added at its default leaves every other config's time
    as it was (the search's trajectory, which these tests follow, then moves only where
    the search tries the new knob)."""
    moved = sorted((k, v) for k, v in cfg.items() if _DEFAULTS.get(k, object()) != v)
    h = hashlib.sha256(json.dumps(moved).encode()).digest()
    return 1.0 + int.from_bytes(h[:4], "little") / 2**32


BWD = SearchSpace.full("bwd")


def _time(direction: str, cfg: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """(ms, {launch: ms}): a backward's time is the sum of its launches', each a
    pseudo-random time of its own fields and the shared ones."""
    if direction == "fwd":
        return _ms(cfg), {}
    parts = {part: _ms({f: cfg[f] for f in [*fields, *BWD.shared]})
             for part, fields in BWD.parts.items()}
    return sum(parts.values()), parts


class Clock:
    """Simulated time, in trials: measuring a candidate takes 1; building a kernel takes
    :data:`COMPILE` (on the H200 a backward config's compile took 1.3-3.2 s and a trial
    0.1-0.3 s: several trials); a config whose kernels are all built already only loads
    them (:data:`LOAD`)."""

    COMPILE, LOAD = 4.0, 0.2

    def __init__(self) -> None:
        self.now = self.waited = 0.0


class LogWorker:
    restarts = 0

    def __init__(self, log: list[tuple[str, tuple[Any, ...]]], clock: Clock) -> None:
        self.log, self.clock = log, clock

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        d = msg["direction"]
        self.clock.now += 1.0
        if msg["op"] == "prepare":
            self.log.append(("prepare", ()))
            return {"status": "ok", "seconds": 0.0}
        if msg["op"] == "measure":
            self.log.append(("measure", tuple(sorted(msg["config"].items()))))
            ms, parts = _time(d, msg["config"])
            return {"status": "ok", "median_ms": ms, "p20_ms": ms, "p80_ms": ms,
                    "parts_ms": parts, "compile_s": 0.0, "max_error": 0.0, "ratio": 0.0}
        return {"status": "ok", "timings": [
            {"median_ms": _time(d, c)[0], "p20_ms": _time(d, c)[0],
             "p80_ms": _time(d, c)[0], "interpreter": False} for c in msg["configs"]]}


class Compiling(Future):  # type: ignore[type-arg]
    """A compile running until the simulated clock reaches ``ready_at``; the search
    waiting for it moves the clock there (the wait is summed in ``Clock.waited``)."""

    def __init__(self, clock: Clock, ready_at: float) -> None:
        super().__init__()
        self.clock, self.ready_at = clock, ready_at

    def done(self) -> bool:
        if not super().done() and self.clock.now >= self.ready_at:
            self.set_result((0.0, ""))
        return super().done()

    def cancel(self) -> bool:
        return not self.done() and super().cancel()

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self.clock.waited += self.ready_at - self.clock.now
            self.clock.now = self.ready_at
            self.set_result((0.0, ""))
        return super().result(timeout)


class LogPool:
    """Compiles in simulated time, kernel by kernel: a backward's launches are built (and
    cached) separately, so a config whose launches were all built before only loads."""

    busy_seconds = 0.0
    n = 8  # workers

    def __init__(self, log: list[tuple[str, tuple[Any, ...]]], clock: Clock) -> None:
        self.log, self.clock = log, clock
        self.kernels: dict[tuple[Any, ...], float] = {}  # kernel -> when it is built

    def submit(self, problem: Any, direction: str, config: dict[str, Any]
               ) -> Future[tuple[float, str]]:
        self.log.append(("compile", tuple(sorted(config.items()))))
        kernels = [BWD.part_setting(part, config) for part in BWD.parts] \
            if direction == "bwd" else [tuple(sorted(config.items()))]
        now = self.clock.now
        built = [self.kernels.setdefault(k, now + Clock.COMPILE) for k in kernels]
        return Compiling(self.clock, max(now + Clock.LOAD, *built))

    def close(self) -> None:
        pass


class LogSession(TuneSession):
    def __init__(self) -> None:  # noqa: D107 - no processes; everything answers at once
        self.interpret = False
        self.compile_workers = LogPool.n
        self.log: list[tuple[str, tuple[Any, ...]]] = []
        self.clock = Clock()
        self._pool = LogPool(self.log, self.clock)  # type: ignore[assignment]
        self.worker = LogWorker(self.log, self.clock)  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # What this machine can run is checked once per process, and the answer depends on
    # the interpreter: it must not outlive these tests (the others run interpreted).
    checks = (config.hopper_support, config.descriptor_reduce_support)
    for check in checks:
        check.cache_clear()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    for check in checks:
        check.cache_clear()


def _measured(db: Any, name: str) -> list[Any]:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{db}")
    return [t for t in study.trials if t.user_attrs.get("measured")]


def test_time_budget_polishes_as_soon_as_the_seeds_are_measured(tmp_path) -> None:
    db = tmp_path / "tuning.db"
    space = SearchSpace.full("fwd")
    # Ten trials without a 0.5% gain end it long before the time budget.
    session = LogSession()
    r = tune(PROBLEM, "fwd", time_budget=600, patience=10, storage=db, retime_rounds=0,
             session=session, store=False)
    measured = _measured(db, r.study_name)
    sources = [t.user_attrs.get("seed_source", "sampler") for t in measured]
    assert sources[0] == "default" and sources[1] == "polish"
    default = config_to_dict(default_config("fwd", PROBLEM))
    assert space.complete(measured[1].params) in space.neighbours(default)
    # With the trial count unknown, polishing leaves the sampler nothing while it finds
    # untried neighbours (the old rule waited for 20 trials).
    assert sources[:6].count("sampler") == 0, sources
    # Nor does it compile the sampler's picks ahead while polishing has points to offer:
    # up to the first polishing trial the pool built the default and polishing points
    # (one or two steps from the default, compiled ahead while the default was measured).
    first_polish = tuple(sorted(space.complete(measured[1].params).items()))
    built = [cfg for kind, cfg in session.log[:session.log.index(("measure", first_polish))]
             if kind == "compile"]
    polish = {tuple(sorted(n.items())) for r in (1, 2) for n in space.neighbours(default, r)}
    assert built[0] == tuple(sorted(default.items()))
    assert built[1:] and all(c in polish for c in built[1:]), built


def test_sampler_picks_that_cannot_run_never_reach_the_database(tmp_path) -> None:
    db = tmp_path / "tuning.db"
    # One row-block of 16 and 16 warps: every 16-warp point is infeasible.
    space = SearchSpace.subgrid("fwd", block_m=16, block_n=(16, 32, 64),
                                num_warps=(1, 2, 16), num_stages=(1, 2))
    r = tune(PROBLEM, "fwd", trials=4, space=space, storage=db, retime_rounds=0, seed=0,
             warm_start=False, session=LogSession(), store=False)
    assert r.infeasible > 0 and r.trials == 4
    study = optuna.load_study(study_name=r.study_name, storage=f"sqlite:///{db}")
    # The record holds the four measured candidates and nothing else; the infeasible
    # picks are counted by reason on the study.
    assert len(study.trials) == 4 and all(t.user_attrs.get("measured") for t in study.trials)
    picks = study.user_attrs["infeasible_picks"]
    assert sum(picks.values()) == r.infeasible and all("16 warps" in k for k in picks)
    # A resumed search's sampler starts from what ran: the budget is spent already.
    again = tune(PROBLEM, "fwd", trials=4, space=space, storage=db, retime_rounds=0, seed=0,
                 warm_start=False, session=LogSession(), store=False)
    assert again.trials == 4 and len(optuna.load_study(
        study_name=r.study_name, storage=f"sqlite:///{db}").trials) == 4


def test_next_polishing_points_compile_before_their_turn(tmp_path) -> None:
    db = tmp_path / "tuning.db"
    session = LogSession()
    r = tune(PROBLEM, "fwd", trials=12, storage=db, retime_rounds=0, seed=1,
             session=session, store=False)
    measured = _measured(db, r.study_name)
    polish = [t for t in measured if t.user_attrs.get("seed_source") == "polish"]
    assert len(polish) >= 3
    log = session.log
    measures = [i for i, (kind, _) in enumerate(log) if kind == "measure"]
    space = SearchSpace.full("fwd")
    ahead = 0
    for t in polish:
        cfg = tuple(sorted(space.complete(t.params).items()))
        compiles = [i for i, e in enumerate(log) if e == ("compile", cfg)]
        run = next(i for i, e in enumerate(log) if e == ("measure", cfg))
        assert len(compiles) == 1  # compiled once, whether ahead or when asked
        before = [m for m in measures if m < run]
        # Compiled before the trial ahead of it was measured: it waited for nothing.
        ahead += bool(before) and compiles[0] < before[-1]
    assert ahead >= len(polish) - 1


def test_a_polishing_move_may_change_the_kernel_variant() -> None:
    space = SearchSpace.full("bwd")
    p = Problem(batch=2, heads_q=4, heads_kv=4, seqlen_q=512, seqlen_k=512, head_dim=64,
                causal=True)
    base = config_to_dict(default_bwd(p, BWD_TWO_KERNEL))
    assert "variant" in UNORDERED
    moves = [n for n in space.neighbours(base, among=["variant"])
             if space.feasible(space.config(n), p)[0]]
    # Variant 1 (atomic dQ) lies between 0 and 2 in the declared order and cannot serve
    # a deterministic problem; the one-launch backward and the fused one are still one
    # step away, with the knobs they do not use back at their defaults.
    assert [n["variant"] for n in moves] == [BWD_ONE_LAUNCH, BWD_FUSED]
    assert moves[1]["pre_block_m"] == space.config({}).pre_block_m  # type: ignore[union-attr]
    assert moves[0]["dq_stages"] == space.config({}).dq_stages  # type: ignore[union-attr]
    assert moves[0]["dkdv_block_n"] == base["dkdv_block_n"]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_compiling_the_next_polishing_points_ahead_cuts_the_wait(
        tmp_path, monkeypatch: pytest.MonkeyPatch, direction: str) -> None:
    """On the simulated clock (a compile takes four trials, a backward's launches are
    built one by one), the search waits for compiles far less when the next polishing
    points compile ahead, and the compiles started ahead never run on more than the
    pool's workers less the ones kept free for a candidate asked for now."""
    import flashtune.autotune.search as search_mod

    def run(prefetch: int) -> LogSession:
        monkeypatch.setattr(search_mod, "PREFETCH", prefetch)
        session = LogSession()
        ahead_running: list[int] = []
        submit = session._pool.submit  # type: ignore[union-attr]
        prefetching = [False]
        plain_prefetch = search_mod.Search._prefetch

        def flagged(self: Any) -> None:
            prefetching[0] = True
            try:
                plain_prefetch(self)
            finally:
                prefetching[0] = False

        def counted(problem: Any, d: str, config: dict[str, Any]) -> Future[Any]:
            fut = submit(problem, d, config)
            if prefetching[0]:
                ahead.append(fut)
                ahead_running.append(sum(not f.done() for f in ahead))
            return fut

        ahead: list[Future[Any]] = []
        monkeypatch.setattr(search_mod.Search, "_prefetch", flagged)
        session._pool.submit = counted  # type: ignore[union-attr,method-assign]
        tune(PROBLEM, direction, time_budget=600, patience=15, retime_rounds=0,
             storage=tmp_path / f"p{prefetch}.db", session=session, store=False)
        # Candidates asked for now (the sampler's lookahead) take the reserved workers.
        assert max(ahead_running, default=0) <= LogPool.n - search_mod.PREFETCH_RESERVE, \
            ahead_running
        assert bool(ahead_running) == bool(prefetch)
        return session

    ahead, alone = run(search_mod.PREFETCH), run(0)
    assert ahead.clock.waited <= 0.5 * alone.clock.waited, \
        (ahead.clock.waited, alone.clock.waited)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_the_gpu_measures_built_points_while_the_next_candidate_compiles(
        tmp_path, monkeypatch: pytest.MonkeyPatch, direction: str) -> None:
    """Under a time budget counted on the simulated clock, a search that measures built
    points while the head of its queue compiles waits for compiles at most half as long,
    and measures more candidates in the same budget, than one that waits; and it never
    measures a point twice."""
    import flashtune.autotune.search as search_mod
    import flashtune.autotune.tuner as tuner_mod

    def run(fill: bool) -> LogSession:
        monkeypatch.setattr(search_mod, "FILL_WAITS", fill)
        session = LogSession()
        clock = types.SimpleNamespace(perf_counter=lambda: session.clock.now)
        monkeypatch.setattr(search_mod, "time", clock)
        monkeypatch.setattr(tuner_mod, "time", clock)
        tune(PROBLEM, direction, time_budget=30, retime_rounds=0, session=session,
             storage=tmp_path / f"{direction}{fill}.db", store=False)
        return session

    filled, waited = run(True), run(False)
    measured = [cfg for kind, cfg in filled.log if kind == "measure"]
    assert len(set(measured)) == len(measured)
    assert len(measured) > sum(kind == "measure" for kind, _ in waited.log)
    assert filled.clock.waited <= 0.5 * waited.clock.waited, \
        (filled.clock.waited, waited.clock.waited)


def test_under_a_time_budget_the_first_seeds_neighbours_compile_before_any_measurement(
        tmp_path) -> None:
    """Polishing starts from the seeds, so their neighbours are the first candidates after
    them: with a time budget they compile while the worker prepares the problem, before
    anything is measured. With a trial budget the sampler runs first, and nothing is
    compiled ahead before its share of the trials."""
    space = SearchSpace.full("fwd")
    default = config_to_dict(default_config("fwd", PROBLEM))
    near = {tuple(sorted(n.items())) for n in space.neighbours(default)}

    def before_first_measure(**budget: Any) -> list[tuple[Any, ...]]:
        session = LogSession()
        tune(PROBLEM, "fwd", retime_rounds=0, session=session, store=False,
             storage=tmp_path / f"{sorted(budget)}.db", **budget)
        kinds = [kind for kind, _ in session.log]
        return [cfg for kind, cfg in session.log[:kinds.index("measure")] if kind == "compile"]

    timed = before_first_measure(time_budget=600, patience=5)
    assert timed[0] == tuple(sorted(default.items()))
    assert sum(cfg in near for cfg in timed) >= 3, timed
    counted = before_first_measure(trials=6)
    assert not any(cfg in near for cfg in counted), counted


def test_the_worker_prepares_the_problem_while_the_first_candidate_compiles(tmp_path) -> None:
    session = LogSession()
    tune(PROBLEM, "bwd", trials=3, retime_rounds=0, storage=tmp_path / "t.db",
         session=session, store=False)
    kinds = [kind for kind, _ in session.log]
    # Asked once, after the first compile was submitted and before the first measurement.
    assert kinds.count("prepare") == 1
    assert kinds.index("compile") < kinds.index("prepare") < kinds.index("measure")


def test_a_one_launch_incumbent_is_polished_field_by_field() -> None:
    """A backward incumbent of a one-launch variant is polished around itself, one field
    at a time, not by moving the launches of the fastest two-kernel mix."""
    from flashtune.autotune.candidates import Seen, by_launch, polish_point, sig

    p = replace_problem(deterministic=True)
    default = BWD.complete(config_to_dict(default_bwd(p, BWD_TWO_KERNEL)))
    fused = next(n for n in BWD.neighbours(default, among=["variant"])
                 if n["variant"] == BWD_ONE_LAUNCH)  # its unused knobs at their defaults
    times = {sig(default): (default, {"pre": 0.1, "dkdv": 0.5, "dq": 0.4}),
             sig(fused): (fused, {"pre": 0.1, "dkdv+dq": 0.8})}
    done = {sig(default): object(), sig(fused): object()}
    two = Seen(BWD, p, done, times, default, [])
    one = Seen(BWD, p, done, times, fused, [])
    assert by_launch(two) and not by_launch(one)
    point = polish_point(one, set())
    assert point is not None and point["variant"] == BWD_ONE_LAUNCH
    assert point in BWD.neighbours(fused)  # one field moved from the incumbent
    moved = polish_point(two, set())
    assert moved is not None and moved["variant"] == default["variant"]
    # Before anything is timed (the points compiled ahead around a seed, under a time
    # budget), the variant decides: a one-launch seed is still polished field by field,
    # and a two-kernel one by launch.
    seed_one, seed_two = (Seen(BWD, p, {}, {}, c, []) for c in (fused, default))
    assert not by_launch(seed_one) and by_launch(seed_two)
    first = polish_point(seed_one, set())
    assert first is not None and first in BWD.neighbours(fused)


def replace_problem(**kw: Any) -> Problem:
    from dataclasses import replace

    return replace(PROBLEM, **kw)


def test_the_seeds_include_the_default_in_every_other_kernel_variant() -> None:
    from dataclasses import replace

    from flashtune.autotune.tuner import _seed_configs
    from flashtune.db.fingerprint import device_info, software_info

    here, sw = device_info(), software_info()
    default = config_to_dict(default_config("bwd", PROBLEM))
    assert default["variant"] == BWD_FUSED  # a host-bound problem's default
    for deterministic, variants in ((False, [4, 0, 1, 2]), (True, [4, 0, 2])):
        # On this machine (no Hopper GPU) the Hopper kernels cannot serve, nor can the
        # atomic dQ backward a deterministic problem: the default first, then the others.
        p = replace(PROBLEM, deterministic=deterministic)
        seeds = _seed_configs(None, here, sw, p, "bwd", BWD, shipped=False)
        assert [s for _, s in seeds] == ["default"] + ["variant"] * (len(variants) - 1)
        assert [pt["variant"] for pt, _ in seeds] == variants
        for pt, _ in seeds[1:]:  # the default's tiles, where the variant has them
            assert pt["dkdv_block_m"] == default["dkdv_block_m"]
            assert BWD.feasible(BWD.config(pt), p)[0]
    fwd = SearchSpace.full("fwd")
    assert [s for _, s in _seed_configs(None, here, sw, PROBLEM, "fwd", fwd,
                                        shipped=False)] == ["default"]


def test_a_hopper_default_forward_is_seeded_with_the_portable_heuristic_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flashtune.autotune.tuner import _seed_configs
    from flashtune.db.fingerprint import device_info, software_info

    # As on an sm90 GPU, where the forward's default is a Hopper kernel: the portable
    # family's own heuristic is seeded, not only the Hopper default's tiles as portable.
    monkeypatch.setattr(config, "hopper_support", lambda: "")
    p = Problem(batch=8, heads_q=16, heads_kv=16, seqlen_q=2048, seqlen_k=2048, head_dim=128,
                causal=True)
    fwd = SearchSpace.full("fwd")
    default = config_to_dict(default_config("fwd", p))
    assert default["variant"] == config.HOPPER
    seeds = _seed_configs(None, device_info(), software_info(), p, "fwd", fwd, shipped=False)
    portable = fwd.project(config_to_dict(config.default_portable_fwd(p)))
    assert (portable, "variant") in seeds
    assert seeds[0] == (fwd.project(default), "default")
    monkeypatch.undo()  # on this machine the default is portable: nothing more to seed
    assert [s for _, s in _seed_configs(None, device_info(), software_info(), p, "fwd", fwd,
                                        shipped=False)] == ["default"]


def test_a_backward_whose_default_is_hopper_seeds_the_portable_heuristics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Since session 42 a deterministic backward of 1k+ queries and keys defaults to the
    Hopper kernel on sm90; the variant seeds would then carry only its (unused) portable
    fields at their dataclass defaults, so each portable variant's own heuristic config
    is seeded too."""
    from flashtune.autotune.tuner import _seed_configs
    from flashtune.db.fingerprint import device_info, software_info

    monkeypatch.setattr(config, "hopper_support", lambda: "")
    p = Problem(batch=4, heads_q=16, heads_kv=16, seqlen_q=2048, seqlen_k=2048, head_dim=128,
                causal=True, deterministic=True)
    bwd = SearchSpace.full("bwd")
    assert default_config("bwd", p).variant == config.BWD_HOPPER
    seeds = _seed_configs(None, device_info(), software_info(), p, "bwd", bwd, shipped=False)
    two = bwd.project(config_to_dict(config.default_bwd(p, config.BWD_TWO_KERNEL)))
    assert two is not None and (two, "variant") in seeds
    one = bwd.project(config_to_dict(config.default_bwd(p, config.BWD_ONE_LAUNCH)))
    assert one is not None and (one, "variant") in seeds
    # The atomic variant cannot serve a deterministic call: never seeded.
    assert all(pt["variant"] != config.BWD_ATOMIC for pt, _ in seeds)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_sm90_backward_prior_moves_the_default_where_long_searches_went(
        head_dim: int) -> None:
    from flashtune.autotune.priors import prior_points

    p = Problem(batch=3, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000,
                head_dim=head_dim, causal=True)
    points = prior_points("bwd", p, "9.0")
    assert points, "the sm90 backward has a prior"
    assert len({json.dumps(pt, sort_keys=True) for pt in points}) == len(points)
    for pt in points:
        base = config_to_dict(config.default_bwd(p, pt["variant"]))
        assert pt["variant"] in (config.BWD_TWO_KERNEL, BWD_ONE_LAUNCH)
        assert config.is_feasible(config.BwdConfig(**pt), p)[0]
        assert BWD.project(pt) == pt
        # Every point widens the dQ kernel's key step and runs it with two stages.
        assert (pt["dq_block_n"], pt["dq_stages"]) == (2 * base["dq_block_n"], 2)
    # The first point also moves the dK/dV tile the way the head dim calls for.
    first = points[0]
    base = config_to_dict(config.default_bwd(p, first["variant"]))
    assert first["variant"] == BWD_ONE_LAUNCH
    if head_dim > 64:
        assert first["dkdv_block_m"] == 2 * base["dkdv_block_m"]
        # No register cap at head dim 128: the compiler's choice, as the winners left it.
        assert all(pt["maxnreg"] == 0 for pt in points)
    else:
        assert first["dkdv_block_n"] == base["dkdv_block_n"] // 2
        # At head dim 64 the first point caps the registers (168 when causal, 255 when
        # not, as the shipped winners did), and the same point uncapped follows it.
        assert first["maxnreg"] == 168
        assert points[1] == {**first, "maxnreg": 0}
        open_p = Problem(batch=3, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000,
                         head_dim=head_dim)
        assert prior_points("bwd", open_p, "9.0")[0]["maxnreg"] == 255
    # A short sequence keeps its tiles within the rows it has, and in the space.
    short = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=16, seqlen_k=16, head_dim=head_dim)
    short_points = prior_points("bwd", short, "9.0")
    assert short_points
    for pt in short_points:
        assert BWD.project(pt) == pt
        assert max(pt["dq_block_n"], pt["dkdv_block_m"], pt["dq_block_m"]) == 16, pt
    # No prior for another architecture, the interpreter or the forward.
    assert prior_points("bwd", p, "8.0") == []
    assert prior_points("bwd", p, "cpu") == []
    assert prior_points("fwd", p, "9.0") == []


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_sm90_backward_prior_gives_the_hopper_kernel_128_query_rows_at_head_dim_64(
        deterministic: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Hopper backward can run, its prior points come last: at head dim 64 its
    default with 128-row query tiles (the variant seeds carry only the default's 64) and K
    and V read from shared memory, as the prior was measured (the default holds them in
    registers at head dim 64 since session 42), then the same point one stage deeper with
    232 registers a consumer, where the long searches went, and the 128-row point with dQ
    staged in register order; at head dim 128, where such tiles cannot run, only the
    deeper default (whose dQ is staged in register order, which supersedes the column
    groups the fixed order's long-key points took before session 48); last, at either head
    dim, dQ in register order with its first turn stored (``hopper_dq_store_first``), in
    the fixed order, then that point with the call in two halves (``hopper_split``), and
    that one with dK and dV stored through TMA (``hopper_dkdv_tma``); at head dim 64 a
    deterministic call opens its Hopper points with the two-halves point with dQ's tiles
    split by rows (``hopper_dq_rows``, session 63). At head dim 128 the
    Hopper points open with that last point at the ring depth the shipped winners hold:
    three stages unmasked, one under a causal mask without GQA (none with GQA). A
    ``deterministic=False`` call then has the last point in the fixed order's staging
    without its turns (``hopper_dq_unordered``, session 67): after the ring-depth point at
    head dim 128, first at head dim 64."""
    from flashtune.autotune.priors import prior_points

    monkeypatch.setattr(config, "hopper_support", lambda: "")
    for head_dim, seqlen in ((64, 4096), (128, 4096), (128, 16384)):
        p = Problem(batch=2, heads_q=8, heads_kv=2, seqlen_q=seqlen, seqlen_k=seqlen,
                    head_dim=head_dim, deterministic=deterministic)
        points = prior_points("bwd", p, "9.0")
        hopper = [pt for pt in points if pt["variant"] == config.BWD_HOPPER]
        base = config_to_dict(config.default_bwd(p, config.BWD_HOPPER))
        deep = {"hopper_stages": 3, "hopper_regs": 232}
        # Last, dQ in register order with its first turn stored, in the fixed order, the
        # writer issuing both TMA ops at these lengths (more than 1k keys).
        first = {"hopper_dq_store_first": 2, **({} if deterministic else {"hopper_dq_fixed": 1})}
        unordered = {"hopper_dq_store_first": 0, "hopper_dq_unordered": 1}
        if head_dim > 64:
            assert (base["hopper_dq_frag"], base["hopper_dq_groups"]) == (1, 0)
            newest = {**base, **first, "hopper_split": 2, "hopper_dkdv_tma": 1}
            # Unmasked at head dim 128, first the last point with three stages (the shipped
            # winners' depth there), consumers keeping the default's registers; for a
            # deterministic=False call then the last point without the fixed order's turns.
            want = [{**newest, "hopper_stages": 3}]
            if not deterministic:
                want.append({**newest, **unordered})
            want += [{**base, **deep}, {**base, **first}, {**base, **first, "hopper_split": 2},
                     newest]
            assert hopper == points[-len(want):] == want
        else:
            assert base["hopper_kv_regs"] == 1 and base["hopper_dq_frag"] == 0
            rows = {**base, "hopper_block_m": 128, "hopper_kv_regs": 0}
            # In the fixed dQ order, the deeper point and a third one stage dQ in column
            # groups; the third holds K and V in registers again; the last stages it in
            # register order.
            groups = {"hopper_dq_groups": 1} if deterministic else {}
            # A deterministic call first tries the likeliest winner: the two-halves point
            # with dQ's tiles split by rows (hopper_dq_rows, session 63; first since 64).
            want = [{**rows, "hopper_dq_frag": 1, **first, "hopper_split": 2,
                     "hopper_dq_rows": 1}] if deterministic else []
            # A deterministic=False call: dQ in register order, two halves, dK and dV by
            # TMA, in the fixed order's staging without its turns (hopper_dq_unordered).
            if not deterministic:
                want.append({**rows, "hopper_dq_frag": 1, **first, "hopper_split": 2,
                             "hopper_dkdv_tma": 1, **unordered})
            want += [rows, {**rows, **deep, **groups}]
            if deterministic:
                want.append({**rows, **groups, "hopper_kv_regs": 1})
            want.append({**rows, "hopper_dq_frag": 1})
            want.append({**rows, "hopper_dq_frag": 1, **first})
            want.append({**rows, "hopper_dq_frag": 1, **first, "hopper_split": 2})
            want.append({**rows, "hopper_dq_frag": 1, **first, "hopper_split": 2,
                         "hopper_dkdv_tma": 1})
            assert hopper == points[-len(want):] == want
        for pt in hopper:
            assert pt["hopper_stages"] in (base["hopper_stages"], 3)
            assert config.is_feasible(config.BwdConfig(**pt), p)[0]
            assert BWD.project(pt) == pt
        # Under a causal mask without GQA, one stage (as the shipped winners there);
        # with GQA, only with one query head per program (the virtual-heads points).
        causal = dataclasses.replace(p, causal=True)
        mha = dataclasses.replace(causal, heads_kv=causal.heads_q)
        depth = [pt["hopper_stages"] for pt in prior_points("bwd", mha, "9.0")
                 if pt["variant"] == config.BWD_HOPPER and pt["hopper_dkdv_tma"]]
        gqa = [pt["hopper_stages"] for pt in prior_points("bwd", causal, "9.0")
               if pt["variant"] == config.BWD_HOPPER and pt["hopper_dkdv_tma"]
               and pt["hopper_kv_rep"] == 1]
        assert (1 in depth) == (head_dim == 128) and 1 not in gqa


def test_the_sm90_backward_prior_gives_long_gqa_walks_virtual_kv_heads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``hopper_kv_rep`` is seeded for GQA calls under a mask by the group's walk (query
    heads per KV head x keys), as sessions 58, 59 and 62 measured it: 4 at 32k and more, 2
    from 8k, none below, none unmasked or for groups under 4; an odd group (no r of 2 or 4
    divides it) the whole group from 7k; a
    ``deterministic=False`` call gets it in the fixed order, never in the free one. The
    seed is the last prior point, an earlier one (the call in two halves) with the knob,
    and the first Hopper points are, under 8 query heads a group, one head per program at
    one stage with TMA dK/dV, then that seed with three stages and 232 registers (as most
    shipped winners with virtual heads hold it); the move is one of those tried on stale
    and shipped winners (a free-order winner moved into the fixed order with it)."""
    from flashtune.autotune.priors import WINNER_MOVES, _hopper_kv_rep, prior_points

    monkeypatch.setattr(config, "hopper_support", lambda: "")
    for hq, hk, keys, want in ((32, 8, 8192, 4), (64, 8, 4096, 4), (32, 8, 4096, 2),
                               (64, 8, 2048, 2), (64, 8, 1024, 2), (32, 8, 2048, 2),
                               (32, 8, 1024, None), (16, 8, 16384, None),
                               (24, 4, 8192, 2), (24, 4, 1024, None), (28, 4, 8192, 7),
                               (28, 4, 2048, 7), (28, 4, 1024, 7), (28, 4, 512, None),
                               (40, 8, 4096, 5), (40, 8, 2048, 5), (40, 8, 1024, None)):
        p = Problem(batch=2, heads_q=hq, heads_kv=hk, seqlen_q=keys, seqlen_k=keys,
                    head_dim=128, causal=True)
        hopper = [pt for pt in prior_points("bwd", p, "9.0")
                  if pt["variant"] == config.BWD_HOPPER]
        got = [pt["hopper_kv_rep"] for pt in hopper if pt["hopper_kv_rep"] != 1]
        group = hq // hk
        # Under 8 query heads a group (head dim 128), first one head per program at one stage.
        single = [group] if want and group < 8 else []
        assert got == single + ([want, want] if want else []), (hq, hk, keys)
        if want:
            assert hopper[-1]["hopper_kv_rep"] == want
            # First among the Hopper points (after the one-head point), the same one stage
            # deeper with 232 registers.
            assert hopper[len(single)] == {**hopper[-1], "hopper_stages": 3,
                                           "hopper_regs": 232}
            if single:
                assert hopper[0] == {**hopper[-1], "hopper_kv_rep": group, "hopper_stages": 1,
                                     "hopper_regs": 240, "hopper_dkdv_tma": 1}
                assert config.is_feasible(config.BwdConfig(**hopper[0]), p)[0]
            assert {**hopper[-1], "hopper_kv_rep": 1} in hopper[:-1]  # the split point
            assert config.is_feasible(config.BwdConfig(**hopper[-1]), p)[0]
        assert _hopper_kv_rep({}, dataclasses.replace(p, causal=False)) == {}
        free = dataclasses.replace(p, deterministic=False)
        assert _hopper_kv_rep({"hopper_dq_fixed": 0}, free) == (
            {"hopper_kv_rep": want, "hopper_dq_fixed": 1} if want else {})
        last = [pt for pt in prior_points("bwd", free, "9.0")
                if pt["variant"] == config.BWD_HOPPER][-1]
        # None at head dim 64, where no GQA winner taught it.
        d64 = dataclasses.replace(p, head_dim=64)
        assert all(pt["hopper_stages"] != 1 for pt in prior_points("bwd", d64, "9.0")
                   if pt["variant"] == config.BWD_HOPPER)
        if want:
            assert (last["hopper_kv_rep"], last["hopper_dq_fixed"]) == (want, 1)
            assert config.is_feasible(config.BwdConfig(**last), free)[0]
        else:
            assert last["hopper_kv_rep"] == 1
    assert _hopper_kv_rep in WINNER_MOVES[9]


def test_the_prior_points_are_seeded_after_the_default_and_before_the_variants() -> None:
    from dataclasses import replace

    from flashtune.autotune.priors import prior_points
    from flashtune.autotune.tuner import _seed_configs
    from flashtune.db.fingerprint import device_info, software_info

    sw, cpu = software_info(), device_info("cpu")
    hopper = replace(cpu, name="NVIDIA H200", capability="9.0", sm_count=132, memory_gb=140)
    sources = [s for _, s in _seed_configs(None, hopper, sw, PROBLEM, "bwd", BWD,
                                           shipped=False)]
    n = len(prior_points("bwd", PROBLEM, "9.0"))
    assert n and sources[:n + 1] == ["default"] + ["prior"] * n
    assert set(sources[n + 1:]) <= {"variant"}
    assert "prior" not in [s for _, s in _seed_configs(None, cpu, sw, PROBLEM, "bwd", BWD,
                                                         shipped=False)]


def test_a_winner_is_seeded_again_with_the_knobs_that_landed_since(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key's stale winner (a Hopper backward from before ``hopper_dq_store_first``,
    ``hopper_split`` and ``hopper_dkdv_tma``) is followed in the seeds by itself with each
    knob: store-first =2 beyond 1k keys, =1 up to it, and in the fixed order for a
    ``deterministic=False`` call (which also tries the fixed order's staging without its
    turns, ``hopper_dq_unordered``); split in two where there are two sequences or KV heads;
    dK and dV stored with TMA; then the three together, dQ staged in register order (a
    winner staging it in rows or column groups moves to it). No such point for a winner a
    knob cannot serve (store-first alone: dQ staged in rows; all: a portable kernel), the
    forward or another architecture."""
    from dataclasses import replace

    from flashtune.autotune.priors import winner_points
    from flashtune.autotune.tuner import STALE_MIN_TRIALS, _seed_configs, seeded_min_trials
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import SoftwareInfo, device_info, software_info

    monkeypatch.setattr(config, "hopper_support", lambda: "")
    p = Problem(batch=2, heads_q=8, heads_kv=8, seqlen_q=4096, seqlen_k=4096, head_dim=128,
                causal=True, deterministic=True)
    won = {**config_to_dict(config.default_bwd(p, config.BWD_HOPPER)), "hopper_stages": 3,
           "hopper_regs": 232, "hopper_stagger": 0}
    assert won["hopper_dq_frag"] == 1 and won["hopper_dq_store_first"] == 0
    split = {**won, "hopper_split": 2}
    tma = {**won, "hopper_dkdv_tma": 1}
    both = {**tma, "hopper_dq_store_first": 2}  # the knobs together (_hopper_newest)
    assert winner_points("bwd", won, p, "9.0") == [{**won, "hopper_dq_store_first": 2}, split,
                                                   tma, both]
    short = replace(p, seqlen_q=1000, seqlen_k=1000)
    assert winner_points("bwd", won, short, "9.0") == [{**won, "hopper_dq_store_first": 1},
                                                       split, tma,
                                                       {**tma, "hopper_dq_store_first": 1}]
    free = replace(p, deterministic=False)
    # A deterministic=False call also tries the fixed order's staging without its turns.
    assert winner_points("bwd", won, free, "9.0") == [
        {**won, "hopper_dq_store_first": 2, "hopper_dq_fixed": 1}, split, tma,
        {**both, "hopper_dq_fixed": 1},
        {**won, "hopper_dq_fixed": 1, "hopper_dq_unordered": 1}]
    # One sequence of one KV head: nothing to split.
    alone = replace(p, batch=1, heads_q=1, heads_kv=1)
    assert winner_points("bwd", won, alone, "9.0") == [{**won, "hopper_dq_store_first": 2},
                                                       tma, both]
    # dQ staged in rows or column groups: store-first cannot serve it alone; all three
    # knobs together move it to register order.
    rows = {**won, "hopper_dq_frag": 0, "hopper_dq_groups": 1}
    portable = config_to_dict(config.default_bwd(p, BWD_ONE_LAUNCH))
    assert winner_points("bwd", rows, p, "9.0") == [
        {**rows, "hopper_split": 2}, {**rows, "hopper_dkdv_tma": 1},
        {**both, "hopper_dq_groups": 0}]
    assert winner_points("bwd", portable, p, "9.0") == []
    assert winner_points("bwd", won, p, "8.0") == winner_points("fwd", won, p, "9.0") == []
    assert winner_points("bwd", {**won, "hopper_dq_store_first": 2, "hopper_split": 2,
                                 "hopper_dkdv_tma": 1}, p, "9.0") == []

    # Through the seeds, from a database whose winner an older Triton tuned.
    here = replace(device_info("cpu"), name="NVIDIA H200", capability="9.0", sm_count=132,
                   memory_gb=140)
    now = software_info()
    before = SoftwareInfo(torch=now.torch, triton="3.8.0", cuda=now.cuda,
                          kernels_hash=now.kernels_hash, ptxas=now.ptxas)
    with open_storage(tmp_path / "tuning.db") as st:
        st.put_result(here, before, p.key("bwd"), won, problem=p, tflops=1.0, median_ms=2.0,
                      p20_ms=2.0, p80_ms=2.0, max_error=0.0, trials=9, search_seconds=1.0)
        seeds = _seed_configs(st, here, now, p, "bwd", BWD, shipped=False)
    assert [s for _, s in seeds[:6]] == ["stale"] + ["stale+"] * 4 + ["default"]
    assert seeds[0][0] == BWD.project(won)
    assert seeds[1][0] == BWD.project({**won, "hopper_dq_store_first": 2})
    assert seeds[2][0] == BWD.project(split)
    assert seeds[3][0] == BWD.project(tma)
    assert seeds[4][0] == BWD.project(both)
    # Such a search measures the winner's knob point too, however short its budget.
    assert seeded_min_trials(seeds) == STALE_MIN_TRIALS > 2
    assert seeded_min_trials([(won, "shipped"), (won, "shipped+")]) == STALE_MIN_TRIALS
    assert seeded_min_trials([(won, "shipped"), (won, "default"), (won, "prior")]) == 1


def test_polishing_takes_turns_with_the_other_kernel_familys_best(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hopper incumbent, and a portable point 6% behind it whose neighbour is the
    fastest of all: polishing that neighbour (in turn with the incumbent's) finds it;
    polishing only the incumbent's family would not, within the budget (with the rival
    margin set below zero, 0 of seeds 0-5 find it in 26 trials; with it, all six do,
    since the portable point's least polished fields go first; 20 trials sufficed before
    the three-consumer Hopper knobs widened the incumbent's neighbourhood, 24 before tile
    order 3 did)."""
    from flashtune.kernels.config import default_portable_fwd

    monkeypatch.setattr(config, "hopper_support", lambda: "")
    p = Problem(batch=8, heads_q=16, heads_kv=16, seqlen_q=1024, seqlen_k=1024, head_dim=64)
    default = config_to_dict(default_config("fwd", p))
    assert default["variant"] == config.HOPPER
    portable = config_to_dict(default_portable_fwd(p))
    best = {**portable, "block_n": portable["block_n"] // 2}

    def landscape(cfg: dict[str, Any]) -> float:
        if cfg == best:
            return 0.9
        if cfg["variant"] == config.HOPPER:  # a plateau around the default
            return 1.0 if cfg == default else 1.0 + (_ms(cfg) - 1.0) / 20
        return 1.06 if cfg == portable else 1.2 + _ms(cfg) / 10

    class Worker(LogWorker):
        def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
            if msg["op"] == "measure":
                self.log.append(("measure", tuple(sorted(msg["config"].items()))))
                ms = landscape(msg["config"])
                return {"status": "ok", "median_ms": ms, "p20_ms": ms, "p80_ms": ms,
                        "parts_ms": {}, "compile_s": 0.0, "max_error": 0.0, "ratio": 0.0}
            if msg["op"] == "retime":
                return {"status": "ok", "timings": [
                    {"median_ms": landscape(c), "p20_ms": landscape(c),
                     "p80_ms": landscape(c), "interpreter": False} for c in msg["configs"]]}
            return super().request(msg, timeout)

    session = LogSession()
    session.worker = Worker(session.log, session.clock)  # type: ignore[assignment]
    r = tune(p, "fwd", trials=26, storage="sqlite://", seed=3, session=session,
             store=False, shipped_seeds=False)
    measured = [dict(cfg) for kind, cfg in session.log if kind == "measure"]
    assert portable in measured  # seeded: the portable kernel's own heuristic
    assert best in measured
    assert config_to_dict(r.config) == best


def test_backwards_are_seeded_with_tma_stores_of_dk_and_dv(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``hopper_dkdv_tma`` (dK and dV through shared memory and TMA) at every length and
    mask: as a prior point with the halves, and as a move on a stored winner that keeps
    the winner's other fields; the portable variants have no such field."""
    from dataclasses import replace

    from flashtune.autotune.priors import prior_points, winner_points

    monkeypatch.setattr(config, "hopper_support", lambda: "")
    p = Problem(batch=4, heads_q=8, heads_kv=4, seqlen_q=3000, seqlen_k=3000, head_dim=128,
                causal=True, deterministic=True)
    base = config_to_dict(config.default_bwd(p, config.BWD_HOPPER))
    points = prior_points("bwd", p, "9.0")
    assert {**base, "hopper_dq_store_first": 2, "hopper_split": 2,
            "hopper_dkdv_tma": 1} in points
    won = {**base, "hopper_stages": 1, "hopper_split": 2}
    assert {**won, "hopper_dkdv_tma": 1} in winner_points("bwd", won, p, "9.0")
    assert not any(pt.get("hopper_dkdv_tma") for pt in points
                   if pt["variant"] != config.BWD_HOPPER)
    free = replace(p, head_dim=64, causal=False, deterministic=False)
    assert any(pt.get("hopper_dkdv_tma") for pt in prior_points("bwd", free, "9.0"))


@pytest.mark.parametrize("window", [(-1, -1), (255, 0)])
def test_masked_head_dim_64_backwards_are_seeded_with_k_and_v_in_registers_beside_every_knob(
        window: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a causal mask or a window, a deterministic head-dim-64 call gets one more
    Hopper prior point: the 128-row point with every later knob (register-order dQ, its
    first turn stored, two halves, TMA dK/dV) and K and V back in registers. Not
    unmasked, not at head dim 128, not in the free dQ order (K and V in registers with
    128-row tiles lost there)."""
    from dataclasses import replace

    from flashtune.autotune.priors import prior_points

    monkeypatch.setattr(config, "hopper_support", lambda: "")
    p = Problem(batch=8, heads_q=32, heads_kv=32, seqlen_q=2048, seqlen_k=2048, head_dim=64,
                causal=window == (-1, -1), window=window, deterministic=True)
    newest = {"hopper_block_m": 128, "hopper_dq_frag": 1, "hopper_dq_groups": 0,
              "hopper_dq_store_first": 2, "hopper_split": 2, "hopper_dkdv_tma": 1}
    base = config_to_dict(config.default_bwd(p, config.BWD_HOPPER))
    points = prior_points("bwd", p, "9.0")
    want = {**base, **newest, "hopper_kv_regs": 1}
    assert want in points
    assert points.index(want) == points.index({**want, "hopper_kv_regs": 0}) + 1
    assert config.is_feasible(config.BwdConfig(**want), p)[0]
    for other in (replace(p, causal=False, window=(-1, -1)), replace(p, deterministic=False),
                  replace(p, head_dim=128)):
        assert not any(pt["variant"] == config.BWD_HOPPER and pt["hopper_dkdv_tma"]
                       and pt["hopper_kv_regs"] for pt in prior_points("bwd", other, "9.0"))


def test_short_unmasked_backwards_are_seeded_with_a_persistent_grid(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``hopper_persist`` (one program per key tile walking several heads), where it ran
    faster: unmasked calls of at most 1k keys, in one launch (no split). Both as the last
    two prior points (the second with dK and dV stored through TMA, as the shipped 512-key
    winners have it) and as a move on a stored winner; never for a causal or windowed call
    or a longer one."""
    from dataclasses import replace

    from flashtune.autotune.priors import PERSIST_MAX_KEYS, prior_points, winner_points

    monkeypatch.setattr(config, "hopper_support", lambda: "")
    p = Problem(batch=4, heads_q=8, heads_kv=8, seqlen_q=PERSIST_MAX_KEYS,
                seqlen_k=PERSIST_MAX_KEYS, head_dim=128, deterministic=True)
    base = config_to_dict(config.default_bwd(p, config.BWD_HOPPER))
    persist = {**base, "hopper_dq_store_first": 1, "hopper_persist": 1}
    assert prior_points("bwd", p, "9.0")[-2:] == [persist, {**persist, "hopper_dkdv_tma": 1}]
    won = {**base, "hopper_split": 2}
    assert winner_points("bwd", won, p, "9.0")[-1] == {**won, "hopper_dq_store_first": 0,
                                                       "hopper_persist": 1, "hopper_split": 1}
    for other in (replace(p, causal=True), replace(p, window=(100, 0)),
                  replace(p, seqlen_q=PERSIST_MAX_KEYS + 1, seqlen_k=PERSIST_MAX_KEYS + 1)):
        assert not any(pt.get("hopper_persist") for pt in prior_points("bwd", other, "9.0"))
        assert not any(pt.get("hopper_persist") for pt in winner_points("bwd", won, other,
                                                                        "9.0"))
