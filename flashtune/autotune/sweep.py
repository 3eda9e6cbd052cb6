"""Sweep workers: claim a task of the board (:mod:`flashtune.db.claims`), tune it, settle it.

- **tune**: the task runs through :func:`flashtune.autotune.tune`, whose Optuna study
  lives in the same database (Optuna's RDB storage), so a task taken over from a dead
  worker, or a sweep run again, continues the study instead of starting over.
- **heartbeat**: while tuning, a thread renews the lease every third of its length, and
  the tuner's progress goes to the board for every watcher to see.
- A worker process runs ``python -m flashtune.autotune.sweep SPEC_JSON``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flashtune.db.claims import (
    DEFAULT_LEASE_S,
    Board,
    Task,
    counts,
)
from flashtune.exceptions import FlashtuneError, StorageError


@dataclass
class Options:
    """What a worker needs besides the board: the database and the tuning budget."""

    db_url: str
    trials: int | None = None
    time_budget: float | None = None  # seconds per task
    lease_s: float = DEFAULT_LEASE_S
    retry_failed: bool = False
    wait: bool = True  # keep polling while other workers hold tasks (take over dead ones)
    poll_s: float = 2.0


class _Heartbeat(threading.Thread):
    """Renews the lease of the task in hand every third of the lease."""

    def __init__(self, board: Board, task: Task, worker: str, lease_s: float) -> None:
        super().__init__(daemon=True, name=f"flashtune-heartbeat-{task.id}")
        self.board, self.task, self.worker, self.lease_s = board, task, worker, lease_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.lease_s / 3):
            try:
                self.board.heartbeat(self.task.id, self.worker, lease_s=self.lease_s)
            except StorageError:
                pass  # a missed beat is survivable; the next one may get through

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


def worker_id(label: str = "") -> str:
    tail = f":{label}" if label else ""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}{tail}"


def stale_tasks(storage: Any, device: Any, software: Any, directions: Sequence[str],
                shipped: Iterable[Any] | None = None) -> list[tuple[Any, Any]]:
    """``(key, problem)`` tasks for ``autotune sweep --from-stale``: every key of
    ``directions`` with a stale result on ``device`` (in ``storage``, or in the shipped
    layer ``shipped``: default, the package's) and no fresh one in either, in key order,
    each with its stale result's example problem (else a representative of the key). The
    tuner enqueues the stale winners as the first trials (see its warm start)."""
    from flashtune.autotune.verify import representative

    if shipped is None:
        from flashtune.db.exchange import shipped_results

        shipped = shipped_results(software)
    here = device.fingerprint
    layer = [r for r in shipped if r.device.fingerprint == here]
    fresh = set(storage.load_table(device, software)) | {r.key for r in layer if not r.stale}
    out: dict[Any, Any] = {}
    for r in [*storage.results(software=software), *layer]:
        if r.stale and r.device.fingerprint == here \
                and r.key.direction in directions and r.key not in fresh:
            out.setdefault(r.key, r.problem if r.problem is not None else representative(r.key))
    return sorted(out.items())


def _cached(storage: Any, device: Any, software: Any, task: Task, trials: int | None) -> Any:
    """A fresh stored result good enough to skip the task: measured here or verified here
    (an import's claim never stands in for a measurement), with as many trials as asked."""
    r = storage.get_result(device, software, task.key)
    if r is None or not r.trusted or (trials is not None and r.trials < trials):
        return None
    return r


class _Progress:
    """Forwards the tuner's per-trial events to the board, at most every ``every_s``, so
    every watcher (this host or another) sees the current task's best TFLOP/s."""

    def __init__(self, board: Board, task: Task, worker: str, lease_s: float,
                 every_s: float = 2.0) -> None:
        self.board, self.task, self.worker, self.lease_s = board, task, worker, lease_s
        self.every_s, self.last = every_s, 0.0
        self.flops = task.problem.flops(task.direction)

    def __call__(self, ev: dict[str, Any]) -> None:
        check_interrupted()
        if ev.get("event") != "trial":
            return
        best = ev.get("best_ms")
        now = time.monotonic()
        if not isinstance(best, float) or not 0 < best < float("inf") \
                or now - self.last < self.every_s:
            return
        self.last = now
        try:
            self.board.heartbeat(self.task.id, self.worker, lease_s=self.lease_s,
                                 best_tflops=self.flops / (best * 1e-3) / 1e12,
                                 trials=ev.get("measured"))
        except StorageError:
            pass


def tune_task(task: Task, opts: Options, storage: Any, session: Any,
              progress: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """Tune one task with the tuner (its study resumes if it exists); returns its result."""
    from flashtune.autotune import tune

    return tune(task.problem, task.direction, trials=opts.trials, time_budget=opts.time_budget,
                storage=storage, session=session, progress=progress)


def prepare_optuna(url: str) -> None:
    """Create Optuna's tables in ``url`` before the workers start (``optuna_storage``
    retries the creation race, so workers that start together would also be safe)."""
    from flashtune.autotune.study import optuna_storage
    from flashtune.db import resolve_url

    optuna_storage(resolve_url(url))


def run_worker(board: Board, sid: str, opts: Options, *, worker: str | None = None,
               on_event: Callable[[str, Task], None] | None = None) -> dict[str, int]:
    """Claim and tune tasks of sweep ``sid`` until none is left; returns what it did.

    ``on_event(kind, task)`` is called with ``"start"``, ``"done"`` and ``"failed"``.
    A KeyboardInterrupt releases the task in hand and propagates.
    """
    from flashtune.autotune import TuneSession
    from flashtune.db import open_storage
    from flashtune.db.fingerprint import device_info, software_info

    worker = worker or worker_id()
    did = {"done": 0, "failed": 0, "cached": 0}
    device, software = device_info(), software_info()
    board.recover_local(sid)
    prepare_optuna(opts.db_url)
    with open_storage(opts.db_url, create=False) as storage, TuneSession() as session:
        warm = False
        while True:
            check_interrupted()
            task = board.claim(sid, worker, lease_s=opts.lease_s, retry_failed=opts.retry_failed)
            if task is None:
                left = counts(board.tasks(sid))
                if not opts.wait or left["running"] == 0:
                    return did
                time.sleep(opts.poll_s)  # others hold tasks: take over any whose lease lapses
                continue
            if on_event:
                on_event("start", task)
            hb = _Heartbeat(board, task, worker, opts.lease_s)
            hb.start()
            try:
                hit = _cached(storage, device, software, task, opts.trials)
                note = "cached" if hit is not None else None
                if hit is None and not warm:
                    # The processes' start-up is the sweep's, not its first task's budget
                    # (paid inside it, the first task of every GPU sweep got 1 trial in 12 s).
                    session.warm()
                    warm = True
                result = hit if hit is not None else tune_task(
                    task, opts, storage, session, _Progress(board, task, worker, opts.lease_s))
            except KeyboardInterrupt:
                hb.stop()
                board.release(task.id, worker)
                raise
            except Exception as e:  # one bad problem must not end the sweep
                hb.stop()
                msg = " ".join(str(e).split()) or type(e).__name__
                board.fail(task.id, worker, f"{type(e).__name__}: {msg}")
                did["failed"] += 1
                if on_event:
                    on_event("failed", task)
                continue
            hb.stop()
            board.finish(task.id, worker, trials=result.trials, best_tflops=result.tflops,
                         median_ms=result.median_ms, note=note)
            did["cached" if note else "done"] += 1
            if on_event:
                on_event("done", task)


_SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}  # 128 + the signal's number
_received: list[str] = []
_armed: list[bool] = [False]  # interrupt_on_sigterm's handlers are installed


def check_interrupted() -> None:
    """Raise KeyboardInterrupt if a SIGTERM or SIGINT arrived while the handlers of
    :func:`interrupt_on_sigterm` were installed. The handler's own KeyboardInterrupt can be
    lost: raised while Python runs a weakref callback or a ``__del__`` (garbage collection
    can run either at any point), it is printed as "Exception ignored" and the program goes
    on. The sweep calls this before each task and at each of the tuner's events, so a lost
    interrupt still stops it within a trial."""
    if _armed[0] and _received:
        raise KeyboardInterrupt


def interrupt_on_sigterm() -> Callable[[], None]:
    """Handle SIGTERM (Slurm, Kubernetes, ``kill``) as SIGINT: a KeyboardInterrupt in the
    main thread, so the task in hand goes back to pending and the process exits cleanly.
    Returns a function that puts the previous handlers back."""
    import signal
    import sys

    def handler(signum: int, frame: Any) -> None:
        _received.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    # An interrupt lost in a weakref callback or a __del__ goes to sys.unraisablehook,
    # whose default prints "Exception ignored in ..." and a traceback on the terminal:
    # not for this one, which check_interrupted raises again at the sweep's next event.
    passed_on = sys.unraisablehook

    def unraisable(u: Any) -> None:
        if not (isinstance(u.exc_value, KeyboardInterrupt) and _received):
            passed_on(u)

    _received.clear()
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    sys.unraisablehook = unraisable
    _armed[0] = True

    def restore() -> None:
        _armed[0] = False
        for s, h in old.items():
            signal.signal(s, h)
        sys.unraisablehook = passed_on

    return restore


def interrupted_status() -> int:
    """The exit status after an interrupt: 143 for SIGTERM, 130 for SIGINT (Ctrl-C)."""
    return _SIGNAL_EXIT.get(_received[0] if _received else "SIGINT", 130)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a worker process: ``python -m flashtune.autotune.sweep -``.

    The spec (JSON: ``sweep_id``, ``options`` (:class:`Options` fields) and ``label``)
    comes on stdin, never in argv, where ``ps`` would show the database URL and its
    password (a ``SPEC_JSON`` argument in place of ``-`` is accepted too). SIGINT and
    SIGTERM release the task in hand and exit with 130 / 143, without a traceback.
    """
    import sys

    from flashtune.autotune._isolation import unblock_interrupts

    interrupt_on_sigterm()
    try:
        unblock_interrupts()  # held while this process started (the sweep's --gpus spawn)
        args = list(sys.argv[1:] if argv is None else argv)
        spec = json.loads(sys.stdin.read() if args[0] == "-" else args[0])
        opts = Options(**spec["options"])
        with Board(opts.db_url, create=False) as board:
            did = run_worker(board, spec["sweep_id"], opts,
                             worker=worker_id(spec.get("label", "")))
    except KeyboardInterrupt:
        return interrupted_status()
    except FlashtuneError as e:
        print(f"flashtune sweep worker: {e}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(did), flush=True)
    except BrokenPipeError:  # the parent is gone; what was done is in the database
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
