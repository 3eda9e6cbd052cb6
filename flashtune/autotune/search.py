"""One search: ask the study for a candidate, compile it ahead, measure it, tell the study.

:class:`Search` runs one (problem, direction) over an open study and keeps its tallies
on itself: what was measured, the incumbent, the compile time, why it stopped. Besides
the sampler's picks, recombined and polishing candidates (:mod:`.candidates`) jump the
compile queue; the module doc of :mod:`flashtune.autotune.tuner` says when.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

from flashtune.autotune import candidates
from flashtune.autotune.candidates import Params, PartTimes, Seen, sig
from flashtune.autotune.space import SearchSpace
from flashtune.autotune.study import proposer as make_proposer
from flashtune.autotune.study import record_trial
from flashtune.kernels.config import config_to_dict
from flashtune.problem import Problem

if TYPE_CHECKING:
    from flashtune.autotune.measure import ReplyStatus
    from flashtune.autotune.tuner import TuneSession

ProgressFn = Callable[[dict[str, Any]], None]
# A candidate asked for and compiling: (trial, params, compile future, source).
Pending = tuple[Any, Params, "Future[tuple[float, str]] | None", str]
_MAX_INFEASIBLE_STREAK = 500  # the sampler is stuck proposing configs that cannot run
_MAX_DUPLICATE_STREAK = 50  # the sampler is stuck proposing configs already measured
# A trial's timing stops once its median's 95% interval lies above this many times the
# incumbent's time (with an adaptive timing; see flashtune.timing.time_parts).
ABANDON_OVER = 1.1
# With an adaptive timing on a GPU, a trial is timed in pairs with the incumbent
# (flashtune.timing.time_against) and scored as its ratio to the incumbent times the
# incumbent's score. Each timed alone, one after the other, two configs meet different
# clocks: on the H200 one backward config read 2.8-4.0% slower than another
# interleaved, and from 1.5% faster to 2.9% slower each timed alone; at 8k keys another
# pair read 2.5-3.6% apart interleaved, and from 3.1% to -15.5% alone (session 47,
# BENCHMARKS.md, issue 17): enough to keep the better one out of the final re-timing.
TRIALS_AGAINST_INCUMBENT = True
# Where a measured trial's time went (its attributes, in seconds), in its progress event.
TRIAL_SECONDS = ("pool_wait_s", "wall_s", "compile_s", "gate_s", "reference_s", "time_s",
                 "confirm_s")
# Where candidates keep failing, a time budget's minimum of timed candidates
# (``Settings.min_trials``) gives up once this many times that many are measured in all.
MIN_TRIALS_TRIES = 3
# Polishing points compiled ahead of their turn (see Search._prefetch).
PREFETCH = 8
# While the next candidate still compiles, measure one that is built already (see
# Search._fill_wait).
FILL_WAITS = True
# Compile workers that the compiles started ahead leave free, so that a candidate asked
# for now does not queue behind them (the pool runs its queue in order).
PREFETCH_RESERVE = 2


@dataclass(frozen=True)
class Settings:
    """The budget and protocol of one search (``tune()``'s arguments, resolved)."""

    trials: int | None
    time_budget: float | None
    patience: int | None
    trial_timeout: float
    seed: int
    space: SearchSpace
    sampler: str
    top_k: int
    retime_rounds: int
    timing: dict[str, Any]
    store: bool
    warm_start: bool
    shipped_seeds: bool = True
    search_timing: dict[str, Any] | None = None  # trials and confirmations; None: ``timing``
    # A time budget stops the search only once this many candidates are timed (the tuner
    # raises it where a stale winner seeds the search: see ``STALE_MIN_TRIALS``). A
    # candidate that failed or was pruned does not count, up to MIN_TRIALS_TRIES times
    # this many measured in all.
    min_trials: int = 1
    # The winner's figure taken beside the default and the SDPA anchors (the tuner's
    # anchored timing).
    anchored: bool = False

    @property
    def trial_timing(self) -> dict[str, Any]:
        return self.timing if self.search_timing is None else self.search_timing


class Candidate:
    """A point on its way to the record: asked from the proposer, compiling, measured.

    Its attributes are kept here and written with its outcome, in one transaction
    (:func:`flashtune.autotune.study.record_trial`); until then the database holds
    nothing of it, so a candidate that never ran (cancelled, or its tuner killed) leaves
    no trace there. ``number`` is the proposer's (the seed of its correctness inputs);
    the record numbers the trial when it is written."""

    def __init__(self, pick: Any, source: str) -> None:
        self.pick, self.source = pick, source
        self.number: int = pick.number
        self.params: Params = dict(pick.params)  # the fields its variant uses
        self.user_attrs: dict[str, Any] = {} if source == "sampler" \
            else {"seed_source": source}
        self.started = datetime.datetime.now()

    def set_user_attr(self, key: str, value: Any) -> None:
        self.user_attrs[key] = value


class Search:
    """ask -> compile -> measure -> tell, until the budget, the patience or the space ends."""

    def __init__(self, problem: Problem, direction: str, study: Any, settings: Settings,
                 session: TuneSession, *, lookahead: int, n_startup: int, t_start: float,
                 progress: ProgressFn | None = None, proposer: Any = None) -> None:
        self.problem, self.direction, self.study = problem, direction, study
        # Where candidates come from: the sampler's own study, in memory, holding the
        # enqueued seeds and points (:func:`flashtune.autotune.study.proposer`). ``study``
        # is the record in the tuning database: a candidate is written there once, when
        # its outcome is known (see :class:`Candidate`).
        self.proposer = proposer if proposer is not None else make_proposer(study, None)
        self.infeasible_reasons: Counter[str] = Counter()
        # Every compile this search submitted, by point (see :meth:`_prefetch`): a point
        # compiles once, whether ahead of its turn or when asked.
        self.compiles: dict[tuple[Any, ...], Future[tuple[float, str]]] = {}
        self.s, self.session, self.progress = settings, session, progress
        self.lookahead, self.n_startup = lookahead, n_startup
        self.t_start = t_start  # the time budget counts the study's setup too
        self.prior_seconds = float(study.user_attrs.get("search_seconds", 0.0))
        self.problem_d = problem.as_dict()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.pending: deque[Pending] = deque()
        self.skipped_parts: set[tuple[Any, ...]] = set()
        self.since_best = self.infeasible = self.dup_streak = self.infeasible_streak = 0
        self.stop_reason = ""
        self.prepared = False  # the worker has this problem's gate case (see _prepare)
        self.compile_s = 0.0
        self.wanted: list[Params] = []  # the next polishing points (see _prefetch)
        self.polish_turns = 0  # polishing points asked for (see _priority_point)
        self.moved: Counter[str] = Counter()  # polishing moves asked for, per field
        self.pool_s0 = session.pool.busy_seconds if session.pool is not None else 0.0
        self._load_tallies()
        # From here on, polishing candidates go before the sampler's picks: after the
        # first 40% of a trial budget; with only a time budget, as soon as the warm-start
        # seeds are measured (the trial count is unknown, and the sweeps' short searches
        # showed the sampler's blind picks in a space this large almost never win:
        # BENCHMARKS.md, "Autotuner").
        if settings.sampler == "grid":
            self.polish_from: int | None = None
        elif settings.trials is None:
            self.polish_from = max(1, self.measured + self._waiting())
        else:
            self.polish_from = max(1, math.ceil(0.4 * settings.trials))

    def _load_tallies(self) -> None:
        """Tallies over the whole study: a resumed study continues from its stored trials."""
        from optuna.trial import TrialState

        self.done: dict[tuple[Any, ...], Any] = {}
        self.part_times: dict[tuple[Any, ...], PartTimes] = {}
        self.measured = self.timed = 0  # run in the worker; of those, timed (see _minimum_met)
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get("measured"):
                self.measured += 1
                self.timed += t.state == TrialState.COMPLETE
            if (t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.params
                    and not t.user_attrs.get("cancelled")):
                self.done.setdefault(sig(self.s.space.complete(t.params)), t)
            if t.state == TrialState.COMPLETE and t.user_attrs.get("parts_ms"):
                full = self.s.space.complete(t.params)
                self.part_times[sig(full)] = (full, dict(t.user_attrs["parts_ms"]))
        completed = [t for t in self.study.get_trials(deepcopy=False,
                                                      states=(TrialState.COMPLETE,))
                     if t.value is not None]
        best_t = min(completed, key=lambda t: float(t.value or 0.0), default=None)
        self.best: float = float(best_t.value) if best_t is not None \
            and best_t.value is not None else math.inf
        self.best_params: Params = self.s.space.complete(best_t.params) \
            if best_t is not None else {}

    def _waiting(self) -> int:
        """Enqueued points not asked for yet: the warm-start seeds."""
        from optuna.trial import TrialState

        return len(self.proposer.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    # -- reporting and stopping ------------------------------------------------------------

    @property
    def name(self) -> str:
        return str(self.study.study_name)

    @property
    def pool_seconds(self) -> float:
        pool = self.session.pool
        return (pool.busy_seconds - self.pool_s0) if pool is not None else 0.0

    def emit(self, **ev: Any) -> None:
        if self.progress is not None:
            self.progress({"direction": self.direction, "problem": self.problem,
                           "study": self.name, "measured": self.measured,
                           "budget": self.s.trials, "best_ms": self.best,
                           "elapsed_s": time.perf_counter() - self.t_start, **ev})

    def _minimum_met(self, queued: int = 0) -> bool:
        """Whether a time budget may stop the search: ``Settings.min_trials`` candidates
        timed, counting the ``queued`` ones as if they will be. A pruned or failed
        candidate does not count (a search of one timing and two failures only re-timed
        its first seed), unless candidates keep failing: then the minimum gives up once
        MIN_TRIALS_TRIES times as many were measured in all."""
        need = self.s.min_trials
        return (self.timed + queued >= need
                or self.measured + queued >= MIN_TRIALS_TRIES * need)

    def _out_of_time_or_patience(self, queued: int = 0) -> str:
        """Why the search should stop, or "". ``queued``: candidates asked for and not
        measured yet, counted towards the time budget's minimum (:meth:`_minimum_met`)."""
        if self.s.time_budget is not None and self._minimum_met(queued) and \
                time.perf_counter() - self.t_start >= self.s.time_budget:
            return "time budget"
        if self.s.patience is not None and self.since_best >= self.s.patience:
            return f"no improvement in {self.s.patience} trials"
        return ""

    def _budget_left(self) -> bool:
        if self.s.trials is not None and self.measured + len(self.pending) >= self.s.trials:
            self.stop_reason = self.stop_reason or "trials"
            return False
        if not self.measured and not self.pending:
            return True  # a time budget spent on setup (a loaded machine) still measures one
        # Asking ahead, the candidates queued count towards the minimum too.
        why = self._out_of_time_or_patience(len(self.pending))
        self.stop_reason = why or self.stop_reason
        return not why

    def _hard_stop(self) -> bool:
        """Time budget or patience exhausted: queued candidates are dropped, not run."""
        why = self._out_of_time_or_patience() if self.measured else ""
        self.stop_reason = why or self.stop_reason
        return bool(why)

    def _exhausted(self, why: str) -> bool:
        self.stop_reason = f"search space exhausted ({why})"
        return False

    # -- the project's own candidates ------------------------------------------------------

    def _seen(self) -> Seen:
        return Seen(self.s.space, self.problem, self.done, self.part_times, self.best_params,
                    [p for _, p, _, _ in self.pending], self.moved)

    def _priority_point(self) -> tuple[Params, str] | None:
        """A recombined or polishing candidate, if there is one now (not while a
        warm-start seed waits: a seed is the better prior)."""
        space = self.s.space
        if self._waiting():
            return None
        if self.s.sampler != "grid" and space.parts and self.measured >= self.n_startup:
            point = candidates.compose_point(self._seen())
            if point is not None:
                return point, "compose"
        if self.polish_from is None or not self.best_params \
                or self.measured < self.polish_from:
            return None
        seen = self._seen()
        point, centre = None, seen.best_params
        if self.polish_turns % 2:  # every other turn, the other kernel family's best
            other = self._rival()
            if other:
                point = candidates.polish_point(replace(seen, best_params=other),
                                                self.skipped_parts)
                centre = other
        if point is None:
            point, centre = candidates.polish_point(seen, self.skipped_parts), seen.best_params
        if point is None:
            return None
        self.polish_turns += 1
        self.moved.update(candidates.moves(self.s.space, centre, point))
        return point, "polish"

    def _rival(self) -> Params:
        """The other kernel family's best point, while close to the incumbent
        (:func:`candidates.rival`)."""
        if "variant" not in self.s.space.fields:
            return {}
        return candidates.rival(self.direction, self.done, self.best_params, self.best)

    def _drop_newest_sampled(self) -> bool:
        """Cancel the newest queued pick of the sampler (its compile may be wasted)."""
        from optuna.trial import TrialState

        for i in range(len(self.pending) - 1, -1, -1):
            trial, _, fut, source = self.pending[i]
            if source == "sampler":
                del self.pending[i]
                if fut is not None:
                    fut.cancel()
                self.proposer.tell(trial.pick, state=TrialState.FAIL)  # never measured
                return True
        return False

    # -- ask -------------------------------------------------------------------------------

    def ask(self, point: Params | None = None, source: str = "", front: bool = False) -> bool:
        """Ask for one new candidate (``point``, if given; else an enqueued seed, else the
        sampler's pick) and queue it (at the front if ``front``); False when the search
        should stop.

        An infeasible pick of the sampler, or one measured or queued already, is answered
        in the proposer and never reaches the tuning database: the sweeps' short searches
        spent most of their time writing such trials, one transaction per parameter. A
        point the search chose (a seed, a grid point, a recombined or polishing point) is
        recorded even when infeasible, with the reason."""
        from optuna.trial import TrialState

        if point is not None:
            self.proposer.enqueue_trial(point, user_attrs={"seed_source": source})
        pick = self.proposer.ask()
        cfg = self.s.space.suggest(pick, self.problem)
        params = config_to_dict(cfg)
        cand = Candidate(pick, str(pick.user_attrs.get("seed_source", "sampler")))
        ok, reason = self.s.space.feasible(cfg, self.problem)
        if not ok:
            self.proposer.tell(pick, state=TrialState.PRUNED)
            if cand.source == "sampler":
                self.infeasible_reasons[reason] += 1
            else:
                cand.set_user_attr("pruned_reason", reason)
                cand.set_user_attr("stage", "feasibility")
                record_trial(self.study, cand, self.s.space, TrialState.PRUNED)
            return self._count_infeasible(pick.number, params, reason)
        self.infeasible_streak = 0
        prev = self.done.get(sig(params))
        if prev is None and any(p == params for _, p, _, _ in self.pending):
            self.proposer.tell(pick, state=TrialState.FAIL)  # queued already
            return self._duplicate()
        if prev is not None:  # measured already: the sampler learns its outcome again
            if prev.state == TrialState.COMPLETE:
                self.proposer.tell(pick, prev.value)
            else:
                self.proposer.tell(pick, state=TrialState.FAIL)
            return self._duplicate()
        self.dup_streak = 0
        self._queue(cand, params, front)
        return True

    def _count_infeasible(self, number: int, params: Params, reason: str) -> bool:
        self.infeasible += 1
        self.infeasible_streak += 1
        self.emit(event="infeasible", number=number, config=params, detail=reason)
        if self.infeasible_streak >= _MAX_INFEASIBLE_STREAK:
            self.stop_reason = "the sampler keeps proposing infeasible configs"
            return False
        return True

    def _duplicate(self) -> bool:
        self.dup_streak += 1
        return self.dup_streak < _MAX_DUPLICATE_STREAK or self._exhausted("duplicates")

    def _queue(self, trial: Any, params: Params, front: bool) -> None:
        trial.set_user_attr("host", self.host)  # who measures it (infeasible ones: nobody)
        trial.set_user_attr("pid", self.pid)
        fut = self.compiles.get(sig(params))
        if fut is None or fut.cancelled():
            fut = self._submit(params)
        entry = (trial, params, fut, trial.source)
        if front:
            self.pending.appendleft(entry)
        else:
            self.pending.append(entry)

    # -- measure and tell ------------------------------------------------------------------

    def _request(self, op: str, timeout: float, **body: Any) -> dict[str, Any]:
        return dict(self.session.worker.request(
            {"op": op, "problem": self.problem_d, "direction": self.direction,
             "timing": self.s.trial_timing, **body}, timeout=timeout))

    def _against(self) -> Params | None:
        """The incumbent to time a trial beside (see TRIALS_AGAINST_INCUMBENT), if any."""
        if (TRIALS_AGAINST_INCUMBENT and self.s.trial_timing.get("rel_tol") is not None
                and math.isfinite(self.best) and self.best_params):
            return self.best_params
        return None

    def _confirm(self, trial: Any, params: Params, value: float,
                 against: Params | None = None, ratio: float = math.nan) -> float:
        """A candidate about to become the incumbent is timed twice more; the median of
        the three stands (one lucky timing must not steer the search). A trial timed
        beside the incumbent (``against``, at ``ratio``) is timed twice more beside it,
        and the median ratio times the incumbent's score stands."""
        t0 = time.perf_counter()
        if against is not None and math.isfinite(ratio):
            reply = self._request("against", self.s.trial_timeout * 2, config=params,
                                  against=against, rounds=2)
            trial.set_user_attr("confirm_s", time.perf_counter() - t0)
            if reply.get("status") != "ok":
                return value
            ratios = [float(r) for r in reply["ratios"] if math.isfinite(float(r))]
            trial.set_user_attr("confirm_ratios", ratios)
            return statistics.median([ratio, *ratios]) * self.best
        reply = self._request("retime", self.s.trial_timeout, configs=[params, params],
                              rounds=1)
        trial.set_user_attr("confirm_s", time.perf_counter() - t0)
        if reply.get("status") != "ok":
            return value
        again = [float(t["median_ms"]) for t in reply["timings"]]
        trial.set_user_attr("first_ms", value)
        trial.set_user_attr("confirm_ms", again)
        return sorted([value, *again])[1]

    def _prepare(self, trial: Any) -> None:
        """Have the worker make the problem's inputs, gate case and reference (and for the
        backward compile and run its forward) while the pool builds the first candidate:
        on the H200 these took 2-9 s of a 12 s backward search, on top of the compile,
        before its first trial was timed (2.8-4.3 s since the worker's warm-up loads the
        reference's kernels and the timing inputs are drawn on the GPU). The gate's
        inputs come from the seed the first measurement would have used. A failure here
        is left for that measurement."""
        self.prepared = True
        t0 = time.perf_counter()
        reply = self._request("prepare", self.s.trial_timeout,
                              seed=self.s.seed * 1_000_003 + trial.number)
        seconds = time.perf_counter() - t0
        self.study.set_user_attr("prepare_s", seconds)
        parts = {k: float(reply[k]) for k in ("forward_s", "case_s") if k in reply}
        ev: dict[str, Any] = {"status": str(reply.get("status", "error")),
                              "seconds": {"wall_s": seconds, **parts}}
        if ev["status"] != "ok":
            ev["detail"] = str(reply.get("detail", ""))[:300]
        self.emit(event="prepare", **ev)

    def _wait_compile(self, fut: Future[tuple[float, str]] | None, t0: float) -> str:
        """Wait for the pool's build of a candidate; its error message, if any."""
        pool_err = ""
        if fut is not None:
            try:
                _, pool_err = fut.result(timeout=self.s.trial_timeout)
            except Exception:
                self.session.reset_pool()
            self.compile_s += time.perf_counter() - t0  # waiting for the pool is compile time
        return pool_err

    def measure(self, trial: Any, params: Params, fut: Future[tuple[float, str]] | None,
                source: str) -> None:
        """Run one queued candidate in the measurement worker and tell the study."""
        t0 = time.perf_counter()
        pool_err = self._wait_compile(fut, t0)
        trial.set_user_attr("pool_wait_s", time.perf_counter() - t0)
        # A candidate whose timing is plainly slower than the incumbent's stops early.
        abandon = self.best * ABANDON_OVER if math.isfinite(self.best) else None
        against = self._against()
        reply = self._request("measure", self.s.trial_timeout, config=params,
                              seed=self.s.seed * 1_000_003 + trial.number, abandon_ms=abandon,
                              against=against, abandon_ratio=ABANDON_OVER)
        status: ReplyStatus = reply.get("status", "error")
        detail = str(reply.get("detail", ""))
        self.measured += 1
        trial.set_user_attr("measured", True)
        for k in ("compile_s", "gate_s", "reference_s", "time_s", "max_error", "ratio"):
            if k in reply and reply[k] is not None and math.isfinite(reply[k]):
                trial.set_user_attr(k, float(reply[k]))
        self.compile_s += float(reply.get("compile_s") or 0.0)
        trial.set_user_attr("wall_s", time.perf_counter() - t0)
        if status == "ok":
            self._tell_ok(trial, params, reply, against)
        else:
            detail = self._tell_failed(trial, params, status, detail, pool_err)
        self.emit(event="trial", number=trial.number, status=status, config=params,
                  value_ms=reply.get("median_ms"), parts_ms=reply.get("parts_ms") or {},
                  source=source, detail=detail,
                  seconds={k: trial.user_attrs[k] for k in TRIAL_SECONDS
                           if k in trial.user_attrs})

    def _tell_ok(self, trial: Any, params: Params, reply: dict[str, Any],
                 against: Params | None = None) -> None:
        """A timed candidate. Timed beside the incumbent (``against``), its score is its
        ratio to the incumbent times the incumbent's score, and its own median is kept
        as ``alone_ms``; p20 and p80 scale with it."""
        from optuna.trial import TrialState

        value = float(reply["median_ms"])
        ratio = float(reply.get("against_ratio") or math.nan)
        scale = 1.0
        if against is not None and math.isfinite(ratio) and ratio > 0 and value > 0:
            trial.set_user_attr("alone_ms", value)
            trial.set_user_attr("against_ratio", ratio)
            trial.set_user_attr("against_ms", float(reply.get("against_ms") or math.nan))
            scale = ratio * self.best / value
            value = ratio * self.best
        else:
            against = None
        self.timed += 1
        trial.set_user_attr("p20_ms", float(reply["p20_ms"]) * scale)
        trial.set_user_attr("p80_ms", float(reply["p80_ms"]) * scale)
        trial.set_user_attr("interpreter", bool(reply.get("interpreter")))
        parts = {k: float(v) for k, v in (reply.get("parts_ms") or {}).items()}
        if parts and all(math.isfinite(v) and v >= 0 for v in parts.values()):
            trial.set_user_attr("parts_ms", parts)
            self.part_times[sig(params)] = (dict(params), parts)
        if value < self.best and math.isfinite(self.best):
            value = self._confirm(trial, params, value, against, ratio)
        self.proposer.tell(trial.pick, value)
        self.done[sig(params)] = record_trial(self.study, trial, self.s.space,
                                              TrialState.COMPLETE, value)
        if value < self.best * (1 - 5e-3):
            self.since_best = 0
        else:
            self.since_best += 1
        if value < self.best:
            self.best, self.best_params = value, dict(params)

    def _tell_failed(self, trial: Any, params: Params, status: ReplyStatus, detail: str,
                     pool_err: str) -> str:
        """A pruned (did not compile or fit) or failed candidate; returns the detail shown."""
        from optuna.trial import TrialState

        self.since_best += 1
        if status == "prune":
            trial.set_user_attr("pruned_reason", detail or pool_err)
            trial.set_user_attr("stage", "compile")
            self.proposer.tell(trial.pick, state=TrialState.PRUNED)
            record_trial(self.study, trial, self.s.space, TrialState.PRUNED)
            return detail
        if status == "timeout":
            detail = f"trial timeout: {detail}"
        trial.set_user_attr("error", f"{status}: {detail}"[:1000])
        self.proposer.tell(trial.pick, state=TrialState.FAIL)
        self.done[sig(params)] = record_trial(self.study, trial, self.s.space, TrialState.FAIL)
        return detail

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        """Search until a stop; queued candidates left over are cancelled."""
        try:
            while True:
                # Recombined and polishing candidates go straight to the front: with a deep
                # compile lookahead they would otherwise wait behind stale sampler picks
                # (the newest of which gives up its place when the budget is full).
                prio = None if self._hard_stop() else self._priority_point()
                if prio is not None and (self.s.trials is None
                                         or self.measured + len(self.pending) < self.s.trials
                                         or self._drop_newest_sampled()):
                    self.ask(*prio, front=True)
                seeds = self._waiting()
                while len(self.pending) < self.lookahead and self._budget_left():
                    if seeds and not self._waiting() and prio is None:
                        # The last seeds were asked (infeasible ones leave nothing to
                        # measure): polishing may start now, ahead of the sampler.
                        seeds, prio = 0, self._priority_point()
                        if prio is not None:
                            self.ask(*prio, front=True)
                            continue
                    if self.pending and not self._sampler_wanted(prio) and not self._waiting():
                        break
                    if not self.ask():
                        break
                    if self._head_ready():
                        break  # measure it now; filling the lookahead can wait
                if not self.pending or self._hard_stop():
                    break
                self._prefetch()
                if not self.prepared:
                    self._prepare(self.pending[0][0])
                if FILL_WAITS and not self._head_ready():
                    self._fill_wait()
                self.measure(*self.pending[0])
                self.pending.popleft()
        finally:
            self._cancel_pending()

    def _sampler_wanted(self, prio: tuple[Params, str] | None) -> bool:
        """Whether the sampler's picks should fill the compile lookahead. Under a time
        budget polishing follows the seeds, and picks compiled ahead would hold the
        compile pool's workers ahead of the polishing points while they wait for
        polishing to run dry; so they are asked only once it has (or one at a time,
        when nothing else is queued)."""
        return (self.s.trials is not None or self.polish_from is None
                or (prio is None and self.measured >= self.polish_from))

    def _submit(self, params: Params) -> Future[tuple[float, str]] | None:
        """Start ``params``' compile on the pool (None: no pool, or a broken one, rebuilt
        for the next candidate; the worker then compiles it itself)."""
        pool = self.session.pool
        if pool is None:
            return None
        try:
            fut = pool.submit(self.problem_d, self.direction, params)
        except Exception:
            self.session.reset_pool()
            return None
        self.compiles[sig(params)] = fut
        return fut

    def _upcoming(self, centre: Params) -> list[Params]:
        """The next :data:`PREFETCH` polishing points around ``centre``, if it holds."""
        space, problem = self.s.space, self.problem
        queued = [p for _, p, _, _ in self.pending]
        out: dict[tuple[Any, ...], Params] = {}
        moved = Counter(self.moved)  # as polishing will count them, one point after another
        for _ in range(PREFETCH):
            seen = Seen(space, problem, self.done, self.part_times, centre,
                        queued + list(out.values()), moved)
            point = candidates.polish_point(seen, self.skipped_parts)
            if point is None:
                break
            moved.update(candidates.moves(space, centre, point))
            params = space.complete({n: point[n] for n in space.active(point)})
            out[sig(params)] = params
        return list(out.values())

    def _centre(self) -> Params:
        """Where polishing goes on from: the incumbent; before the first measurement,
        under a time budget, the first architecture-prior seed queued (the long
        searches' moves; :mod:`.priors`), else the first seed (the default). Its
        neighbours then compile on the idle workers while the worker prepares the
        problem and the seeds are measured."""
        if self.best_params or self.s.trials is not None:
            return self.best_params
        queued = [(p, src) for _, p, _, src in self.pending]
        return next((p for p, src in queued if src == "prior"),
                    queued[0][0] if queued else {})

    def _prefetch(self) -> None:
        """Compile the next polishing points (:meth:`_upcoming`) ahead, on the compile
        pool's idle workers, before each measurement. A polishing point is known only
        once the trial before it is measured; without this each one waited for its own
        compile (1.25 s median for a backward in the H200 sweep, against 0.1-0.3 s to
        measure it). Compiles not started whose point is no longer among the next are
        cancelled, and no more than the pool's workers less :data:`PREFETCH_RESERVE` run
        at once. (Compiling the incumbent's whole neighbourhood instead, each backward
        launch's moves alone, waited as long in the simulation of
        ``tests/autotune/test_proposer.py`` and compiled half as much again.)"""
        pool = self.session.pool
        centre = self._centre()
        if pool is None or self.polish_from is None or not centre \
                or (self.s.trials is not None and self.measured < self.polish_from):
            return
        wanted = self._upcoming(centre)
        other = self._rival() if self.best_params else {}
        if other:  # polishing takes turns with the other family's best: so does compiling
            pairs = zip_longest(wanted, self._upcoming(other))
            wanted = list({sig(p): p for pair in pairs for p in pair if p}.values())[:PREFETCH]
        self.wanted = wanted
        keys = {sig(p) for p in wanted} | {sig(p) for _, p, _, _ in self.pending}
        for key in [k for k, f in self.compiles.items() if k not in keys and f.cancel()]:
            del self.compiles[key]
        room = pool.n - PREFETCH_RESERVE - sum(not f.done() for f in self.compiles.values())
        for params in wanted:
            if room <= 0:
                break
            if sig(params) not in self.compiles:
                if self._submit(params) is None:
                    return
                room -= 1

    def _fill_wait(self) -> None:
        """The next candidate is still compiling: bring to the front one that is built,
        so the GPU measures instead of waiting. First a queued candidate whose compile
        is done; else a polishing point compiled ahead and not measured (the incumbent's
        next ones first, then those left from an earlier incumbent, which the search
        moved away from on the first improving step). On the H200 a one-launch backward
        compile kept the GPU idle 1-3 s per polishing step of a 12 s search."""
        for i, entry in enumerate(self.pending):
            if entry[2] is None or (entry[2].done() and not entry[2].cancelled()):
                if i:
                    del self.pending[i]
                    self.pending.appendleft(entry)
                return
        if self._waiting() or self.polish_from is None or (
                self.s.trials is not None
                and self.measured + len(self.pending) >= self.s.trials):
            return
        queued = [p for _, p, _, _ in self.pending]
        wanted = {sig(p): p for p in self.wanted}
        for key in [*wanted, *self.compiles]:
            fut = self.compiles.get(key)
            if fut is None or not fut.done() or fut.cancelled() or key in self.done:
                continue
            try:
                built = not fut.result()[1]
            except Exception:  # a broken pool: the candidate's own measurement tells
                continue
            params = wanted.get(key) or dict(key)
            # One that did not build is skipped: its measurement would only say so again.
            if built and params not in queued:
                self.ask(params, "polish", front=True)
                return

    def _head_ready(self) -> bool:
        """Whether the next candidate in the queue can be measured without waiting for its
        compile. Asking is what the loop does while compiles run; where most proposals
        are infeasible (large tiles at head dim 128) filling a deep lookahead takes many
        asks, and the GPU must not sit idle behind them."""
        if not self.pending:
            return False
        fut = self.pending[0][2]
        return fut is None or fut.done()

    def _cancel_pending(self) -> None:
        """Interrupted (or stopped with candidates queued): those candidates were never
        measured, and the record never sees them."""
        from optuna.trial import TrialState

        for compile_fut in self.compiles.values():
            compile_fut.cancel()
        self.compiles.clear()
        for trial, _, fut, _ in self.pending:
            if fut is not None:
                fut.cancel()
            with contextlib.suppress(Exception):  # it may have been told already
                self.proposer.tell(trial.pick, state=TrialState.FAIL)
        self.pending.clear()
        self.study.set_user_attr("search_seconds", self.seconds)
        if self.infeasible_reasons:  # the sampler's infeasible picks, which it kept to itself
            merged = Counter(self.study.user_attrs.get("infeasible_picks", {}))
            merged.update(self.infeasible_reasons)
            self.study.set_user_attr("infeasible_picks", dict(merged.most_common(20)))
            self.infeasible_reasons.clear()

    @property
    def seconds(self) -> float:
        """Search time of the study so far, earlier runs of a resumed study included."""
        return self.prior_seconds + time.perf_counter() - self.t_start
