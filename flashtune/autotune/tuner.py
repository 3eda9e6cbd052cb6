"""The search: one Optuna study per (device, software, problem, direction).

Pipeline for each candidate (one Optuna trial):

1. The sampler proposes a point of the :class:`SearchSpace`.
2. The kernels' feasibility rule runs; an infeasible point is PRUNED at once with
   the reason in the trial's ``pruned_reason`` attribute (nothing is compiled).
3. A compile pool builds the next few candidates on the CPU cores (GPU only).
4. The measurement worker subprocess runs the candidate: first launch, the
   correctness gate (2x rule on fresh inputs), then the house timing protocol.
   Gate failure, a run-time error, a worker death or a timeout marks the trial
   FAIL (attribute ``error``); a compile error or out-of-resources PRUNES it.
   A passing candidate COMPLETEs with its median time in ms as the value; one
   that would become the incumbent is first timed twice more and keeps the median
   of the three (a single lucky timing must not steer the search).
   A backward trial also records the time of each of its three launches.
   Besides the sampler's picks, two kinds of candidate jump the compile queue
   (the newest queued sampler pick gives up its place when the budget is full):
   - recombined (once the sampler's random start-up trials are in): the best
     measured setting of each backward launch's own fields, put together, when
     predicted faster than the incumbent (the launches run one after another, so
     their times add up; see :meth:`SearchSpace.compose`);
   - polishing (after the first 40% of a trial budget, or with only a time budget
     after twice the start-up trials): the incumbent's nearest untried feasible
     neighbour, one field moved to an adjacent choice, else two. For the backward,
     each launch's fields move at once, around the best measured setting of that
     launch, since each launch is timed on its own.
   Over the quality sub-grids of ``benchmarks/tune_autotuner.py``, replayed on their
   recorded GPU landscapes (``benchmarks/replay_search.py``), polishing the last
   60% of a 20% budget found a config within 2% of the best far more often than the
   last 25% or 50% did. The compile lookahead also shrinks with a small trial
   budget: a sampler that proposes many candidates ahead proposes them blind.
5. At the end the top-k distinct passing configs (and the heuristic default, if it
   passed) are re-timed, interleaved, with more repetitions; the fastest is the
   result and is written to the database.

The study lives in the tuning database (Optuna's RDB storage, same URL) under a
name built from the fingerprints and the problem, so a second ``tune()`` of the
same problem resumes it: stored trials are kept and count toward the budget.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from flashtune._env import interpreting, setenv
from flashtune._host import pid_alive
from flashtune.autotune._compile import CompilePool
from flashtune.autotune._isolation import Worker
from flashtune.autotune.space import Config, SearchSpace
from flashtune.exceptions import TuningError
from flashtune.kernels.config import config_from_dict, config_to_dict, default_config
from flashtune.problem import Problem, ProblemKey

ProgressFn = Callable[[dict[str, Any]], None]
SAMPLERS = ("tpe", "random", "grid")
_MEMORY_STUDIES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


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
    a warm-start seed ("default", "stale", "nearest", "device:NAME"), "compose",
    "polish" or "grid". ``compile_seconds`` is the compile time on the critical path:
    waiting for the compile pool plus the first launch in the timing worker (a compile,
    or a load from Triton's cache); ``pool_compile_seconds`` is the pool's busy time.
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


def problem_slug(p: Problem) -> str:
    s = (f"b{p.batch}h{p.heads_q}kv{p.heads_kv}q{p.seqlen_q}k{p.seqlen_k}d{p.head_dim}"
         f"{p.dtype}")
    if p.causal:
        s += "c"
    if p.has_window:
        s += f"w{p.window[0]}_{p.window[1]}"
    if p.softcap > 0:
        s += f"cap{p.softcap:g}"
    return s


def study_name(device_fp: str, software_fp: str, problem: Problem, direction: str,
               space: SearchSpace, sampler: str) -> str:
    """The study's name: one per (device, software, problem, direction), plus the space
    and sampler when they are not the defaults (their trials must not mix)."""
    name = f"flashtune/{direction}/{device_fp}/{software_fp}/{problem_slug(problem)}"
    if not space.is_full:
        name += f"/space-{space.signature}"
    if sampler != "tpe":
        name += f"/{sampler}"
    return name


def optuna_storage(url: str, owner: Any = None) -> Any:
    """Optuna's storage for our database URL: RDB storage on the same database, or, for an
    in-memory SQLite database, an in-memory Optuna storage that lives as long as
    ``owner`` (our storage object: each in-memory database has its own studies)."""
    import optuna

    if url in ("sqlite://", "sqlite:///:memory:") or url.endswith(":memory:"):
        if owner is None:
            return optuna.storages.InMemoryStorage()
        try:
            return _MEMORY_STUDIES.setdefault(owner, optuna.storages.InMemoryStorage())
        except TypeError:  # not weak-referenceable
            return optuna.storages.InMemoryStorage()
    return _rdb_storage(url)


# Messages of the errors a process gets when another one is creating Optuna's tables in the
# same new database at the same moment (SQLite and PostgreSQL wordings).
_CREATION_RACE = ("already exists", "unique constraint", "duplicate key", "database is locked",
                  "deadlock detected")


def _rdb_storage(url: str, attempts: int = 8) -> Any:
    """Optuna's RDB storage, created race-free. Optuna creates its tables and stamps their
    version on first use without a lock, so processes that open one new database together
    collide ("table studies already exists", a duplicate version row). The loser retries
    and finds the tables made; any other error is raised at once."""
    import optuna
    import sqlalchemy.exc

    for i in range(attempts):
        try:
            return optuna.storages.RDBStorage(url)
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError,
                sqlalchemy.exc.ProgrammingError) as e:
            if i == attempts - 1 or not any(m in str(e).lower() for m in _CREATION_RACE):
                raise
            time.sleep(0.05 * 2 ** i)
    raise AssertionError("unreachable")


def _make_sampler(kind: str, space: SearchSpace, seed: int, n_startup: int,
                  parallel: bool) -> Any:
    import optuna

    if kind == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                              constant_liar=parallel,
                                              n_startup_trials=n_startup)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "grid":
        # Every point is enqueued by the tuner (Optuna's GridSampler stops the study from
        # inside tell(), which only works under study.optimize).
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {kind!r}")


def _recover(study: Any) -> int:
    """Fail trials left RUNNING by a tuner on this host that no longer exists (kill -9)."""
    from optuna.trial import TrialState

    host, n = socket.gethostname(), 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") == host and pid and not pid_alive(int(pid)):
            study._storage.set_trial_user_attr(t._trial_id, "error",
                                               "abandoned: the tuner process died")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
    return n


def _seed_configs(storage: Any, device: Any, software: Any, problem: Problem, direction: str,
                  space: SearchSpace) -> list[tuple[dict[str, Any], str]]:
    """Warm-start points, in order: the heuristic default, then the database's seeds (the
    same key's stale and other-device results, the nearest tuned keys on this device),
    each projected into ``space`` (points outside it are skipped)."""
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

    add(config_to_dict(default_config(direction, problem)), "default")
    if storage is not None:
        try:
            seeds = storage.seeds(device, problem.key(direction), software)
        except Exception as e:  # a broken seed source must not stop a tune
            warnings.warn(f"warm start: could not read seeds: {e}", stacklevel=2)
            seeds = []
        here = device.fingerprint
        for r in seeds:
            if r.key == problem.key(direction):
                src = "stale" if r.device.fingerprint == here else f"device:{r.device.name}"
            else:
                src = "nearest"
            add(dict(r.config), src)
    return out


def _params_sig(params: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(params.items()))


def _tune_one(problem: Problem, direction: str, *, storage: Any, device: Any, software: Any,
              session: TuneSession, trials: int | None, time_budget: float | None,
              patience: int | None, trial_timeout: float, seed: int, space: SearchSpace,
              sampler: str, top_k: int, retime_rounds: int, timing: dict[str, Any],
              progress: ProgressFn | None, store: bool, warm_start: bool) -> TuneResult:
    import optuna
    from optuna.trial import TrialState

    t_start = time.perf_counter()
    key = problem.key(direction)
    name = study_name(device.fingerprint, software.fingerprint, problem, direction, space,
                      sampler)
    url = storage.url if storage is not None else "sqlite://"
    if sampler == "grid" and trials is None:
        trials = len(space.feasible_grid(problem))
    if trials is None and time_budget is None:
        trials = 50
    # Candidates compiled ahead of the one being timed. A sampler proposing far ahead
    # proposes blind (constant_liar); with a small trial budget that costs more than
    # the compile time it hides, so the depth shrinks with the budget.
    lookahead = max(1, session.compile_workers)
    if trials is not None and sampler != "grid":
        lookahead = min(lookahead, max(2, math.ceil(trials / 8)))
    n_startup = 10 if trials is None else max(4, min(10, trials // 3))
    smp = _make_sampler(sampler, space, seed, n_startup, parallel=lookahead > 1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=optuna_storage(url, storage), sampler=smp,
                                direction="minimize", load_if_exists=True)
    if "problem" not in study.user_attrs:
        study.set_user_attr("problem", problem.as_dict())
        study.set_user_attr("key", key.as_dict())
        study.set_user_attr("device", device.as_dict())
        study.set_user_attr("software", software.as_dict())
        study.set_user_attr("interpreter", session.interpret)
    _recover(study)
    prior_seconds = float(study.user_attrs.get("search_seconds", 0.0))

    if warm_start:
        for params, source in _seed_configs(storage, device, software, problem, direction,
                                            space):
            study.enqueue_trial(params, user_attrs={"seed_source": source},
                                skip_if_exists=True)

    if sampler == "grid":
        for params in space.grid():
            study.enqueue_trial(params, user_attrs={"seed_source": "grid"}, skip_if_exists=True)

    # Tallies over the whole study (resume continues from stored trials).
    done: dict[tuple[Any, ...], Any] = {}
    part_times: dict[tuple[Any, ...], tuple[dict[str, Any], dict[str, float]]] = {}
    measured = 0
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("measured"):
            measured += 1
        if (t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.params
                and not t.user_attrs.get("cancelled")):
            done.setdefault(_params_sig(t.params), t)
        if t.state == TrialState.COMPLETE and t.user_attrs.get("parts_ms"):
            part_times[_params_sig(t.params)] = (dict(t.params), dict(t.user_attrs["parts_ms"]))
    completed = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                 if t.value is not None]
    best_t = min(completed, key=lambda t: float(t.value or 0.0), default=None)
    best: float = float(best_t.value) if best_t is not None and best_t.value is not None \
        else math.inf
    best_params: dict[str, Any] = dict(best_t.params) if best_t is not None else {}
    # From here on, polishing candidates go before the sampler's picks (module doc).
    if sampler == "grid":
        polish_from = None
    elif trials is None:
        polish_from = 2 * n_startup
    else:
        polish_from = max(1, math.ceil(0.4 * trials))
    since_best = 0
    stop_reason = ""
    infeasible = dup_streak = infeasible_streak = 0
    compile_s = 0.0
    pool_s0 = session.pool.busy_seconds if session.pool is not None else 0.0
    host, pid = socket.gethostname(), os.getpid()
    problem_d = problem.as_dict()
    # Candidates asked for and compiling: (trial, params, compile future, source).
    pending: deque[tuple[Any, dict[str, Any], Future[tuple[float, str]] | None, str]] = deque()

    def emit(**ev: Any) -> None:
        if progress is not None:
            progress({"direction": direction, "problem": problem, "study": name,
                      "measured": measured, "budget": trials, "best_ms": best,
                      "elapsed_s": time.perf_counter() - t_start, **ev})

    def out_of_time_or_patience() -> str:
        if time_budget is not None and time.perf_counter() - t_start >= time_budget:
            return "time budget"
        if patience is not None and since_best >= patience:
            return f"no improvement in {patience} trials"
        return ""

    def budget_left() -> bool:
        nonlocal stop_reason
        if trials is not None and measured + len(pending) >= trials:
            stop_reason = stop_reason or "trials"
            return False
        why = out_of_time_or_patience()
        stop_reason = why or stop_reason
        return not why

    def hard_stop() -> bool:
        """Time budget or patience exhausted: queued candidates are dropped, not run."""
        nonlocal stop_reason
        why = out_of_time_or_patience() if measured else ""
        stop_reason = why or stop_reason
        return bool(why)

    skipped_parts: set[tuple[Any, ...]] = set()

    def usable(cand: dict[str, Any], queued: list[dict[str, Any]]) -> bool:
        return (_params_sig(cand) not in done and cand not in queued
                and space.feasible(space.config(cand), problem)[0])

    def part_polish_point(queued: list[dict[str, Any]], radius: int) -> dict[str, Any] | None:
        """Every launch's best setting moved ``radius`` steps at once (backward only)."""
        ranked = space.compose(part_times.values())
        base = ranked[0][1] if ranked else best_params
        tried = {space.part_setting(part, prm) for prm in
                 [r[0] for r in part_times.values()] + queued for part in space.parts}
        for _ in range(50):
            cand = space.part_moves(base, tried | skipped_parts, radius)
            if cand is None:
                return None
            if usable(cand, queued):
                return cand
            # The moves do not fit together: try each launch's move alone, and drop a
            # move that does not fit even alone.
            for part, fields in space.parts.items():
                if any(cand[f] != base[f] for f in fields):
                    alone = {**base, **{f: cand[f] for f in fields}}
                    if usable(alone, queued):
                        return alone
                    skipped_parts.add(space.part_setting(part, alone))
        return None

    def polish_point() -> dict[str, Any] | None:
        """The incumbent's nearest untried feasible point: one step away, else two.
        For the backward, every launch moves at once (see part_polish_point); plain
        moves are left with the shared fields, since a new mix of launch settings
        already timed is the recombination's job."""
        if polish_from is None or not best_params or measured < polish_from:
            return None
        queued = [p for _, p, _, _ in pending]
        for radius in (1, 2):
            if space.parts:
                cand = part_polish_point(queued, radius)
                if cand is not None:
                    return cand
            for cand in space.neighbours(best_params, radius, among=space.shared):
                if usable(cand, queued):
                    return cand
        return None

    def compose_point() -> dict[str, Any] | None:
        if sampler == "grid" or not space.parts or measured < n_startup:
            return None
        incumbent = part_times.get(_params_sig(best_params))
        if incumbent is None:
            return None
        limit = sum(incumbent[1].values()) * (1 - 2e-3)
        queued = [p for _, p, _, _ in pending]
        for predicted, cand in space.compose(part_times.values()):
            if predicted >= limit:
                break
            if (_params_sig(cand) not in done and cand not in queued
                    and space.feasible(space.config(cand), problem)[0]):
                return cand
        return None

    def priority_point() -> tuple[dict[str, Any], str] | None:
        """A recombined or polishing candidate, if there is one now."""
        point = compose_point()
        if point is not None:
            return point, "compose"
        point = polish_point()
        return (point, "polish") if point is not None else None

    def drop_newest_sampled() -> bool:
        """Cancel the newest queued pick of the sampler (its compile may be wasted)."""
        for i in range(len(pending) - 1, -1, -1):
            trial, _, fut, source = pending[i]
            if source == "sampler":
                del pending[i]
                if fut is not None:
                    fut.cancel()
                trial.set_user_attr("cancelled", True)
                study.tell(trial, state=TrialState.FAIL)
                return True
        return False

    def ask_one(point: dict[str, Any] | None = None, source: str = "",
                front: bool = False) -> bool:
        """Ask for one new candidate (``point``, if given) and queue it (at the front if
        ``front``); False when the search should stop."""
        nonlocal infeasible, dup_streak, infeasible_streak, stop_reason
        if point is not None:
            study.enqueue_trial(point, user_attrs={"seed_source": source})
        trial = study.ask()
        trial.set_user_attr("host", host)
        trial.set_user_attr("pid", pid)
        cfg = space.suggest(trial)
        params = config_to_dict(cfg)
        ok, reason = space.feasible(cfg, problem)
        if not ok:
            trial.set_user_attr("pruned_reason", reason)
            trial.set_user_attr("stage", "feasibility")
            study.tell(trial, state=TrialState.PRUNED)
            infeasible += 1
            infeasible_streak += 1
            emit(event="infeasible", number=trial.number, config=params, detail=reason)
            if infeasible_streak >= 500:
                stop_reason = "the sampler keeps proposing infeasible configs"
                return False
            return True
        infeasible_streak = 0
        prev = done.get(_params_sig(params))
        if prev is None:
            prev = next((t for t, p, _, _ in pending if p == params), None)
            if prev is not None:  # already queued: do not measure it twice
                trial.set_user_attr("duplicate_of", prev.number)
                study.tell(trial, state=TrialState.FAIL)
                dup_streak += 1
                return dup_streak < 50 or _exhausted("duplicates")
        if prev is not None:
            trial.set_user_attr("duplicate_of", prev.number)
            if prev.state == TrialState.COMPLETE:
                study.tell(trial, prev.value)
            else:
                study.tell(trial, state=TrialState.FAIL)
            dup_streak += 1
            return dup_streak < 50 or _exhausted("duplicates")
        dup_streak = 0
        fut = None
        pool = session.pool
        if pool is not None:
            try:
                fut = pool.submit(problem_d, direction, params)
            except Exception:  # a broken pool: rebuild it, the worker compiles meanwhile
                session.reset_pool()
        entry = (trial, params, fut, str(trial.user_attrs.get("seed_source", "sampler")))
        if front:
            pending.appendleft(entry)
        else:
            pending.append(entry)
        return True

    def _exhausted(why: str) -> bool:
        nonlocal stop_reason
        stop_reason = f"search space exhausted ({why})"
        return False

    def confirm(trial: Any, params: dict[str, Any], value: float) -> float:
        """A candidate about to become the incumbent is timed twice more; the median of
        the three stands (one lucky timing must not steer the search)."""
        reply = session.worker.request(
            {"op": "retime", "problem": problem_d, "direction": direction,
             "configs": [params, params], "rounds": 1, "timing": timing},
            timeout=trial_timeout)
        if reply.get("status") != "ok":
            return value
        again = [float(t["median_ms"]) for t in reply["timings"]]
        trial.set_user_attr("first_ms", value)
        trial.set_user_attr("confirm_ms", again)
        return sorted([value, *again])[1]

    def run_one(trial: Any, params: dict[str, Any], fut: Future[tuple[float, str]] | None,
                source: str) -> None:
        nonlocal measured, best, since_best, compile_s, best_params
        t0 = time.perf_counter()
        pool_err = ""
        if fut is not None:
            try:
                _, pool_err = fut.result(timeout=trial_timeout)
            except Exception:
                session.reset_pool()
            compile_s += time.perf_counter() - t0  # waiting for the pool is compile time
        reply = session.worker.request(
            {"op": "measure", "problem": problem_d, "direction": direction, "config": params,
             "seed": seed * 1_000_003 + trial.number, "timing": timing},
            timeout=trial_timeout)
        status = reply.get("status", "error")
        detail = str(reply.get("detail", ""))
        measured += 1
        trial.set_user_attr("measured", True)
        for k in ("compile_s", "gate_s", "time_s", "max_error", "ratio"):
            if k in reply and reply[k] is not None and math.isfinite(reply[k]):
                trial.set_user_attr(k, float(reply[k]))
        compile_s += float(reply.get("compile_s") or 0.0)
        trial.set_user_attr("wall_s", time.perf_counter() - t0)
        if status == "ok":
            value = float(reply["median_ms"])
            trial.set_user_attr("p20_ms", float(reply["p20_ms"]))
            trial.set_user_attr("p80_ms", float(reply["p80_ms"]))
            trial.set_user_attr("interpreter", bool(reply.get("interpreter")))
            parts = {k: float(v) for k, v in (reply.get("parts_ms") or {}).items()}
            if parts and all(math.isfinite(v) and v >= 0 for v in parts.values()):
                trial.set_user_attr("parts_ms", parts)
                part_times[_params_sig(params)] = (dict(params), parts)
            if value < best and math.isfinite(best):
                value = confirm(trial, params, value)
            study.tell(trial, value)
            done[_params_sig(params)] = study._storage.get_trial(trial._trial_id)
            if value < best * (1 - 5e-3):
                since_best = 0
            else:
                since_best += 1
            if value < best:
                best, best_params = value, dict(params)
        elif status == "prune":
            trial.set_user_attr("pruned_reason", detail or pool_err)
            trial.set_user_attr("stage", "compile")
            study.tell(trial, state=TrialState.PRUNED)
            since_best += 1
        else:
            if status == "timeout":
                detail = f"trial timeout: {detail}"
            trial.set_user_attr("error", f"{status}: {detail}"[:1000])
            study.tell(trial, state=TrialState.FAIL)
            done[_params_sig(params)] = study._storage.get_trial(trial._trial_id)
            since_best += 1
        emit(event="trial", number=trial.number, status=status, config=params,
             value_ms=reply.get("median_ms"), parts_ms=reply.get("parts_ms") or {},
             source=source, detail=detail)

    try:
        while True:
            # Recombined and polishing candidates go straight to the front: with a deep
            # compile lookahead they would otherwise wait behind stale sampler picks
            # (the newest of which gives up its place when the budget is full).
            prio = None if hard_stop() else priority_point()
            if prio is not None and (trials is None or measured + len(pending) < trials
                                     or drop_newest_sampled()):
                ask_one(*prio, front=True)
            while len(pending) < lookahead and budget_left():
                if not ask_one():
                    break
            if not pending or hard_stop():
                break
            run_one(*pending[0])
            pending.popleft()
    finally:
        # Interrupted (or stopped with candidates queued): those trials did not finish.
        for trial, _, fut, _ in pending:
            if fut is not None:
                fut.cancel()
            with contextlib.suppress(Exception):  # it may have been told already
                trial.set_user_attr("cancelled", True)
                study.tell(trial, state=TrialState.FAIL)
        pending.clear()
        study.set_user_attr("search_seconds", prior_seconds + time.perf_counter() - t_start)

    return _finish(problem, direction, key, study, storage, device, software, session,
                   top_k=top_k, retime_rounds=retime_rounds, timing=timing,
                   trial_timeout=trial_timeout, store=store, t_start=t_start,
                   prior_seconds=prior_seconds, infeasible=infeasible, compile_s=compile_s,
                   pool_s=(session.pool.busy_seconds - pool_s0) if session.pool else 0.0,
                   stop_reason=stop_reason or "done", url=url, emit=emit)


def _finish(problem: Problem, direction: str, key: ProblemKey, study: Any, storage: Any,
            device: Any, software: Any, session: TuneSession, *, top_k: int,
            retime_rounds: int, timing: dict[str, Any], trial_timeout: float, store: bool,
            t_start: float, prior_seconds: float, infeasible: int, compile_s: float,
            pool_s: float, stop_reason: str, url: str, emit: Callable[..., None]) -> TuneResult:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    measured = [t for t in trials if t.user_attrs.get("measured")]
    ok = sorted((t for t in measured if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    n_fail = sum(t.state == TrialState.FAIL for t in measured)
    n_pruned = sum(t.state == TrialState.PRUNED for t in measured)
    if not ok:
        raise TuningError(
            f"no candidate for {key.short()} passed the gate and ran: {len(measured)} measured "
            f"({n_fail} failed, {n_pruned} pruned), {infeasible} infeasible; see study "
            f"{study.study_name!r}")
    default_params = config_to_dict(default_config(direction, problem))
    default_ms = next((t.value for t in ok if t.params == default_params), None)

    cands: list[Any] = []
    for t in ok:
        if all(t.params != c.params for c in cands):
            cands.append(t)
        if len(cands) >= max(top_k, 1):
            break
    # The heuristic default joins the final re-timing whenever it passed: noise in the short
    # search timings must not crown a config that is slower than the default.
    dflt_t = next((t for t in ok if t.params == default_params), None)
    if dflt_t is not None and all(c.params != dflt_t.params for c in cands) and top_k > 1:
        cands.append(dflt_t)
    retimed: list[dict[str, Any]] = []
    winner, med = cands[0], float(cands[0].value)
    p20: float | None = None
    p80: float | None = None
    if len(cands) > 1 and retime_rounds > 0:
        configs = [dict(c.params) for c in cands]
        emit(event="retime", configs=configs)
        reply = session.worker.request(
            {"op": "retime", "problem": problem.as_dict(), "direction": direction,
             "configs": configs, "rounds": retime_rounds, "timing": timing},
            timeout=trial_timeout * len(cands) * max(retime_rounds, 1))
        if reply.get("status") == "ok":
            ts = reply["timings"]
            for c, tm in zip(cands, ts, strict=True):
                retimed.append({"config": dict(c.params), "trial": c.number,
                                "trial_ms": c.value, **tm})
            i = min(range(len(ts)), key=lambda j: ts[j]["median_ms"])
            winner = cands[i]
            med, p20, p80 = ts[i]["median_ms"], ts[i]["p20_ms"], ts[i]["p80_ms"]
            if default_ms is not None:
                dflt = [r for r in retimed if r["config"] == default_params]
                default_ms = dflt[0]["median_ms"] if dflt else default_ms
        else:
            study.set_user_attr("retime_error", str(reply.get("detail", ""))[:500])
    if p20 is None or p80 is None:
        p20 = float(winner.user_attrs.get("p20_ms", med))
        p80 = float(winner.user_attrs.get("p80_ms", med))
    cfg_dict = dict(winner.params)
    cfg = config_from_dict(direction, cfg_dict)
    full = config_to_dict(cfg)
    tflops = problem.flops(direction) / (med * 1e-3) / 1e12
    max_error = float(winner.user_attrs.get("max_error", math.nan))
    seconds = prior_seconds + time.perf_counter() - t_start
    stored = False
    if store and storage is not None:
        stored = storage.put_result(device, software, key, full, median_ms=med,
                                    p20_ms=min(p20, med), p80_ms=max(p80, med), tflops=tflops,
                                    max_error=max_error if math.isfinite(max_error) else 0.0,
                                    trials=len(measured), search_seconds=seconds,
                                    problem=problem)
    study.set_user_attr("search_seconds", seconds)
    study.set_user_attr("winner", {"trial": winner.number, "config": full, "median_ms": med})
    res = TuneResult(
        problem=problem, direction=direction, key=key, config=cfg, median_ms=med, p20_ms=p20,
        p80_ms=p80, tflops=tflops, max_error=max_error, default_ms=default_ms,
        trials=len(measured), complete=len(ok), failed=n_fail, pruned=n_pruned,
        infeasible=infeasible, search_seconds=seconds, compile_seconds=compile_s,
        pool_compile_seconds=pool_s, worker_restarts=session.worker.restarts, stored=stored,
        stop_reason=stop_reason, study_name=study.study_name, storage_url=url,
        device=device.name, interpreter=session.interpret, retimed=retimed,
        winner_source=str(winner.user_attrs.get("seed_source", "sampler")))
    emit(event="done", result=res)
    return res


def tune(problem: Problem, direction: str = "both", *, trials: int | None = None,
         time_budget: float | None = None, storage: Any = None, interpret: bool | None = None,
         patience: int | None = None, trial_timeout: float | None = None, seed: int = 0,
         space: SearchSpace | None = None, sampler: str = "tpe", top_k: int = 3,
         retime_rounds: int | None = None, compile_workers: int | None = None,
         timing: dict[str, Any] | None = None, progress: ProgressFn | None = None,
         store: bool = True, warm_start: bool = True,
         session: TuneSession | None = None) -> Any:
    """Tune ``problem`` and write the winner(s) to the tuning database.

    Signature::

        tune(problem, direction="both", *, trials=None, time_budget=None, storage=None,
             interpret=None, patience=None, trial_timeout=None, seed=0, space=None,
             sampler="tpe", top_k=3, retime_rounds=None, compile_workers=None,
             timing=None, progress=None, store=True, warm_start=True, session=None)
            -> TuneResult                  (direction "fwd" or "bwd")
            -> dict[str, TuneResult]       (direction "both": {"fwd": ..., "bwd": ...})

    - ``trials``: candidates to measure per direction, counting those already in a
      resumed study; ``time_budget``: seconds per direction (an in-flight trial
      finishes). Either, both, or neither (then 50 trials). The grid sampler defaults
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
    - ``top_k``/``retime_rounds``: the final interleaved re-timing.
    - ``timing``: kwargs for the timing protocol (``warmup_ms``, ``rep_ms``, ``cpu_reps``).
    - ``progress``: called with a dict per event ("trial", "infeasible", "retime",
      "done"): direction, study, measured, budget, best_ms, elapsed_s, and details.
    - ``store``: write the winner with ``prefer="faster"``; ``warm_start``: enqueue the
      default and the database's seeds first.
    - ``session``: a :class:`TuneSession` to reuse worker processes across calls.

    Raises :class:`flashtune.exceptions.TuningError` if no candidate passes the gate.
    """
    if direction not in ("fwd", "bwd", "both"):
        raise ValueError(f"direction must be 'fwd', 'bwd' or 'both', got {direction!r}")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    for name, val in (("trials", trials), ("time_budget", time_budget), ("patience", patience)):
        if val is not None and not val > 0:
            raise ValueError(f"{name} must be > 0, got {val!r}")
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info, software_info

    own_session = session is None
    sess = session or TuneSession(interpret=interpret, compile_workers=compile_workers)
    own_storage = storage is None or isinstance(storage, (str, os.PathLike))
    store_obj = open_storage(storage) if own_storage else storage
    interp = sess.interpret
    with setenv("TRITON_INTERPRET", "1" if interp else None):
        device = device_info()
    software = software_info()
    if trial_timeout is None:
        trial_timeout = 300.0 if interp else 120.0
    if retime_rounds is None:
        retime_rounds = 1 if interp else 5
    timing = dict(timing or ({"cpu_reps": 2} if interp else {}))
    dirs = ("fwd", "bwd") if direction == "both" else (direction,)
    spaces: dict[str, SearchSpace] = {}
    for d in dirs:
        s = space.get(d) if isinstance(space, dict) else space
        if s is not None and direction == "both" and not isinstance(space, dict):
            raise ValueError("direction='both' needs space={'fwd': ..., 'bwd': ...}")
        spaces[d] = s if s is not None else SearchSpace.full(d)
        if spaces[d].direction != d:
            raise ValueError(f"space is for {spaces[d].direction!r}, not {d!r}")
    try:
        out = {d: _tune_one(problem, d, storage=store_obj, device=device, software=software,
                            session=sess, trials=trials, time_budget=time_budget,
                            patience=patience, trial_timeout=trial_timeout, seed=seed,
                            space=spaces[d], sampler=sampler, top_k=top_k,
                            retime_rounds=retime_rounds, timing=timing, progress=progress,
                            store=store, warm_start=warm_start)
               for d in dirs}
    finally:
        if own_session:
            sess.close()
        if own_storage:
            store_obj.close()
    return out if direction == "both" else out[direction]
