"""Replay the tuner's search against recorded landscapes, on the CPU, with no GPU.

    python benchmarks/replay_search.py benchmarks/data/quality_landscapes_h200.json \
        [--seeds 20] [--noise 0.005] [--workers 14]

A landscape is every point of a quality sub-grid measured once on the GPU (the
exhaustive search of ``tune_autotuner.py quality``, kept with the launch times of
each backward point). The replay runs the real ``tune()`` (sampler, warm start,
recombination, polishing, final re-timing) against a worker that answers each
measurement from the landscape with multiplicative log-normal noise, and a
compile pool that is always done, so the search sees the lookahead it has on the GPU.
It reports how often the search's winner is within 2% of the landscape's best.

``--time-budget S`` replays a search with a time budget, as a sweep runs it, on a
simulated clock: each measurement advances it by ``--trial-s`` (forward, backward), the
first of a search by ``--first-s`` more (the gate's inputs and reference), a re-timing by
0.15 s per config and round. The recorded sub-grids fix the stages at 2, where the
heuristic default has 3: the default seed is moved to the nearest point of the sub-grid.

This is for studying search strategies between GPU runs: the acceptance figures in
BENCHMARKS.md come from ``tune_autotuner.py quality`` on the GPU, never from here.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from concurrent.futures import Future
from typing import Any

from tune_autotuner import problem_of_label

from flashtune.autotune import SearchSpace, TuneSession, tune
from flashtune.problem import Problem


def _sig(cfg: dict[str, Any], keys: Any = None) -> tuple[Any, ...]:
    """A point's signature over ``keys`` (default: all of its fields). A landscape keys
    its points on the fields it recorded: fields added to the configs since then sit at
    their defaults in the sub-grid, and a point that moves one is not in the landscape."""
    return tuple(sorted((k, v) for k, v in cfg.items() if keys is None or k in keys))


class ReplayWorker:
    """Answers the tuner's worker requests from a landscape."""

    restarts = 0

    def __init__(self, table: dict[tuple[Any, ...], dict[str, Any]], noise: float,
                 rng: random.Random, keys: frozenset[str] | None = None):
        self.table, self.noise, self.rng, self.keys = table, noise, rng, keys

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _draw(self, cfg: dict[str, Any], noise: float) -> tuple[float, dict[str, float]] | None:
        rec = self.table.get(_sig(cfg, self.keys))
        if rec is None:
            return None
        parts = {k: v * math.exp(self.rng.gauss(0.0, noise))
                 for k, v in (rec.get("parts_ms") or {}).items()}
        total = (sum(parts.values()) * rec["value_ms"] / sum(rec["parts_ms"].values())
                 if parts else rec["value_ms"] * math.exp(self.rng.gauss(0.0, noise)))
        return total, parts

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if msg["op"] == "prepare":  # the problem's inputs: nothing to make here
            return {"status": "ok"}
        if msg["op"] == "measure":
            got = self._draw(msg["config"], self.noise)
            if got is None:
                return {"status": "prune", "detail": "not in the recorded landscape"}
            ms, parts = got
            return {"status": "ok", "median_ms": ms, "p20_ms": ms, "p80_ms": ms,
                    "parts_ms": parts, "compile_s": 0.0, "max_error": 0.0, "ratio": 0.0}
        timings = []
        for cfg in msg["configs"]:  # retime: more repetitions, less noise
            draws = [self._draw(cfg, self.noise / 2) for _ in range(max(msg["rounds"], 1))]
            ms = statistics.median(d[0] for d in draws if d is not None)
            timings.append({"median_ms": ms, "p20_ms": ms, "p80_ms": ms, "interpreter": False})
        return {"status": "ok", "timings": timings}


class DonePool:
    """A compile pool whose every compile is already finished."""

    busy_seconds = 0.0
    n = 14  # workers: the search keeps a few of them free for its own candidates

    def submit(self, *args: Any) -> Future[tuple[float, str]]:
        f: Future[tuple[float, str]] = Future()
        f.set_result((0.0, ""))
        return f

    def close(self) -> None:
        pass


class ReplaySession(TuneSession):
    def __init__(self, worker: ReplayWorker, workers: int):
        self.interpret = False
        self.compile_workers = workers
        self.worker = worker  # type: ignore[assignment]
        self._pool = DonePool() if workers else None  # type: ignore[assignment]


class SimClock:
    """The time a replayed search sees: advanced by the worker, not by the CPU."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def install(self) -> None:
        import types

        import flashtune.autotune.search as search_mod
        import flashtune.autotune.tuner as tuner_mod

        fake = types.SimpleNamespace(perf_counter=self.perf_counter)
        search_mod.time = fake  # type: ignore[assignment]
        tuner_mod.time = fake  # type: ignore[assignment]


class TimedWorker(ReplayWorker):
    """A replay worker that charges each request to a :class:`SimClock`."""

    def __init__(self, *args: Any, clock: SimClock, trial_s: float, first_s: float,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock, self.trial_s, self.first_s = clock, trial_s, first_s

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if msg["op"] == "measure":
            self.clock.now += self.trial_s + self.first_s
            self.first_s = 0.0
        elif msg["op"] == "retime":
            self.clock.now += 0.15 * len(msg["configs"]) * max(msg["rounds"], 1)
        return super().request(msg, timeout)


def _snap_default(space: SearchSpace, direction: str) -> None:
    """Make the tuner's heuristic default the nearest point of ``space`` (in log2 steps)."""
    import flashtune.autotune.tuner as tuner_mod
    from flashtune.kernels.config import config_from_dict, config_to_dict, default_config

    def snapped(d: str, p: Problem) -> Any:
        cfg = config_to_dict(default_config(d, p))
        for n, vals in space.choices:
            if cfg[n] not in vals:
                cfg[n] = min(vals, key=lambda v: (abs(math.log2(max(v, 1))
                                                      - math.log2(max(cfg[n], 1))), v))
        return config_from_dict(d, cfg)

    tuner_mod.default_config = snapped  # type: ignore[assignment]


def _landscapes(files: list[dict[str, Any]]) -> dict[str, Any]:
    """One landscape set from files of either form: a recorded landscape file, or the
    rows of ``tune_autotuner.py quality`` (each row's exhaustive search is a landscape;
    a data file's earlier run of the same rows, under ``before``, is read too)."""
    out: dict[str, Any] = {"grids": {}, "landscapes": []}
    for data in files:
        out["grids"].update(data["grids"])
        if "landscapes" in data:
            out["landscapes"] += data["landscapes"]
            continue
        for row in data.get("before", []) + data["rows"]:
            out["landscapes"].append({
                "direction": row["direction"], "label": row["problem"],
                "problem": problem_of_label(row["problem"]).as_dict(),
                "trials": [t for t in row["exhaustive_trials_log"] if t["status"] == "ok"]})
    return out


def _assume_hopper() -> None:
    """The Hopper variants feasible on this machine, and the sm90 architecture priors
    seeded, as on an sm90 GPU (nothing runs)."""
    import flashtune.autotune.tuner as tuner_mod
    import flashtune.kernels.config as kconfig

    kconfig.hopper_support = lambda: ""  # type: ignore[assignment]
    points = tuner_mod.prior_points
    tuner_mod.prior_points = lambda d, p, _cap: points(d, p, "9.0")  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("landscapes", nargs="+")
    ap.add_argument("--hopper", action="store_true",
                    help="take the Hopper (Gluon) variants as available, as on sm90")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--noise", type=float, default=0.005, help="log-normal sigma per trial")
    ap.add_argument("--workers", type=int, default=14, help="lookahead (compile workers)")
    ap.add_argument("--budget", type=float, default=0.2, help="share of the feasible grid")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds per search on a simulated clock (instead of --budget)")
    ap.add_argument("--trial-s", default="0.5,0.65",
                    help="simulated seconds per forward, backward measurement")
    ap.add_argument("--first-s", type=float, default=1.5)
    ap.add_argument("--directions", default="fwd,bwd")
    args = ap.parse_args()
    clock = SimClock()
    if args.time_budget is not None:
        clock.install()
    trial_s = dict(zip(("fwd", "bwd"), map(float, args.trial_s.split(",")), strict=True))
    data = _landscapes([json.loads(open(f).read()) for f in args.landscapes])
    grids = data["grids"]
    if args.hopper:
        _assume_hopper()
    print(f"{'dir':4} {'problem':28} {'trials':>6} {'within 2%':>9} {'mean gap':>8} "
          f"{'worst':>7}")
    total_ok = total = 0
    for land in data["landscapes"]:
        d = land["direction"]
        if d not in args.directions.split(","):
            continue
        space = SearchSpace.subgrid(d, **grids[d])
        problem = Problem.from_dict(land["problem"])
        pts = [t for t in land["trials"] if t["status"] == "ok"]
        keys = frozenset(pts[0]["config"])
        table = {_sig(t["config"]): t for t in pts}
        best = min(t["value_ms"] for t in pts)
        budget = math.floor(args.budget * len(space.feasible_grid(problem)))
        gaps, counts = [], []
        for seed in range(args.seeds):
            if args.time_budget is None:
                worker = ReplayWorker(table, args.noise, random.Random(seed), keys)
            else:
                _snap_default(space, d)
                clock.now = 0.0
                worker = TimedWorker(table, args.noise, random.Random(seed), keys,
                                     clock=clock, trial_s=trial_s[d], first_s=args.first_s)
            r = tune(problem, d, trials=None if args.time_budget else budget,
                     time_budget=args.time_budget, space=space, storage="sqlite://",
                     seed=seed, session=ReplaySession(worker, args.workers), store=False,
                     retime_rounds=3)
            gaps.append(table[_sig(dict(r.config.__dict__), keys)]["value_ms"] / best - 1)
            counts.append(r.trials)
        if args.time_budget is not None:
            budget = round(statistics.median(counts))
        ok = sum(g <= 0.02 for g in gaps)
        total_ok, total = total_ok + ok, total + len(gaps)
        print(f"{d:4} {land['label']:28} {budget:>6} {ok:>4}/{len(gaps):<4} "
              f"{statistics.mean(gaps):>+8.1%} {max(gaps):>+7.1%}")
    print(f"within 2% of the best: {total_ok}/{total}")


if __name__ == "__main__":
    main()
