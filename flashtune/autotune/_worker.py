"""The measurement worker: a subprocess that compiles, gates and times candidates.

Started by :class:`flashtune.autotune._isolation.Worker` as
``python -m flashtune.autotune._worker FD`` with FD one end of a socket pair. A
crash here (illegal memory access, a segfault, a hang) takes down only this
process; the parent records the trial as FAIL and starts a new worker.

Messages are pickled dicts. Parent to worker: ``{"op": "measure", ...}`` (with
``"against"``: a config to time it beside, see ``measure.measure``), ``{"op": "against",
...}`` (a config's ratio to another, again), ``{"op": "retime", ...}`` (with
``"company"``: anchor names whose launches join the loop), ``{"op": "prepare", ...}``
(the problem's inputs, gate case and reference, ahead of its first candidate) or
``{"op": "stop"}``. The worker first sends ``{"op": "ready", "pid", "device"}``, then
one reply per request.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from flashtune._env import interpreting
from flashtune.autotune._isolation import unblock_interrupts


def _clock_sampler(torch: Any) -> Any:
    """A started :class:`~flashtune.gpu_clocks.ClockSampler` of this worker's GPU (an
    unavailable one, whose windows stay empty, where NVML cannot be used): the final
    re-timing records the SM clock it ran at, as the bench records its rows', so a stored
    figure and a bench row can be compared clock for clock (issue 17: the bench read up to
    10% faster than the sweep's figures on the H200, session 36). It runs until the
    worker exits (a daemon thread)."""
    from flashtune.gpu_clocks import ClockSampler

    return ClockSampler.for_cuda_device(torch.cuda.current_device()).__enter__()


def _warm_libraries(torch: Any) -> None:
    """Pay the CUDA libraries' one-time setup now, at the worker's start (a sweep's
    ``TuneSession.warm``), not in the first problem's gate: cuBLAS, the autograd engine's
    device thread and the lazily loaded kernels of the fp32 and low-precision reference
    (forward and gradients, at both common head dims). In the H200 budget check the first
    problem's gate case took 3.5 s with no warm-up, 2.3-2.6 s after a small matmul and
    backward alone, and 0.2-0.5 s after this one (0.1-1.6 s for the later problems of a
    process). Best effort: a failure here shows again, and is recorded, at the first
    measurement."""
    try:
        from flashtune.kernels.reference import reference

        gen = torch.Generator(device="cuda").manual_seed(0)
        for d in (64, 128):
            q, k, v, do = (torch.randn(1, 4, 1024, d, device="cuda", generator=gen,
                                       dtype=torch.bfloat16) for _ in range(4))
            reference(q, k, v, do, causal=True, softmax_scale=None, window_size=(-1, -1),
                      softcap=0.0)
        torch.cuda.synchronize()
    except Exception:  # noqa: S110 - see the docstring
        pass


def _serve(conn: Connection) -> None:
    import torch

    from flashtune.autotune import _faults
    from flashtune.autotune.measure import (
        Bench,
        Measurement,
        measure,
        poisons_context,
        retime,
    )
    from flashtune.kernels.config import config_from_dict
    from flashtune.problem import Problem
    from flashtune.timing import anchor_launches

    interp = interpreting()
    device = "cpu" if interp or not torch.cuda.is_available() else "cuda"
    rules = _faults.rules_from_env()
    benches: dict[Any, Bench] = {}
    sampler: Any = None  # the SM clock's sampler, started at the first final re-timing

    def bench_for(problem: Problem) -> Bench:
        b = benches.get(problem)
        if b is None:
            benches.clear()  # one problem at a time: free the last one's inputs
            b = benches[problem] = Bench(problem, device)
        return b

    if device == "cuda":
        _warm_libraries(torch)
    conn.send({"op": "ready", "pid": os.getpid(), "device": device})
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        op = msg.get("op")
        if op == "stop":
            return
        problem = Problem.from_dict(msg["problem"])
        direction = msg["direction"]
        timing = msg.get("timing", {})
        if op == "measure":
            cfg_dict = msg["config"]
            action = _faults.action_for(rules, direction, cfg_dict)
            if action in ("exit", "segv", "hang", "slow"):
                _faults.crash(action)
            try:
                cfg = config_from_dict(direction, cfg_dict)
                ref = (config_from_dict(direction, msg["against"]) if msg.get("against")
                       else None)
                bench = bench_for(problem)
            except Exception as e:  # a config the kernels reject, or inputs that cannot fit
                conn.send(Measurement("error", detail=f"{type(e).__name__}: {e}").as_dict())
                continue
            kw = dict(seed=msg["seed"], abandon_ms=msg.get("abandon_ms"), against=ref,
                      abandon_ratio=msg.get("abandon_ratio"), **timing)
            if action in ("corrupt", "raise"):
                with _faults.kernel_fault(action, direction):
                    m = measure(bench, direction, cfg, **kw)
            else:
                m = measure(bench, direction, cfg, **kw)
            conn.send(m.as_dict())
            if m.poisoned:
                return  # the CUDA context is gone; the parent starts a fresh worker
        elif op == "prepare":
            try:
                conn.send({"status": "ok", **bench_for(problem).prepare(direction, msg["seed"])})
            except Exception as e:  # the first candidate meets it again, and records it
                conn.send({"status": "error", "detail": f"{type(e).__name__}: {e}"})
                if poisons_context(e):
                    return
        elif op == "against":
            # A new incumbent's confirmation: its ratio to the old one, ``rounds`` times.
            try:
                bench = bench_for(problem)
                cfg = config_from_dict(direction, msg["config"])
                ref = config_from_dict(direction, msg["against"])
                ratios = [bench.time_against(direction, cfg, ref, **timing)[0].ratio
                          for _ in range(max(msg.get("rounds", 1), 1))]
                conn.send({"status": "ok", "ratios": ratios})
            except Exception as e:
                conn.send({"status": "error", "detail": f"{type(e).__name__}: {e}"})
                if poisons_context(e):
                    return
        elif op == "retime":
            cfgs = [config_from_dict(direction, c) for c in msg["configs"]]
            t0 = time.perf_counter()
            try:
                bench = bench_for(problem)
                company_errors: dict[str, str] = {}
                company = (anchor_launches(problem, "fwd" if direction == "fwd" else "fwd_bwd",
                                           msg["company"], company_errors)
                           if msg.get("company") and device == "cuda" else {})
                kw = dict(rounds=msg["rounds"], company=list(company.values()), **timing)
                if msg.get("clocks") and device == "cuda":
                    if sampler is None:
                        sampler = _clock_sampler(torch)
                    with sampler.window() as w:
                        ts = retime(bench, direction, cfgs, **kw)
                    clocks = w.summary() if sampler.available else None
                else:
                    ts = retime(bench, direction, cfgs, **kw)
                    clocks = None
                conn.send({"status": "ok", "timings": [t.as_dict() for t in ts[:len(cfgs)]],
                           "company": {n: t.as_dict()
                                       for n, t in zip(company, ts[len(cfgs):], strict=True)},
                           "company_errors": company_errors,
                           "seconds": time.perf_counter() - t0, "clocks": clocks})
                del company, kw  # the anchors' launches hold their inputs
            except Exception as e:
                conn.send({"status": "error", "detail": f"{type(e).__name__}: {e}"})
                return
        else:
            conn.send({"status": "error", "detail": f"unknown op {op!r}"})


def main(argv: list[str]) -> None:
    # Ctrl-C goes to the whole process group; the parent decides what to do with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    unblock_interrupts()  # held while this process started (Worker.start)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a worker is stuck
    conn = Connection(int(argv[1]))
    try:
        _serve(conn)
    except (BrokenPipeError, ConnectionResetError):
        # The parent is gone (interrupted, or killed, while this one started or measured):
        # no one to answer, and no traceback on the terminal the two shared.
        raise SystemExit(1) from None
    finally:
        conn.close()


if __name__ == "__main__":
    main(sys.argv)
