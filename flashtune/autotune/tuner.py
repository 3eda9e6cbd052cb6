"""The tuner: ``tune()`` searches each (problem, direction) and stores the winner.

Pipeline for each candidate (one Optuna trial; :class:`~flashtune.autotune.search.Search`):

1. The sampler proposes a point of the :class:`SearchSpace`, in its own in-memory
   study (:func:`~flashtune.autotune.study.proposer`), where the warm-start seeds wait
   first in line.
2. The kernels' feasibility rule runs; an infeasible pick, or one measured or queued
   already, is answered there and never reaches the tuning database (the study counts
   the infeasible picks by reason in its ``infeasible_picks`` attribute). A seed, grid,
   recombined or polishing point that is infeasible is recorded as PRUNED with the
   reason in ``pruned_reason``. Nothing infeasible is compiled.
3. A compile pool builds the next few candidates on the CPU cores (GPU only).
4. The measurement worker subprocess runs the candidate: first launch, the
   correctness gate (2x rule on fresh inputs), then the house timing protocol.
   Gate failure, a run-time error, a worker death or a timeout marks the trial
   FAIL (attribute ``error``); a compile error or out-of-resources PRUNES it.
   A passing candidate COMPLETEs with its median time in ms as the value. On a GPU
   (adaptive timing), every trial after the first is timed in pairs with the incumbent
   (:func:`flashtune.timing.time_against`), and its value is its ratio to the incumbent
   times the incumbent's value (its own median is kept as ``alone_ms``): two configs
   timed each alone meet different clocks. One that would become the incumbent is first
   timed twice more (beside the incumbent, where it was) and keeps the median of the
   three (a single lucky timing must not steer the search).
   A backward trial also records the time of each of its three launches.
   Besides the sampler's picks, two kinds of candidate (:mod:`.candidates`) jump the
   compile queue (the newest queued sampler pick gives up its place when the budget
   is full):
   - recombined, once the sampler's random start-up trials are in;
   - polishing, after the first 40% of a trial budget, or with only a time budget as
     soon as the warm-start seeds are measured; it moves first the fields it has moved
     least so far in the search, so a new incumbent does not restart at the first
     field. The next few polishing points compile
     ahead of their turn on the pool's idle workers, re-planned before every
     measurement. While the next candidate still compiles, the search measures one
     that is built (a queued one, else a polishing point compiled ahead), so the GPU
     does not wait on the compiler. The worker makes the problem's gate case and
     reference while the first candidate compiles. While the other kernel family's
     best trial (portable or Hopper) is within 10% of the incumbent, every other
     polishing point is that point's neighbour instead
     (:func:`~flashtune.autotune.candidates.rival`).
   The compile lookahead shrinks with a small trial budget: a sampler that proposes
   many candidates ahead proposes them blind. BENCHMARKS.md ("Autotuner") has the
   measurements behind these choices.
5. At the end the top-k distinct passing configs and any others within 4% of the best
   trial (six at most), the heuristic default if it passed, and the other kernel
   family's best if within 10%, are re-timed against one
   another, their launches interleaved (:func:`flashtune.timing.time_interleaved`: the
   GPU's clocks drift under load, and timed one after another the same config read up to
   7% apart), with more repetitions; the fastest is the result.
6. On a GPU its figure, the one written to the database, is then taken as the bench takes
   a tuned row: in one interleaved loop with the heuristic default and, where they run
   the problem, SDPA's cuDNN, FA2 and efficient backends (the anchored timing,
   :data:`ANCHORED_ROUNDS`; for the backward, the winner's backward launches beside the
   anchors' forward and backward). A loop's company sets the GPU's clock (on the H200,
   tuned and cuDNN alone ran at 1770 MHz, the bench's full loop at 1935 MHz: BENCHMARKS.md,
   session 34), and the stored figures of long forwards, from the finalists' loop, read
   3-10% slower than the bench's rows of the same configs (session 36). The anchors' own
   times are kept with the result.

The study lives in the tuning database (:mod:`.study`), each candidate written once with
its outcome, so a second ``tune()`` of the same problem resumes it: stored trials are
kept and count toward the budget, and the sampler starts from them.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from flashtune._env import interpreting, setenv
from flashtune.autotune._compile import CompilePool
from flashtune.autotune._isolation import Worker
from flashtune.autotune.candidates import RIVAL_MARGIN, family
from flashtune.autotune.priors import prior_points, winner_points
from flashtune.autotune.search import ProgressFn, Search, Settings
from flashtune.autotune.space import Config, SearchSpace
from flashtune.autotune.study import (
    SAMPLERS,
    make_sampler,
    open_study,
    optuna_storage,
    problem_slug,
    proposer,
    study_name,
)
from flashtune.exceptions import InfeasibleConfigError, TuningError
from flashtune.kernels.config import (
    BWD_HOPPER,
    PORTABLE,
    config_from_dict,
    config_to_dict,
    default_bwd,
    default_config,
    default_portable_fwd,
    for_nondeterministic_call,
)
from flashtune.problem import Problem, ProblemKey

# The search's trials on a GPU: warm up briefly (the first launch and the gate have run),
# then repeat until the median's 95% interval is within 1% (flashtune.timing.time_parts;
# beside the incumbent, the ratio's: flashtune.timing.time_against).
SEARCH_TIMING: dict[str, Any] = {"warmup_ms": 10, "rel_tol": 0.01, "min_reps": 8}

# The anchored timing's repetitions: rounds x rep_ms for each launch of its loop (the
# bench takes one round; two keep the sweep's cost near 1 s a task: 5 launches x 200 ms).
ANCHORED_ROUNDS = 2

__all__ = ["TuneResult", "TuneSession", "tune", "study_name", "optuna_storage", "problem_slug",
           "SAMPLERS"]


@dataclass(frozen=True)
class TuneResult:
    """The outcome of tuning one (problem, direction).

    Timings are of the winning config after the final interleaved re-timing, in ms
    (``interpreter=True`` means CPU-interpreter timings, meaningless for speed).
    ``default_ms`` is the heuristic default's time in this study when it passed the
    gate. Counts: ``trials`` reached the measurement worker (the budget counts these),
    of which ``complete`` passed the gate, ``failed`` failed it or crashed, and
    ``pruned`` did not compile or fit; ``infeasible`` were rejected by the feasibility
    rule before compiling. ``winner_source`` says where the winner came from: "sampler",
    a warm-start seed ("default", "stale", "shipped", "stale+" or "shipped+" (that winner
    with the newest knobs), "nearest", "device:NAME", "prior",
    "variant"), "compose", "polish" or "grid". ``compile_seconds`` is the compile time on
    the critical path: waiting for the compile pool plus the first launch in the timing
    worker (a compile, or a load from Triton's cache); ``pool_compile_seconds`` is the
    pool's busy time.
    """

    problem: Problem
    direction: str
    key: ProblemKey
    config: Config
    median_ms: float
    p20_ms: float
    p80_ms: float
    tflops: float
    max_error: float
    default_ms: float | None
    trials: int
    complete: int
    failed: int
    pruned: int
    infeasible: int
    search_seconds: float
    compile_seconds: float
    pool_compile_seconds: float
    worker_restarts: int
    stored: bool
    stop_reason: str
    study_name: str
    storage_url: str
    device: str
    interpreter: bool
    retimed: list[dict[str, Any]] = field(default_factory=list)
    winner_source: str = "sampler"
    # The SM clock, power and limit reasons while the finalists were re-timed (GPU with
    # NVML only; see flashtune.gpu_clocks.summarize), else None.
    retime_clocks: dict[str, Any] | None = None
    # The anchored timing that gave median_ms (step 6 of the module's docstring): "ms"
    # (median ms of "winner", "default" and each anchor that ran; an anchor's is its
    # training forward, or its forward and backward for direction "bwd"), "clocks" and
    # "errors" (anchors that could not run the problem); None where it did not run.
    anchored: dict[str, Any] | None = None

    @property
    def speedup_over_default(self) -> float:
        return self.default_ms / self.median_ms if self.default_ms else math.nan

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["problem"] = self.problem.as_dict()
        d["key"] = self.key.as_dict()
        d["config"] = config_to_dict(self.config)
        d["speedup_over_default"] = self.speedup_over_default
        return d


class TuneSession:
    """The processes a tune needs: one measurement worker and (on GPU) a compile pool.

    ``tune()`` makes one per call; a caller tuning many problems (a sweep) can make one
    and pass it to every call to keep the processes warm. Use as a context manager.
    """

    def __init__(self, *, interpret: bool | None = None, compile_workers: int | None = None):
        self.interpret = interpreting() if interpret is None else bool(interpret)
        if compile_workers is None:
            compile_workers = 0 if self.interpret else max(1, min(14, (os.cpu_count() or 2) - 2))
        self.compile_workers = 0 if self.interpret else int(compile_workers)
        self.worker = Worker(interpret=self.interpret)
        self._pool: CompilePool | None = None

    @property
    def pool(self) -> CompilePool | None:
        if self._pool is None and self.compile_workers > 0:
            self._pool = CompilePool(self.compile_workers)
        return self._pool

    def warm(self, timeout: float = 120.0) -> None:
        """Start the measurement worker and the compile pool now and let them pay their
        one-time setup (imports, CUDA context), so that the first tune's time budget is
        spent on its search. A sweep calls this before its first task."""
        self.worker.start()
        if self.pool is not None:
            self.pool.warm(timeout)

    def reset_pool(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def close(self) -> None:
        self.worker.close()
        self.reset_pool()

    def __enter__(self) -> TuneSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A search seeded with a stale winner (after an upgrade: ``sweep --from-stale``), or with
# a winner and the newest knobs ("stale+", "shipped+"; priors.WINNER_MOVES), measures
# at least this many candidates whatever its time budget: the winner and the next seeds
# (that winner with the new knobs, the default, then the nearest keys' winners or the
# architecture's priors). A re-search of 4x32/8x4096x128 causal (H200, session 52, 10 s,
# a cold Triton cache) measured the shipped winner alone and never its knob point. Its
# first trial alone can outlast a short budget at long sequences (1x32x16384x64's
# backward took 7.8 s of a 6 s budget in session 29's re-ship, BENCHMARKS.md), and a
# search of one trial only re-times the stale winner on the new software.
STALE_MIN_TRIALS = 3


def seeded_min_trials(seeds: list[tuple[dict[str, Any], str]]) -> int:
    """The candidates a search with these warm-start seeds (``(point, source)``) measures
    at least, whatever its time budget: :data:`STALE_MIN_TRIALS` when a stale winner or a
    winner with new knobs is among them, else 1."""
    if any(source == "stale" or source.endswith("+") for _, source in seeds):
        return STALE_MIN_TRIALS
    return 1


def _seed_configs(storage: Any, device: Any, software: Any, problem: Problem, direction: str,
                  space: SearchSpace, *, shipped: bool = True,
                  n_nearest: int = 3) -> list[tuple[dict[str, Any], str]]:
    """Warm-start points, in order: the key's stale winners on this device (the
    database's, then the shipped layer's; what an upgrade made stale is the best prior
    there is), the shipped layer's winner for the key on this device, each followed by
    itself with the architecture's newest knobs, which a winner tuned before they landed
    never tried (:func:`~flashtune.autotune.priors.winner_points`), the heuristic
    default, then the key's results on other devices (the database's, then, with
    ``shipped``, the shipped layer's), and the ``n_nearest`` tuned keys nearest to it on
    this device (the database's and, with ``shipped``, the shipped layer's, nearest
    first), the prior
    points of the device's architecture (:func:`~flashtune.autotune.priors.prior_points`),
    and last the default's tiles in each other kernel variant that may serve the problem
    (and, where the default is a Hopper kernel, the portable kernels' own heuristic
    configs). Each is projected into ``space`` (points outside it are skipped)."""
    from flashtune.db.storage import nearest_results

    out: list[tuple[dict[str, Any], str]] = []
    seen: set[tuple[Any, ...]] = set()

    def add(params: dict[str, Any], source: str) -> None:
        point = space.project(params)
        if point is None:
            return
        sig = tuple(sorted(point.items()))
        if sig not in seen:
            seen.add(sig)
            out.append((point, source))

    seeds = []
    if storage is not None:
        try:
            seeds = storage.seeds(device, problem.key(direction), software, n_nearest=0)
        except Exception as e:  # a broken seed source must not stop a tune
            warnings.warn(f"warm start: could not read seeds: {e}", stacklevel=2)
    here, key = device.fingerprint, problem.key(direction)
    # Tuned keys of this device, for the nearest seeds: the database over the shipped layer.
    table: dict[Any, Any] = {}
    if shipped:
        from flashtune.db.exchange import shipped_results

        try:
            everywhere = shipped_results(software)
            layer = [r for r in everywhere if r.device.fingerprint == here]
            table.update((r.key, r) for r in layer if not r.stale)
            # The shipped winner an upgrade made stale, after the database's own; then the
            # key's shipped winners on other devices, fastest first, after the database's
            # (an H100 search of a short causal forward starts from the H200's winner,
            # whose config the H100's one-trial search had never tried; BENCHMARKS.md,
            # issue 17, session 31).
            seeds += [r for r in layer if r.stale and r.key == key]
            seeds += sorted((r for r in everywhere
                             if r.key == key and r.device.fingerprint != here),
                            key=lambda r: r.median_ms)
        except Exception as e:  # the shipped layer is optional
            warnings.warn(f"warm start: could not read the shipped layer: {e}", stacklevel=2)
    if storage is not None:
        try:
            table.update(storage.load_table(device, software))
        except Exception as e:
            warnings.warn(f"warm start: could not read seeds: {e}", stacklevel=2)
    winners = []
    for r in seeds:
        if r.key == key and r.device.fingerprint == here and r.stale:
            winners.append((dict(r.config), "stale"))
    if key in table and getattr(table[key], "origin", "") == "shipped":
        winners.append((dict(table[key].config), "shipped"))
    for params, source in winners:
        add(params, source)
        # With the architecture's newest knobs (priors.WINNER_MOVES).
        for point in winner_points(direction, params, problem, device.capability):
            add(point, f"{source}+")
    default = config_to_dict(default_config(direction, problem))
    add(default, "default")
    for r in seeds:
        if r.key == key and r.device.fingerprint != here:
            add(dict(r.config), f"device:{r.device.name}")
    for r in nearest_results(table, key, n_nearest):
        params = dict(r.config)
        if r.key.deterministic and not key.deterministic:
            # As the dispatcher serves it (in the order it was timed in), then in the free
            # order, whose staging is never in column groups; a config this version cannot
            # read is left to the projection below.
            try:
                cfg = config_from_dict(direction, params)
            except ValueError:
                pass
            else:
                add(config_to_dict(for_nondeterministic_call(cfg)), "nearest")
            if params.get("hopper_dq_groups"):
                params["hopper_dq_groups"] = 0
        add(params, "nearest")
    # Where the device's architecture has a prior (:mod:`.priors`): the points that long
    # searches there found several moves away from the default.
    for point in prior_points(direction, problem, device.capability):
        add(point, "prior")
    # The default's tiles in each other kernel variant that may serve the problem: a
    # short search then compares the kernel families before it polishes one (polishing
    # moves the variant last, after every tile move).
    if "variant" in space.fields:
        allowed = set(space.variants(problem))
        for point in space.neighbours(default, 1, among=["variant"]):
            if point["variant"] in allowed and space.feasible(space.config(point), problem)[0]:
                add(point, "variant")
        # And the portable kernel's own heuristic config, where the default is a Hopper
        # one: the default's tiles are the Hopper kernel's, rarely the portable one's best.
        if direction == "fwd" and default.get("variant") != PORTABLE \
                and PORTABLE in allowed:
            add(config_to_dict(default_portable_fwd(problem)), "variant")
        # Likewise a backward whose default is the Hopper kernel (every long enough call
        # on sm90 since session 42): each portable variant with the heuristic's own tiles.
        if direction == "bwd" and default.get("variant") == BWD_HOPPER:
            for variant in sorted(allowed - {BWD_HOPPER}):
                try:
                    cfg = default_bwd(problem, variant)
                except InfeasibleConfigError:
                    continue
                if space.feasible(cfg, problem)[0]:
                    add(config_to_dict(cfg), "variant")
    return out


@dataclass(frozen=True)
class _Target:
    """Where a tune runs and stores: the database, the device, the software, the processes."""

    storage: Any
    device: Any
    software: Any
    session: TuneSession

    @property
    def url(self) -> str:
        return self.storage.url if self.storage is not None else "sqlite://"


def _budget(s: Settings, problem: Problem, workers: int) -> tuple[Settings, int, int]:
    """(settings with the trial budget resolved, compile lookahead, sampler start-up trials)."""
    trials = s.trials
    if s.sampler == "grid" and trials is None:
        trials = len(s.space.feasible_grid(problem))
    if trials is None and s.time_budget is None:
        trials = 50
    # Candidates compiled ahead of the one being timed. A sampler proposing far ahead
    # proposes blind (constant_liar); with a small trial budget that costs more than
    # the compile time it hides, so the depth shrinks with the budget.
    lookahead = max(1, workers)
    if trials is not None and s.sampler != "grid":
        lookahead = min(lookahead, max(2, math.ceil(trials / 8)))
    n_startup = 10 if trials is None else max(4, min(10, trials // 3))
    return replace(s, trials=trials), lookahead, n_startup


def _tune_one(problem: Problem, direction: str, target: _Target, settings: Settings,
              progress: ProgressFn | None) -> TuneResult:
    t_start = time.perf_counter()
    settings = replace(settings, space=settings.space.for_problem(problem))
    s, lookahead, n_startup = _budget(settings, problem, target.session.compile_workers)
    dev, sw = target.device, target.software
    name = study_name(dev.fingerprint, sw.fingerprint, problem, direction, s.space, s.sampler)
    sampler = make_sampler(s.sampler, s.seed, n_startup, parallel=lookahead > 1)
    # The sampler proposes in its own in-memory study (seeds and the grid are enqueued
    # there); the database's study records each candidate once, with its outcome.
    study = open_study(name, target.url, target.storage, None, {
        "problem": problem.as_dict(), "key": problem.key(direction).as_dict(),
        "device": dev.as_dict(), "software": sw.as_dict(),
        "interpreter": target.session.interpret})
    picks = proposer(study, sampler)
    if s.warm_start:
        seeds = _seed_configs(target.storage, dev, sw, problem, direction, s.space,
                              shipped=s.shipped_seeds)
        for params, source in seeds:
            picks.enqueue_trial(params, user_attrs={"seed_source": source},
                                skip_if_exists=True)
        s = replace(s, min_trials=max(s.min_trials, seeded_min_trials(seeds)))
    if s.sampler == "grid":
        variants = s.space.variants(problem)
        for params in s.space.grid():
            if params.get("variant", 0) in variants or not variants:
                picks.enqueue_trial(params, user_attrs={"seed_source": "grid"},
                                    skip_if_exists=True)
    search = Search(problem, direction, study, s, target.session, lookahead=lookahead,
                    n_startup=n_startup, t_start=t_start, progress=progress, proposer=picks)
    search.run()
    return _finish(search, target)


def _outcomes(search: Search) -> tuple[list[Any], list[Any], int, int]:
    """(measured trials, passing ones fastest first, failed count, pruned count)."""
    from optuna.trial import TrialState

    measured = [t for t in search.study.get_trials(deepcopy=False)
                if t.user_attrs.get("measured")]
    ok = sorted((t for t in measured if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    n_fail = sum(t.state == TrialState.FAIL for t in measured)
    n_pruned = sum(t.state == TrialState.PRUNED for t in measured)
    if not ok:
        raise TuningError(
            f"no candidate for {search.problem.key(search.direction).short()} passed the gate "
            f"and ran: {len(measured)} measured ({n_fail} failed, {n_pruned} pruned), "
            f"{search.infeasible} infeasible; see study {search.study.study_name!r}")
    return measured, ok, n_fail, n_pruned


# The final re-timing also takes every distinct trial within this share of the best
# trial's time, up to NEAR_TIE_MAX finalists in all: on the H200 two searches' trials read
# the same config up to 3% apart, and a 12 s forward search left out of its re-timing
# (6th of its trials, 3.2% behind) the config that a 60 s search then crowned, 2.1% faster
# in the re-timing (BENCHMARKS.md, issue 17).
NEAR_TIE = 0.04
NEAR_TIE_MAX = 6


def _finalists(space: SearchSpace, ok: list[Any], default_params: dict[str, Any],
               top_k: int, direction: str) -> list[Any]:
    """The top-k distinct passing trials, and after them any within :data:`NEAR_TIE` of
    the best (up to :data:`NEAR_TIE_MAX` in all); the other kernel family's best trial, if
    within :data:`~flashtune.autotune.candidates.RIVAL_MARGIN` of the best (the families
    rank differently in short timings and in the re-timing's longer ones); and the
    heuristic default whenever it passed: noise in the short search timings must not crown
    a config slower than the default. Trials are compared as whole configs (a trial holds
    only its variant's knobs)."""
    full = space.complete
    least = max(top_k, 1)
    most = max(top_k, NEAR_TIE_MAX) if top_k > 1 else least
    tie = (1 + NEAR_TIE) * float(ok[0].value) if ok else math.inf
    cands: list[Any] = []
    for t in ok:
        if len(cands) >= most or (len(cands) >= least and float(t.value) > tie):
            break
        if all(full(t.params) != full(c.params) for c in cands):
            cands.append(t)
    if top_k > 1 and ok and "variant" in space.fields:
        mine = family(direction, full(ok[0].params))
        other = next((t for t in ok if family(direction, full(t.params)) != mine), None)
        if other is not None and float(other.value) <= (1 + RIVAL_MARGIN) * float(ok[0].value) \
                and all(full(other.params) != full(c.params) for c in cands):
            cands.append(other)
    dflt_t = next((t for t in ok if full(t.params) == default_params), None)
    if dflt_t is not None and all(full(c.params) != default_params for c in cands) \
            and top_k > 1:
        cands.append(dflt_t)
    return cands


@dataclass
class _Verdict:
    """The winner after the final re-timing, its timings, and the default's time."""

    winner: Any
    median_ms: float
    p20_ms: float | None = None
    p80_ms: float | None = None
    default_ms: float | None = None
    retimed: list[dict[str, Any]] = field(default_factory=list)
    clocks: dict[str, Any] | None = None
    anchored: dict[str, Any] | None = None


def _retime(search: Search, cands: list[Any], verdict: _Verdict,
            default_params: dict[str, Any]) -> None:
    """Re-time the finalists, interleaved, and crown the fastest (in ``verdict``)."""
    configs = [search.s.space.complete(c.params) for c in cands]
    search.emit(event="retime", configs=configs)
    rounds = search.s.retime_rounds
    reply = search.session.worker.request(
        {"op": "retime", "problem": search.problem.as_dict(), "direction": search.direction,
         "configs": configs, "rounds": rounds, "timing": search.s.timing, "clocks": True},
        timeout=search.s.trial_timeout * len(cands) * max(rounds, 1))
    if reply.get("status") != "ok":
        search.study.set_user_attr("retime_error", str(reply.get("detail", ""))[:500])
        return
    ts = reply["timings"]
    verdict.clocks = reply.get("clocks")
    if verdict.clocks is not None:
        search.study.set_user_attr("retime_clocks", verdict.clocks)
    for c, tm in zip(cands, ts, strict=True):
        verdict.retimed.append({"config": search.s.space.complete(c.params), "trial": c.number,
                                "trial_ms": c.value, **tm})
    i = min(range(len(ts)), key=lambda j: ts[j]["median_ms"])
    verdict.winner = cands[i]
    verdict.median_ms, verdict.p20_ms, verdict.p80_ms = \
        ts[i]["median_ms"], ts[i]["p20_ms"], ts[i]["p80_ms"]
    if verdict.default_ms is not None:
        dflt = [r for r in verdict.retimed if r["config"] == default_params]
        verdict.default_ms = dflt[0]["median_ms"] if dflt else verdict.default_ms


def anchored_request(problem: Problem, direction: str, configs: list[dict[str, Any]],
                     timing: dict[str, Any], interpret: bool) -> tuple[dict[str, Any], int]:
    """The measurement worker's request for the anchored timing (step 6 of the module's
    docstring) of ``configs`` (the winner first, then the default where it differs), and
    the number of launches in its loop (for the request's timeout)."""
    from flashtune.timing import SDPA_ANCHORS

    company = () if interpret else SDPA_ANCHORS
    return ({"op": "retime", "problem": problem.as_dict(), "direction": direction,
             "configs": configs, "rounds": ANCHORED_ROUNDS, "timing": timing, "clocks": True,
             "company": company}, len(configs) + len(company))


def _anchored(search: Search, verdict: _Verdict, default_params: dict[str, Any]) -> None:
    """Take the winner's figure beside the default and the SDPA anchors (step 6 of the
    module's docstring) and make it the verdict's; on an error keep the re-timing's."""
    winner = search.s.space.complete(verdict.winner.params)
    configs = [winner] + ([default_params] if verdict.default_ms is not None
                          and default_params != winner else [])
    msg, launches = anchored_request(search.problem, search.direction, configs,
                                     search.s.timing, search.session.interpret)
    reply = search.session.worker.request(
        msg, timeout=search.s.trial_timeout * launches * ANCHORED_ROUNDS)
    if reply.get("status") != "ok":
        search.study.set_user_attr("anchored_error", str(reply.get("detail", ""))[:500])
        return
    ts = reply["timings"]
    verdict.median_ms, verdict.p20_ms, verdict.p80_ms = \
        ts[0]["median_ms"], ts[0]["p20_ms"], ts[0]["p80_ms"]
    ms = {"winner": ts[0]["median_ms"]}
    if len(ts) > 1:
        ms["default"] = verdict.default_ms = ts[1]["median_ms"]
    elif configs[0] == default_params and verdict.default_ms is not None:
        verdict.default_ms = ts[0]["median_ms"]
    ms.update({n: t["median_ms"] for n, t in reply.get("company", {}).items()})
    verdict.anchored = {"ms": ms, "clocks": reply.get("clocks"),
                        "errors": reply.get("company_errors", {})}
    search.study.set_user_attr("anchored", verdict.anchored)


def _finish(search: Search, target: _Target) -> TuneResult:
    problem, direction, study = search.problem, search.direction, search.study
    measured, ok, n_fail, n_pruned = _outcomes(search)
    default_params = config_to_dict(default_config(direction, problem))
    cands = _finalists(search.s.space, ok, default_params, search.s.top_k, direction)
    verdict = _Verdict(cands[0], float(cands[0].value),
                       default_ms=next((t.value for t in ok
                                        if search.s.space.complete(t.params) == default_params),
                                       None))
    if len(cands) > 1 and search.s.retime_rounds > 0:
        _retime(search, cands, verdict, default_params)
    if search.s.anchored and search.s.retime_rounds > 0:
        _anchored(search, verdict, default_params)
    winner, med = verdict.winner, verdict.median_ms
    p20 = verdict.p20_ms if verdict.p20_ms is not None and verdict.p80_ms is not None \
        else float(winner.user_attrs.get("p20_ms", med))
    p80 = verdict.p80_ms if verdict.p20_ms is not None and verdict.p80_ms is not None \
        else float(winner.user_attrs.get("p80_ms", med))
    cfg = config_from_dict(direction, search.s.space.complete(winner.params))
    full = config_to_dict(cfg)
    tflops = problem.flops(direction) / (med * 1e-3) / 1e12
    max_error = float(winner.user_attrs.get("max_error", math.nan))
    seconds = search.seconds
    stored = False
    if search.s.store and target.storage is not None:
        stored = target.storage.put_result(
            target.device, target.software, problem.key(direction), full, median_ms=med,
            p20_ms=min(p20, med), p80_ms=max(p80, med), tflops=tflops,
            max_error=max_error if math.isfinite(max_error) else 0.0, trials=len(measured),
            search_seconds=seconds, problem=problem)
    study.set_user_attr("search_seconds", seconds)
    study.set_user_attr("winner", {"trial": winner.number, "config": full, "median_ms": med})
    res = TuneResult(
        problem=problem, direction=direction, key=problem.key(direction), config=cfg,
        median_ms=med, p20_ms=p20, p80_ms=p80, tflops=tflops, max_error=max_error,
        default_ms=verdict.default_ms, trials=len(measured), complete=len(ok), failed=n_fail,
        pruned=n_pruned, infeasible=search.infeasible, search_seconds=seconds,
        compile_seconds=search.compile_s, pool_compile_seconds=search.pool_seconds,
        worker_restarts=target.session.worker.restarts, stored=stored,
        stop_reason=search.stop_reason or "done", study_name=study.study_name,
        storage_url=target.url, device=target.device.name,
        interpreter=target.session.interpret, retimed=verdict.retimed,
        winner_source=str(winner.user_attrs.get("seed_source", "sampler")),
        retime_clocks=verdict.clocks, anchored=verdict.anchored)
    search.emit(event="done", result=res)
    return res


def _check_args(direction: str, sampler: str, **positive: float | None) -> None:
    if direction not in ("fwd", "bwd", "both"):
        raise ValueError(f"direction must be 'fwd', 'bwd' or 'both', got {direction!r}")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    for name, val in positive.items():
        if val is not None and not val > 0:
            raise ValueError(f"{name} must be > 0, got {val!r}")


def _spaces(direction: str, space: Any) -> dict[str, SearchSpace]:
    dirs = ("fwd", "bwd") if direction == "both" else (direction,)
    spaces: dict[str, SearchSpace] = {}
    for d in dirs:
        s = space.get(d) if isinstance(space, dict) else space
        if s is not None and direction == "both" and not isinstance(space, dict):
            raise ValueError("direction='both' needs space={'fwd': ..., 'bwd': ...}")
        spaces[d] = s if s is not None else SearchSpace.full(d)
        if spaces[d].direction != d:
            raise ValueError(f"space is for {spaces[d].direction!r}, not {d!r}")
    return spaces


def tune(problem: Problem, direction: str = "both", *, trials: int | None = None,
         time_budget: float | None = None, storage: Any = None, interpret: bool | None = None,
         patience: int | None = None, trial_timeout: float | None = None, seed: int = 0,
         space: SearchSpace | None = None, sampler: str = "tpe", top_k: int = 3,
         retime_rounds: int | None = None, compile_workers: int | None = None,
         timing: dict[str, Any] | None = None, progress: ProgressFn | None = None,
         store: bool = True, warm_start: bool = True, shipped_seeds: bool = True,
         session: TuneSession | None = None, anchored: bool | None = None,
         ) -> TuneResult | dict[str, TuneResult]:
    """Tune ``problem`` and write the winner(s) to the tuning database.

    Signature::

        tune(problem, direction="both", *, trials=None, time_budget=None, storage=None,
             interpret=None, patience=None, trial_timeout=None, seed=0, space=None,
             sampler="tpe", top_k=3, retime_rounds=None, compile_workers=None,
             timing=None, progress=None, store=True, warm_start=True,
             shipped_seeds=True, session=None, anchored=None)
            -> TuneResult                  (direction "fwd" or "bwd")
            -> dict[str, TuneResult]       (direction "both": {"fwd": ..., "bwd": ...})

    - ``trials``: candidates to measure per direction, counting those already in a
      resumed study; ``time_budget``: seconds per direction, setup included (an
      in-flight trial finishes, and one trial is measured however little is left).
      Either, both, or neither (then 50 trials). The grid sampler defaults
      to the whole space.
    - ``storage``: a :class:`flashtune.db.Storage`, a URL/path, or None (FLASHTUNE_DB or
      the default database). The Optuna study lives in the same database, so
      ``optuna-dashboard <url>`` shows it, and calling ``tune`` again resumes it.
    - ``interpret``: run under Triton's CPU interpreter (default: ``TRITON_INTERPRET``).
    - ``patience``: stop after this many measured trials without a 0.5% improvement.
    - ``trial_timeout``: seconds one candidate may take in the worker before it is
      killed and the trial FAILs (default 120 on GPU, 300 under the interpreter).
    - ``space``: a :class:`SearchSpace` (default: the full one for the direction; for
      "both", a space is only allowed when it is a dict ``{"fwd": ..., "bwd": ...}``).
    - ``sampler``: "tpe" (seeded, multivariate, constant_liar when candidates are in
      flight in parallel), "random" or "grid" (exhaustive).
    - ``top_k``/``retime_rounds``: the final interleaved re-timing (``retime_rounds=0``:
      none, and no anchored timing either).
    - ``anchored``: take the winner's figure beside the default and the SDPA anchors
      (step 6 of the module's docstring; default: on a GPU, not in the interpreter).
    - ``timing``: kwargs for the timing protocol (``warmup_ms``, ``rep_ms``, ``cpu_reps``).
      On a GPU the search's own trials time only as long as the noise needs
      (:data:`SEARCH_TIMING`: a shorter warmup, then repetitions until the median is
      known to 1%, or until it is plainly slower than the incumbent), each beside the
      incumbent; ``timing`` keys override those (``{"rel_tol": None}`` times every
      trial alone and in full; with ``rel_tol`` under the interpreter, trials are timed
      beside the incumbent on the host clock). The final
      re-timing follows the house protocol.
    - ``progress``: called with a dict per event ("trial", "infeasible", "retime",
      "done"): direction, study, measured, budget, best_ms, elapsed_s, and details.
    - ``store``: write the winner with ``prefer="faster"``; ``warm_start``: enqueue the
      default and the database's seeds first; ``shipped_seeds``: the shipped layer's
      winners for this device seed too (the key's own, and the nearest keys').
    - ``session``: a :class:`TuneSession` to reuse worker processes across calls.

    Raises :class:`flashtune.exceptions.TuningError` if no candidate passes the gate.
    """
    _check_args(direction, sampler, trials=trials, time_budget=time_budget, patience=patience)
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info, software_info

    own_session = session is None
    sess = session or TuneSession(interpret=interpret, compile_workers=compile_workers)
    own_storage = storage is None or isinstance(storage, (str, os.PathLike))
    store_obj = open_storage(storage) if own_storage else storage
    if hasattr(store_obj, "check_writable"):
        try:  # before Optuna writes its study there (it ignores SQLite's mode=ro)
            store_obj.check_writable()
        except BaseException:
            if own_storage:
                store_obj.close()
            raise
    interp = sess.interpret
    with setenv("TRITON_INTERPRET", "1" if interp else None):
        device = device_info()
    target = _Target(store_obj, device, software_info(), sess)
    house = dict(timing or ({"cpu_reps": 2} if interp else {}))
    spaces = _spaces(direction, space)
    base = Settings(
        trials=trials, time_budget=time_budget, patience=patience,
        trial_timeout=(300.0 if interp else 120.0) if trial_timeout is None else trial_timeout,
        seed=seed, space=spaces[next(iter(spaces))], sampler=sampler, top_k=top_k,
        retime_rounds=(1 if interp else 5) if retime_rounds is None else retime_rounds,
        timing=house, store=store, warm_start=warm_start, shipped_seeds=shipped_seeds,
        search_timing=house if interp else {**SEARCH_TIMING, **house},
        anchored=not interp if anchored is None else anchored)
    try:
        out = {d: _tune_one(problem, d, target, replace(base, space=spaces[d]), progress)
               for d in spaces}
    finally:
        if own_session:
            sess.close()
        if own_storage:
            store_obj.close()
    return out if direction == "both" else out[direction]
