"""Replay a budget check's short backward searches on a simulated clock, on the configs
and times its GPU searches measured.

A budget check (``tune_autotuner.py budget``) keeps every trial of its 12 s and 60 s
searches: for each problem, a few hundred configs and their measured times. This script
runs the real search (the tuner, Optuna, the polishing and the compiles ahead) against
that table instead of a GPU, with compile and measurement costs from the H200 logs, so a change to
the search can be tried on the problems it must win before device time is spent:

    python3 benchmarks/replay_budget.py benchmarks/data/budget_h200_s12.json

A config the GPU never measured is answered with the slowest time of its problem's
table (counted as "unknown" in the output): the replay is only as good as the table's
coverage of where the search goes. The Hopper kernels are taken as available (the
backward's seeds include them on the H200). Nothing here is a performance figure: it
says which config the search would end on, given these measurements. (``replay_search.py``
replays the quality check's exhaustive landscapes instead, with no compile clock.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import types
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import optuna
from tune_autotuner import problem_of_label

from flashtune.autotune import TuneSession, tune
from flashtune.kernels import config as kconfig
from flashtune.kernels.config import BWD_ONE_LAUNCH, BwdConfig

# Seconds, from the H200 logs (BENCHMARKS.md, issue 17): a one-launch backward compiles
# in about 3.4 s; the other variants are taken at 1.5 s (the sweep's backward compiles
# had a median of 1.25 s); a measurement (gate, adaptive timing) took 0.03-0.1 s at the
# shapes checked; the worker's prepare of a backward 2.8-4.3 s on the committed tree.
# Each config compiles as a whole: the replay does not model a launch's kernel built
# already for another config.
COMPILE_S = {BWD_ONE_LAUNCH: 3.4}
COMPILE_OTHER_S, MEASURE_S, PREPARE_S = 1.5, 0.05, 3.5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


class Built(Future):  # type: ignore[type-arg]
    """A compile on the simulated pool: done once the clock passes its finish."""

    def __init__(self, pool: Pool, seconds: float) -> None:
        super().__init__()
        self.pool, self.seconds = pool, seconds
        self.submitted = pool.clock.now
        self.start: float | None = None  # fixed once the clock reaches it
        self.worker = -1

    def ready_at(self) -> float:
        self.pool.schedule()
        return (self.start if self.start is not None else self.pool.planned[self]) \
            + self.seconds

    def done(self) -> bool:
        if not super().done() and self.pool.clock.now >= self.ready_at():
            self.set_result((self.seconds, ""))
        return super().done()

    def cancel(self) -> bool:
        self.pool.schedule()
        return self.start is None and super().cancel()

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self.pool.clock.now = self.ready_at()
            self.set_result((self.seconds, ""))
        return super().result(timeout)


class Pool:
    """``n`` compile workers on the simulated clock, running their queue in submission
    order; a compile cancelled before it starts frees its place, as in the real pool."""

    busy_seconds = 0.0

    def __init__(self, clock: Clock, n: int = 14) -> None:
        self.clock, self.n = clock, n
        self.jobs: list[Built] = []
        self.planned: dict[Built, float] = {}

    def submit(self, problem: Any, direction: str, config: dict[str, Any]) -> Future[Any]:
        fut = Built(self, COMPILE_S.get(config.get("variant"), COMPILE_OTHER_S))
        self.jobs.append(fut)
        return fut

    def schedule(self) -> None:
        """Plan the queue: a started job keeps its worker and start; the others start, in
        order, on the worker free first (and start for good once the clock passes)."""
        free = [0.0] * self.n
        for j in self.jobs:
            if j.start is not None:
                free[j.worker] = max(free[j.worker], j.start + j.seconds)
        self.planned.clear()
        for j in self.jobs:
            if j.start is not None or j.cancelled():
                continue
            w = min(range(self.n), key=free.__getitem__)
            start = max(j.submitted, free[w])
            if start <= self.clock.now:
                j.start, j.worker = start, w
            else:
                self.planned[j] = start
            free[w] = start + j.seconds

    def close(self) -> None:
        pass


class Worker:
    """Answers measurements from the table; everything else at once."""

    restarts = 0

    def __init__(self, clock: Clock, table: dict[str, float],
                 parts: dict[str, dict[str, float]]) -> None:
        self.clock, self.table, self.parts = clock, table, parts
        self.worst = max(table.values())
        self.unknown = 0

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def value(self, cfg: dict[str, Any]) -> float:
        ms = self.table.get(key(cfg))
        if ms is None:
            self.unknown += 1
            return self.worst
        return ms

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if msg["op"] == "prepare":
            self.clock.now += PREPARE_S
            return {"status": "ok", "seconds": PREPARE_S}
        if msg["op"] == "measure":
            self.clock.now += MEASURE_S
            ms = self.value(msg["config"])
            parts = self.parts.get(key(msg["config"]), {})
            return {"status": "ok", "median_ms": ms, "p20_ms": ms, "p80_ms": ms,
                    "parts_ms": parts, "compile_s": 0.0, "max_error": 0.0, "ratio": 0.0}
        self.clock.now += MEASURE_S * len(msg["configs"])
        return {"status": "ok", "timings": [
            {"median_ms": self.value(c), "p20_ms": self.value(c), "p80_ms": self.value(c),
             "interpreter": False} for c in msg["configs"]]}


class Replay(TuneSession):
    def __init__(self, table: dict[str, float],  # noqa: D107 - no processes
                 parts: dict[str, dict[str, float]]) -> None:
        self.interpret = False
        self.compile_workers = 14
        self.clock = Clock()
        self._pool = Pool(self.clock)  # type: ignore[assignment]
        self.worker = Worker(self.clock, table, parts)  # type: ignore[assignment]


def key(cfg: dict[str, Any]) -> str:
    """A config's identity in the table: every field, defaults filled in."""
    return json.dumps({**asdict(BwdConfig()), **cfg}, sort_keys=True)


@contextlib.contextmanager
def simulated(session: Replay) -> Iterator[None]:
    """The search's clock is the simulation's, the machine is an sm90 GPU with the
    Hopper kernels available."""
    import flashtune.autotune.search as search_mod
    import flashtune.autotune.tuner as tuner_mod
    import flashtune.db.fingerprint as fp

    saved = (search_mod.time, tuner_mod.time, fp.device_info, kconfig.hopper_support,
             kconfig.descriptor_reduce_support)
    clock = types.SimpleNamespace(perf_counter=lambda: session.clock.now)
    cpu = fp.device_info("cpu")
    hopper = replace(cpu, name="NVIDIA H200", capability="9.0", sm_count=132, memory_gb=140)
    search_mod.time = tuner_mod.time = clock  # type: ignore[assignment]
    fp.device_info = lambda *a, **k: hopper  # type: ignore[assignment]
    kconfig.hopper_support = kconfig.descriptor_reduce_support = lambda: ""  # type: ignore
    try:
        yield
    finally:
        (search_mod.time, tuner_mod.time, fp.device_info, kconfig.hopper_support,
         kconfig.descriptor_reduce_support) = saved


def tables(path: Path) -> Iterator[tuple[str, str, dict[str, float],
                                         dict[str, dict[str, float]], float]]:
    """(run, problem label, config -> median of its measured times, config -> its
    launches' times where recorded, the table's time of the 60 s search's winner) of
    every backward row of a budget-check data file. The winner's time, not the table's
    least: with one noisy measurement per config, the least is a lucky draw."""
    data = json.loads(path.read_text())
    for run, block in data.items():
        if run.startswith("_"):
            continue
        for row in block["rows"]:
            if row["direction"] != "bwd":
                continue
            seen: dict[str, list[float]] = {}
            parts: dict[str, dict[str, float]] = {}
            for t in row["short_trials_log"] + row["long_trials_log"]:
                if t.get("status") == "ok" and t.get("value_ms"):
                    seen.setdefault(key(t["config"]), []).append(float(t["value_ms"]))
                    if t.get("parts_ms"):
                        parts.setdefault(key(t["config"]), t["parts_ms"])
            table = {k: statistics.median(v) for k, v in seen.items()}
            yield run, row["problem"], table, parts, table[key(row["long_config"])]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, nargs="+", help="budget-check data files")
    ap.add_argument("--time-budget", type=float, default=12.0)
    ap.add_argument("--prefetch", type=int, default=None,
                    help="polishing points compiled ahead (default: the search's own)")
    ap.add_argument("--no-fill", action="store_true",
                    help="wait for the next candidate's compile instead of measuring built "
                         "points meanwhile")
    args = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    import flashtune.autotune.search as search_mod

    if args.prefetch is not None:
        search_mod.PREFETCH = args.prefetch
    if args.no_fill:
        search_mod.FILL_WAITS = False
    print(f"{'run':18} {'problem':28} {'table':>5} {'60 s ms':>8} {'replay ms':>9} "
          f"{'gap':>6} {'trials':>6} {'unknown':>7}")
    gaps = []
    for path in args.data:
        for run, label, table, parts, best in tables(path):
            session = Replay(table, parts)
            with simulated(session), tempfile.TemporaryDirectory() as tmp:
                r = tune(problem_of_label(label), "bwd", time_budget=args.time_budget,
                         retime_rounds=0, session=session, shipped_seeds=False,
                         storage=Path(tmp) / "replay.db", store=False)
            gap = r.median_ms / best - 1
            gaps.append(gap)
            print(f"{run:18} {label:28} {len(table):>5} {best:>8.4f} {r.median_ms:>9.4f} "
                  f"{gap:>+6.1%} {r.trials:>6} {session.worker.unknown:>7}")
    within = sum(g <= 0.02 for g in gaps)
    print(f"\nwithin 2% of the 60 s winner: {within} of {len(gaps)}; mean gap "
          f"{statistics.mean(gaps):+.2%}")


if __name__ == "__main__":
    main()
