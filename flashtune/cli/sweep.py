"""`autotune sweep`: tune a shape set through the claims board of :mod:`flashtune.db.claims`.

One worker here, one per GPU with ``--gpus``, and any number on other hosts sharing a
PostgreSQL ``--db``. A rerun resumes. Progress is a live display on a terminal, one line
per finished problem otherwise; a summary table (or ``--json``) at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from flashtune.cli._common import (
    FiniteRange,
    clean_errors,
    console,
    db_option,
    fmt,
    json_stdout,
    kernel_mode,
    search_options,
    shape_label,
    shape_options,
    shape_set,
    where,
)

# The default search per (problem, direction) on a GPU: the standard preset (30 shapes,
# forward and backward) then takes under 20 minutes on one H200, cold caches included
# (BENCHMARKS.md, "Sweep speed").
SWEEP_TIME_BUDGET = 12.0


class _Watch(threading.Thread):
    """Polls the claims board and shows progress: a live display on a terminal, one line
    per finished task otherwise, nothing with --json. Works the same for workers in this
    process, in child processes and on other hosts."""

    def __init__(self, url: str, sid: str, title: str, mode: str, every_s: float = 1.0):
        super().__init__(daemon=True, name="flashtune-sweep-watch")
        self.url, self.sid, self.title, self.mode, self.every_s = url, sid, title, mode, every_s
        self.stopped = threading.Event()
        self.t0 = time.time()
        self.seen: dict[int, str] = {}
        self.first = True
        self.live: Any = None

    def run(self) -> None:
        from flashtune.db.claims import Board
        from flashtune.exceptions import StorageError

        try:  # never make the file again: gone now means deleted under the sweep
            board = Board(self.url, create=False)
        except StorageError:
            return  # the workers report it; a watcher shows nothing
        with board:
            if self.mode == "live":
                from rich.live import Live

                with Live(console=console(stderr=True), refresh_per_second=4,
                          transient=True) as self.live:
                    self._loop(board)
            else:
                self._loop(board)

    def _loop(self, board: Any) -> None:
        from flashtune.exceptions import StorageError

        while True:
            try:
                self._show(board.tasks(self.sid))
            except StorageError:
                pass  # busy database: show the next poll
            if self.stopped.wait(self.every_s):
                try:
                    self._show(board.tasks(self.sid))
                except StorageError:
                    pass
                return

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)

    def _show(self, tasks: list[Any]) -> None:
        from flashtune.db.claims import counts

        n = counts(tasks)
        total, settled = len(tasks), n["done"] + n["failed"]
        if self.mode in ("lines", "live"):
            for line in self._news(tasks, total):
                if self.live is None:
                    click.echo(line, err=True)
                else:  # printed above the live display, which stays at the bottom
                    self.live.console.print(line, markup=False, highlight=False)
        if self.live is not None:
            self.live.update(self._render(tasks, n, total, settled))

    def _news(self, tasks: list[Any], total: int) -> list[str]:
        """A line per task settled since the last poll (a resumed sweep: one line first)."""
        out = []
        if self.first:
            self.first = False
            before = [t for t in tasks if t.state in ("done", "failed")]
            self.seen.update((t.id, t.state) for t in before)
            if before:
                out.append(f"resuming: {len(before)} of {total} problems already settled")
        for t in tasks:
            if t.state in ("done", "failed") and self.seen.get(t.id) != t.state:
                self.seen[t.id] = t.state
                what = (f"{fmt(t.best_tflops, '.4g')} TFLOP/s, {t.trials} trials"
                        if t.state == "done" else (t.note or ""))
                took = f", {t.finished_at - t.started_at:.0f} s" \
                    if t.finished_at and t.started_at and t.state == "done" else ""
                cached = " (already tuned)" if t.note == "cached" else ""
                done_now = sum(1 for v in self.seen.values() if v in ("done", "failed"))
                out.append(f"[{done_now}/{total}] {t.state} {t.key.short()}: {what}{took}"
                           f"{cached}")
        return out

    def _render(self, tasks: list[Any], n: dict[str, int], total: int, settled: int) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        best = max((t for t in tasks if t.best_tflops), key=lambda t: t.best_tflops,
                   default=None)
        took = [t.finished_at - t.started_at for t in tasks
                if t.state == "done" and t.note != "cached" and t.finished_at and t.started_at]
        left = total - settled
        eta = "-"
        if took and left:
            secs = sum(took) / len(took) * left / max(n["running"], 1)
            eta = time.strftime("%H:%M:%S", time.gmtime(secs))
        elif not left:
            eta = "00:00:00"
        head = Table.grid(padding=(0, 1))
        head.add_row(Text(self.title, style="bold"),
                     ProgressBar(total=total or 1, completed=settled, width=30),
                     Text(f"{settled}/{total} problems"))
        elapsed = time.strftime("%H:%M:%S", time.gmtime(time.time() - self.t0))
        status = Text(f"running {n['running']}  failed {n['failed']}  elapsed {elapsed}  "
                      f"ETA {eta}")
        lines: list[Any] = [head, status]
        if best is not None:
            lines.append(Text(f"best so far: {best.best_tflops:.4g} TFLOP/s on "
                              f"{best.key.short()}"))
        for t in [t for t in tasks if t.state == "running"][:4]:
            lines.append(Text(f"  now: {t.key.short()}  [{shape_label(t.problem)}]  trials "
                              f"{t.trials or 0}  best {fmt(t.best_tflops, '.4g')} TFLOP/s  "
                              f"({t.worker})", style="cyan"))
        return Group(*lines)


def _summary(tasks: list[Any], interpreter: bool) -> Any:
    from rich.table import Table

    unit = "TFLOP/s (interpreter)" if interpreter else "TFLOP/s"
    table = Table(title="sweep summary", show_lines=False)
    for col in ("#", "key", "shape", "state", "trials", unit, "ms", "note"):
        table.add_column(col, justify="right" if col in ("#", "trials", unit, "ms") else "left")
    for t in tasks:
        note = t.note or ""
        table.add_row(str(t.seq + 1), t.key.short(), shape_label(t.problem), t.state,
                      fmt(t.trials, "d"), fmt(t.best_tflops, ".4g"), fmt(t.median_ms, ".4g"),
                      note if len(note) < 60 else note[:57] + "...")
    return table


def _parse_gpus(gpus: str | None) -> list[str]:
    if gpus is None:
        return []
    ids = [g.strip() for g in gpus.split(",")]
    if not all(g.isascii() and g.isdigit() and len(g) < 4 for g in ids) \
            or len(set(map(int, ids))) != len(ids):
        raise click.BadParameter(f"expected distinct GPU indices like 0,1,2, got {gpus!r}",
                                 param_hint="--gpus")
    return [str(int(g)) for g in ids]


def _spawn_workers(gpus: list[str], sid: str, opts: Any, interpreter: bool, logdir: Path,
                   procs: list[tuple[str, subprocess.Popen[bytes], Path]]) -> None:
    """Start one worker process per GPU, each listed in ``procs`` as soon as it exists."""
    from dataclasses import asdict

    from flashtune.autotune._isolation import children_start_held

    for g in gpus:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": g, "PYTHONUNBUFFERED": "1"}
        if interpreter:
            env["TRITON_INTERPRET"] = "1"
        spec = json.dumps({"sweep_id": sid, "label": f"gpu{g}", "options": asdict(opts)})
        log = logdir / f"worker-gpu{g}.log"
        with open(log, "wb") as f:
            # The spec (with the database URL and its password) goes through stdin: argv
            # is visible to every user in `ps`.
            with children_start_held():
                p = subprocess.Popen([sys.executable, "-m", "flashtune.autotune.sweep", "-"],
                                     env=env, stdin=subprocess.PIPE, stdout=f,
                                     stderr=subprocess.STDOUT)
        procs.append((g, p, log))
        assert p.stdin is not None
        p.stdin.write(spec.encode())
        p.stdin.close()


def _check_gpus(gpus: list[str]) -> Any:
    """The device of the listed GPUs; they must be of one kind (a sweep is per device)."""
    import torch

    from flashtune.db.fingerprint import device_info

    n = torch.cuda.device_count()
    bad = [g for g in gpus if int(g) >= n]
    if bad:
        raise click.BadParameter(f"no GPU {', '.join(bad)}: this machine has {n} "
                                 f"(indices 0..{n - 1})", param_hint="--gpus")
    kinds = {device_info(int(g)) for g in gpus}
    if len(kinds) > 1:
        names = ", ".join(sorted(d.name for d in kinds))
        raise click.BadParameter(f"the GPUs are of different kinds ({names}); run one sweep "
                                 "per kind", param_hint="--gpus")
    return kinds.pop()


@click.command("sweep")
@shape_options
@search_options("Candidates measured per problem and direction.",
                "Seconds of search per problem and direction (with neither this nor --trials: "
                f"{SWEEP_TIME_BUDGET:g} s on a GPU, the tuner's 50 trials under --interpret).")
@click.option("--gpus", default=None, metavar="0,1,...",
              help="Run one worker process per listed GPU (CUDA_VISIBLE_DEVICES each).")
@click.option("--retry-failed", is_flag=True, help="Tune again the problems that failed.")
@click.option("--from-stale", is_flag=True,
              help="Re-tune what an upgrade made stale on this device (kernel sources, Triton "
                   "or ptxas changed) in the database and the shipped layer, starting from the "
                   "stale winners.")
@click.option("--lease", type=FiniteRange(min=1, max=86400), default=120.0, show_default=True,
              metavar="S", help="Seconds without a heartbeat before another worker takes a "
                                "problem over.")
@click.option("--interpret", is_flag=True,
              help="Run Triton's CPU interpreter (tests and demos; not GPU timings).")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def sweep(preset: str | None, shapes: str | None, from_misses: bool, direction: str,
          trials: int | None, time_budget: float | None, gpus: str | None, retry_failed: bool,
          from_stale: bool, lease: float, interpret: bool, db_url: str | None,
          as_json: bool) -> None:
    """Tune a shape set on this machine; rerun to resume, share --db to scale out.

    Workers on many GPUs (--gpus) and hosts that are given the same shape set and the
    same PostgreSQL --db fill one sweep together: each problem is tuned once.
    """
    from flashtune.autotune.sweep import interrupt_on_sigterm

    restore = interrupt_on_sigterm()
    try:
        with json_stdout(as_json) as emit:  # stdout: the summary document alone
            _sweep(preset, shapes, from_misses, direction, trials, time_budget, gpus,
                   retry_failed, lease, interpret, db_url, as_json, from_stale, emit)
    finally:
        restore()


def _sweep(preset: str | None, shapes: str | None, from_misses: bool, direction: str,
           trials: int | None, time_budget: float | None, gpus: str | None,
           retry_failed: bool, lease: float, interpret: bool, db_url: str | None,
           as_json: bool, from_stale: bool = False,
           emit: Callable[[str], None] = click.echo) -> None:
    gpu_ids = _parse_gpus(gpus)
    interpreter = kernel_mode("sweep", interpret)
    if trials is None and time_budget is None and not interpreter:
        time_budget = SWEEP_TIME_BUDGET
    if from_stale:
        given = [n for n, v in (("--preset", preset), ("--shapes", shapes),
                                ("--from-misses", from_misses)) if v]
        if given:
            raise click.UsageError(f"choose one shape set, got --from-stale and {given[0]}")
        title, problems = "stale results", list[Any]()
    else:
        title, problems = shape_set(preset, shapes, from_misses, db_url)
    from flashtune.autotune.sweep import Options, prepare_optuna, stale_tasks
    from flashtune.db import open_storage, resolve_url
    from flashtune.db.claims import Board, tasks_for
    from flashtune.db.fingerprint import device_info, software_info

    dirs = ["fwd", "bwd"] if direction == "both" else [direction]
    with clean_errors():
        url = resolve_url(db_url)
        device = _check_gpus(gpu_ids) if gpu_ids and not interpreter else device_info()
        software = software_info()
        with open_storage(url) as st:  # create or upgrade the schema once, before any worker
            st.check_writable()  # mode=ro: refused before Optuna (which ignores it) writes
            todo = stale_tasks(st, device, software, dirs) if from_stale \
                else tasks_for(problems, dirs)
        if from_stale and not todo:
            raise click.ClickException(f"nothing is stale on {device.name} in {where(url)} or "
                                       "the shipped layer: every result is fresh, or has a "
                                       "fresh one beside it")
        problems = [p for _, p in todo] if from_stale else problems
        prepare_optuna(url)
        # One board for the whole sweep: its every transaction, the last read included,
        # checks that the database file is the one the sweep started on.
        with Board(url, create=False) as board:
            sid = board.create(device, software, todo, trials)
            freed = board.recover_local(sid)
            opts = Options(db_url=url, trials=trials, time_budget=time_budget, lease_s=lease,
                           retry_failed=retry_failed)
            shared = "" if "://" not in str(db_url or "") else " (shared)"
            if not as_json:
                click.echo(f"sweep {sid}: {title}, {len(problems)} shapes x {'+'.join(dirs)} "
                           f"on {device.name}{' (interpreter)' if interpreter else ''}; "
                           f"database {where(url)}{shared}"
                           + (f"; freed {freed} task(s) of dead local workers" if freed
                              else ""), err=True)
            mode = "quiet" if as_json else ("live" if sys.stderr.isatty() else "lines")
            interrupted, failures = _run(board, sid, opts, gpu_ids, interpreter,
                                         _Watch(url, sid, title, mode))
            tasks = board.tasks(sid)
    _finish_sweep(sid, tasks, device, interpreter, as_json, interrupted, failures, emit)


def _run(board: Any, sid: str, opts: Any, gpu_ids: list[str], interpreter: bool,
         watch: Any) -> tuple[bool, list[str]]:
    """Run the workers (in this process, or one per GPU) while ``watch`` shows progress;
    returns (interrupted, a line per failed worker)."""
    from flashtune.autotune.sweep import run_worker

    watch.start()
    try:
        if gpu_ids:
            return False, _run_children(gpu_ids, sid, opts, interpreter)
        run_worker(board, sid, opts)
        return False, []
    except KeyboardInterrupt:
        return True, []
    finally:
        watch.stop()


def _run_children(gpu_ids: list[str], sid: str, opts: Any, interpreter: bool) -> list[str]:
    """Run one worker process per GPU; returns a line per worker that failed."""
    from flashtune.autotune._isolation import interrupts_held
    from flashtune.autotune.sweep import check_interrupted

    with tempfile.TemporaryDirectory(prefix="flashtune-sweep-") as tmp:
        procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        try:
            # SIGINT and SIGTERM wait until every worker is started and listed: one inside
            # Popen, or between two starts, would leave a worker tuning on that no one
            # stops.
            with interrupts_held():
                _spawn_workers(gpu_ids, sid, opts, interpreter, Path(tmp), procs)
            for _, p, _ in procs:
                while True:
                    try:
                        p.wait(timeout=0.5)
                        break
                    except subprocess.TimeoutExpired:
                        check_interrupted()  # a KeyboardInterrupt lost in a callback
        except KeyboardInterrupt:
            # A Ctrl-C reached them too, a `kill` of this process alone did not: pass it
            # on, and let them release their tasks.
            for _, p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            for _, p, _ in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            raise
        bad = []
        for g, p, log in procs:
            if p.returncode != 0:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                bad.append(f"worker on GPU {g} exited with status {p.returncode}: "
                           + " | ".join(tail))
        return bad


def _finish_sweep(sid: str, tasks: list[Any], device: Any, interpreter: bool, as_json: bool,
                  interrupted: bool, failures: list[str],
                  emit: Callable[[str], None] = click.echo) -> None:
    from flashtune.db.claims import counts

    n = counts(tasks)
    if as_json:
        emit(json.dumps({
            "sweep_id": sid, "device": device.as_dict(), "interpreter": interpreter,
            "counts": n, "interrupted": interrupted,
            "tasks": [{"key": t.key.as_dict(), "problem": t.problem.as_dict(),
                       "state": t.state, "trials": t.trials, "tflops": t.best_tflops,
                       "median_ms": t.median_ms, "note": t.note, "worker": t.worker,
                       "attempts": t.attempts} for t in tasks]}, indent=2, sort_keys=True))
    else:
        console().print(_summary(tasks, interpreter))
        click.echo(f"{n['done']} done, {n['failed']} failed, {n['running']} running elsewhere, "
                   f"{n['pending']} pending", err=True)
    for line in failures:
        click.echo(line, err=True)
    if interrupted:
        click.echo("interrupted: run the same command again to resume", err=True)
        from flashtune.autotune.sweep import interrupted_status

        sys.exit(interrupted_status())
    if n["failed"] or failures:
        raise click.ClickException(
            f"{n['failed']} problem(s) failed (see the note column); rerun with --retry-failed "
            "to tune them again" if n["failed"] else "a sweep worker failed")
