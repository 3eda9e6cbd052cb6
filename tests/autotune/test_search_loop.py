"""The search loop's order of work, alone: when it asks for more candidates and when it
measures the one at the head of the queue (no kernels, no Optuna study)."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from flashtune.autotune.search import Search


class Loop(Search):
    """Search.run with its ask and measure replaced by a log: each asked candidate's
    compile is finished at once (``compiled``) or still running until it is measured."""

    def __init__(self, *, lookahead: int, trials: int, compiled: bool) -> None:  # noqa: D107
        self.s = SimpleNamespace(trials=trials, time_budget=None, patience=None)
        self.lookahead, self.compiled = lookahead, compiled
        self.pending: deque[Any] = deque()
        self.measured = self.since_best = 0
        self.stop_reason, self.t_start = "", time.perf_counter()
        self.prepared = True  # no worker
        self.polish_from = None  # no polishing points compiled ahead to measure meanwhile
        self.log: list[str] = []

    def _priority_point(self) -> None:
        return None

    def _waiting(self) -> int:
        return 0  # no warm-start seeds

    def _prefetch(self) -> None:
        pass  # no compile pool

    def ask(self, *args: Any, front: bool = False) -> bool:
        fut: Future[tuple[float, str]] = Future()
        if self.compiled:
            fut.set_result((0.0, ""))
        self.pending.append((None, {}, fut, "sampler"))
        self.log.append("ask")
        return True

    def measure(self, trial: Any, params: Any, fut: Any, source: str) -> None:
        self.log.append("measure")
        self.measured += 1

    def _cancel_pending(self) -> None:
        self.pending.clear()


@pytest.mark.parametrize("compiled, expected", [
    # A compiled head is measured at once, however deep the lookahead (at head dim 128
    # filling it took a whole 12 s budget of infeasible proposals: one trial per task).
    (True, ["ask", "measure"] * 4),
    # While the head still compiles, the loop asks ahead up to the lookahead.
    (False, ["ask"] * 3 + ["measure", "ask", "measure"] + ["measure"] * 2),
])
def test_the_head_is_measured_as_soon_as_its_compile_is_done(compiled: bool,
                                                              expected: list[str]) -> None:
    loop = Loop(lookahead=3, trials=4, compiled=compiled)
    loop.run()
    assert loop.log == expected and loop.measured == 4 and not loop.pending


def test_a_warmed_compile_pool_has_every_process_set_up_before_any_compile() -> None:
    """CompilePool.warm starts every process and has each pay its imports and the
    compile-only patch (the CUDA context too, on a GPU) before the first candidate."""
    from flashtune.autotune._compile import CompilePool

    pool = CompilePool(2)
    try:
        assert pool.busy_seconds == 0.0
        pool.warm(timeout=240)
        procs = dict(pool._pool._processes or {})
        assert len(procs) == 2 and all(p.is_alive() for p in procs.values())
        assert pool.busy_seconds > 0  # two set-ups, measured inside the processes
    finally:
        pool.close()
