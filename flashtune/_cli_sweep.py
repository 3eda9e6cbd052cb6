"""`autotune` commands: sweep family (sweep, bench, report, info).

- ``sweep`` tunes a shape set (a preset, a shapes file or the dispatcher's recorded
  misses) through the claims board of :mod:`flashtune.autotune.sweep`: one worker here,
  one per GPU with ``--gpus``, and any number on other hosts sharing a PostgreSQL
  ``--db``. A rerun resumes. Progress is a live display on a terminal, one line per
  finished problem otherwise; a summary table (or ``--json``) at the end.
- ``bench`` times tuned, default, SDPA backends and FlexAttention over a shape set.
- ``report`` draws TFLOP/s per shape and the tuning curves to PNG + HTML.
- ``info`` prints the device, versions, database and its layers.

Expected failures print one line and exit non-zero, never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from flashtune._cli_db import _clean_errors, db_option, search_options
from flashtune._env import interpreting
from flashtune.exceptions import FlashtuneError

COMMANDS: list[click.Command] = []

NO_GPU = ("no CUDA GPU found: `autotune {cmd}` runs kernels. Run it on a machine with a CUDA "
          "GPU, or pass --interpret to use Triton's CPU interpreter (slow; its timings are "
          "not GPU timings).")


def _command(fn: Callable[..., Any]) -> click.Command:
    cmd = click.command(fn.__name__.rstrip("_"))(fn)
    COMMANDS.append(cmd)
    return cmd


def _kernel_mode(cmd: str, interpret: bool) -> bool:
    """Choose GPU or Triton's interpreter before any kernel is defined; True = interpreter.

    TRITON_INTERPRET must be in the environment before flashtune.kernels is imported; if
    they were already imported without it, re-run this command in a fresh interpreter.
    """
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        mod = sys.modules.get("flashtune.kernels.attention")
        if mod is not None and not getattr(mod, "_INTERPRET", True):
            os.execv(sys.executable, [sys.executable, "-m", "flashtune.cli", *sys.argv[1:]])
    if interpreting():
        return True
    import torch

    if not torch.cuda.is_available():
        raise click.ClickException(NO_GPU.format(cmd=cmd))
    return False


def _shape_set(preset: str | None, shapes: str | None, from_misses: bool,
               db_url: str | None) -> tuple[str, list[Any]]:
    """(description, problems) of the chosen shape set; the default is the standard preset."""
    from flashtune.autotune.presets import load_shapes
    from flashtune.autotune.presets import preset as get_preset

    chosen = [n for n, v in (("--preset", preset), ("--shapes", shapes),
                             ("--from-misses", from_misses)) if v]
    if len(chosen) > 1:
        raise click.UsageError(f"choose one shape set, got {' and '.join(chosen)}")
    try:
        if shapes:
            return f"shapes file {shapes}", load_shapes(shapes)
        if from_misses:
            return "recorded misses", _misses(db_url)
        name = preset or "standard"
        return f"preset {name}", get_preset(name)
    except (ValueError, OSError, FlashtuneError) as e:
        raise click.ClickException(" ".join(str(e).split())) from None


def _misses(db_url: str | None) -> list[Any]:
    from flashtune.db.fingerprint import device_info
    from flashtune.db.storage import open_storage
    from flashtune.exceptions import DatabaseMissingError

    try:
        with open_storage(db_url, read_only=True) as st:
            found = st.misses(device=device_info().fingerprint)
    except DatabaseMissingError:
        found = []
    if not found:
        raise ValueError("the database has no recorded dispatcher misses for this device; "
                         "run your model with flashtune first, or use --preset/--shapes")
    return [p for _, _, p in found]


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # A pipe or a file gets whole rows: wide tables wrap badly at rich's default 80 columns.
    width = None if stream.isatty() else 200
    return Console(file=stream, highlight=False, soft_wrap=False, width=width)


def _shape(p: Any) -> str:
    kv = f"/{p.heads_kv}" if p.heads_kv != p.heads_q else ""
    sk = f"x{p.seqlen_k}" if p.seqlen_k != p.seqlen_q else ""
    extra = (" causal" if p.causal else "") + (f" win{list(p.window)}" if p.has_window else "") \
        + (f" cap{p.softcap:g}" if p.softcap else "")
    return f"{p.batch}x{p.heads_q}{kv}x{p.seqlen_q}{sk}x{p.head_dim} {p.dtype}{extra}"


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


# ------------------------------------------------------------------------------- sweep


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
        from flashtune.autotune.sweep import Board

        with Board(self.url) as board:
            if self.mode == "live":
                from rich.live import Live

                with Live(console=_console(stderr=True), refresh_per_second=4,
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
        from flashtune.autotune.sweep import counts

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
                what = (f"{_fmt(t.best_tflops, '.4g')} TFLOP/s, {t.trials} trials"
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
            lines.append(Text(f"  now: {t.key.short()}  [{_shape(t.problem)}]  trials "
                              f"{t.trials or 0}  best {_fmt(t.best_tflops, '.4g')} TFLOP/s  "
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
        table.add_row(str(t.seq + 1), t.key.short(), _shape(t.problem), t.state,
                      _fmt(t.trials, "d"), _fmt(t.best_tflops, ".4g"), _fmt(t.median_ms, ".4g"),
                      note if len(note) < 60 else note[:57] + "...")
    return table


def _parse_gpus(gpus: str | None) -> list[str]:
    if gpus is None:
        return []
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids or not all(g.isdigit() for g in ids) or len(set(ids)) != len(ids):
        raise click.BadParameter(f"expected distinct GPU indices like 0,1,2, got {gpus!r}",
                                 param_hint="--gpus")
    return ids


def _spawn_workers(gpus: list[str], sid: str, opts: Any, interpreter: bool,
                   logdir: Path) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
    from dataclasses import asdict

    procs = []
    for g in gpus:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": g, "PYTHONUNBUFFERED": "1"}
        if interpreter:
            env["TRITON_INTERPRET"] = "1"
        spec = json.dumps({"sweep_id": sid, "label": f"gpu{g}", "options": asdict(opts)})
        log = logdir / f"worker-gpu{g}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen([sys.executable, "-m", "flashtune.autotune.sweep", spec],
                                 env=env, stdout=f, stderr=subprocess.STDOUT)
        procs.append((g, p, log))
    return procs


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


def _shape_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    from flashtune.autotune.presets import PRESETS

    fn = click.option("--from-misses", is_flag=True,
                      help="The problems the dispatcher recorded as misses on this device.")(fn)
    fn = click.option("--shapes", type=click.Path(exists=True, dir_okay=False), default=None,
                      metavar="FILE", help="A YAML or JSON list of shapes (see docs).")(fn)
    fn = click.option("--preset", type=click.Choice(list(PRESETS)), default=None,
                      help="A named shape set (default: standard).")(fn)
    return fn


@_command
@_shape_options
@search_options("Candidates measured per problem and direction (default: the tuner's).",
                "Seconds of search per problem and direction.")
@click.option("--gpus", default=None, metavar="0,1,...",
              help="Run one worker process per listed GPU (CUDA_VISIBLE_DEVICES each).")
@click.option("--retry-failed", is_flag=True, help="Tune again the problems that failed.")
@click.option("--lease", type=click.FloatRange(min=1), default=120.0, show_default=True,
              metavar="S", help="Seconds without a heartbeat before another worker takes a "
                                "problem over.")
@click.option("--interpret", is_flag=True,
              help="Run Triton's CPU interpreter (tests and demos; not GPU timings).")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def sweep(preset: str | None, shapes: str | None, from_misses: bool, direction: str,
          trials: int | None, time_budget: float | None, gpus: str | None, retry_failed: bool,
          lease: float, interpret: bool, db_url: str | None, as_json: bool) -> None:
    """Tune a shape set on this machine; rerun to resume, share --db to scale out.

    Workers on many GPUs (--gpus) and hosts that are given the same shape set and the
    same PostgreSQL --db fill one sweep together: each problem is tuned once.
    """
    interpreter = _kernel_mode("sweep", interpret)
    gpu_ids = _parse_gpus(gpus)
    title, problems = _shape_set(preset, shapes, from_misses, db_url)
    from flashtune.autotune.sweep import Board, Options, prepare_optuna, run_worker, tasks_for
    from flashtune.db.fingerprint import device_info, software_info
    from flashtune.db.storage import open_storage, resolve_url

    dirs = ["fwd", "bwd"] if direction == "both" else [direction]
    with _clean_errors():
        url = resolve_url(db_url)
        device = _check_gpus(gpu_ids) if gpu_ids and not interpreter else device_info()
        software = software_info()
        open_storage(url).close()  # create or upgrade the schema once, before any worker
        prepare_optuna(url)
        with Board(url) as board:
            sid = board.create(device, software, tasks_for(problems, dirs), trials)
            freed = board.recover_local(sid)
        opts = Options(db_url=url, trials=trials, time_budget=time_budget, lease_s=lease,
                       retry_failed=retry_failed)
        where = "" if "://" not in str(db_url or "") else " (shared)"
        if not as_json:
            click.echo(f"sweep {sid}: {title}, {len(problems)} shapes x {'+'.join(dirs)} on "
                       f"{device.name}{' (interpreter)' if interpreter else ''}; "
                       f"database {_where(url)}{where}"
                       + (f"; freed {freed} task(s) of dead local workers" if freed else ""),
                       err=True)
        mode = "quiet" if as_json else ("live" if sys.stderr.isatty() else "lines")
        watch = _Watch(url, sid, title, mode)
        watch.start()
        interrupted = False
        failures: list[str] = []
        try:
            if gpu_ids:
                failures = _run_children(gpu_ids, sid, opts, interpreter)
            else:
                with Board(url) as board:
                    run_worker(board, sid, opts)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            watch.stop()
        with Board(url) as board:
            tasks = board.tasks(sid)
    _finish_sweep(sid, tasks, device, interpreter, as_json, interrupted, failures)


def _where(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _db_file(url: str) -> str | None:
    """The SQLite file of ``url`` (None for a server or memory)."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    return os.path.abspath(u.database)


def _run_children(gpu_ids: list[str], sid: str, opts: Any, interpreter: bool) -> list[str]:
    """Run one worker process per GPU; returns a line per worker that failed."""
    with tempfile.TemporaryDirectory(prefix="flashtune-sweep-") as tmp:
        procs = _spawn_workers(gpu_ids, sid, opts, interpreter, Path(tmp))
        try:
            for _, p, _ in procs:
                p.wait()
        except KeyboardInterrupt:
            for _, p, _ in procs:  # they got the SIGINT too; let them release their tasks
                p.wait(timeout=30)
            raise
        bad = []
        for g, p, log in procs:
            if p.returncode != 0:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                bad.append(f"worker on GPU {g} exited with status {p.returncode}: "
                           + " | ".join(tail))
        return bad


def _finish_sweep(sid: str, tasks: list[Any], device: Any, interpreter: bool, as_json: bool,
                  interrupted: bool, failures: list[str]) -> None:
    from flashtune.autotune.sweep import counts

    n = counts(tasks)
    if as_json:
        click.echo(json.dumps({
            "sweep_id": sid, "device": device.as_dict(), "interpreter": interpreter,
            "counts": n, "interrupted": interrupted,
            "tasks": [{"key": t.key.as_dict(), "problem": t.problem.as_dict(),
                       "state": t.state, "trials": t.trials, "tflops": t.best_tflops,
                       "median_ms": t.median_ms, "note": t.note, "worker": t.worker,
                       "attempts": t.attempts} for t in tasks]}, indent=2, sort_keys=True))
    else:
        _console().print(_summary(tasks, interpreter))
        click.echo(f"{n['done']} done, {n['failed']} failed, {n['running']} running elsewhere, "
                   f"{n['pending']} pending", err=True)
    for line in failures:
        click.echo(line, err=True)
    if interrupted:
        click.echo("interrupted: run the same command again to resume", err=True)
        sys.exit(130)
    if n["failed"] or failures:
        raise click.ClickException(
            f"{n['failed']} problem(s) failed (see the note column); rerun with --retry-failed "
            "to tune them again" if n["failed"] else "a sweep worker failed")


# ------------------------------------------------------------------------------- bench


def _impls(p: Any, storage: Any, device: Any, software: Any,
           interpreter: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """({name: attn(q, k, v)}, {"tuned": which directions were tuned})."""
    from flashtune.kernels.attention import flash_attention
    from flashtune.kernels.config import config_from_dict, default_bwd, default_fwd
    from flashtune.timing import anchors

    def ours(fwd: Any, bwd: Any) -> Any:
        return lambda q, k, v: flash_attention(q, k, v, causal=p.causal, window_size=p.window,
                                               softcap=p.softcap, config=(fwd, bwd))

    dflt = (default_fwd(p), default_bwd(p))
    tuned: dict[str, Any] = {}
    for d in ("fwd", "bwd"):
        r = storage.get_result(device, software, p.key(d)) if storage is not None else None
        if r is not None:
            tuned[d] = config_from_dict(d, r.config)
    impls: dict[str, Any] = {}
    if tuned:
        impls["tuned"] = ours(tuned.get("fwd", dflt[0]), tuned.get("bwd", dflt[1]))
    impls["default"] = ours(*dflt)
    if not interpreter:
        impls.update(anchors(p))
    return impls, {"tuned": sorted(tuned)}


def _bench_rows(problems: list[Any], storage: Any, interpreter: bool, rep_ms: float,
                progress: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[str]]:
    from flashtune.db.fingerprint import device_info, software_info
    from flashtune.timing import three_timings

    device, software = device_info(), software_info()
    dev = "cpu" if interpreter else "cuda"
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for i, p in enumerate(problems):
        progress(f"[{i + 1}/{len(problems)}] {_shape(p)}")
        impls, info = _impls(p, storage, device, software, interpreter)
        timings: dict[str, dict[str, Any]] = {}
        for name, fn in impls.items():
            try:
                with warnings.catch_warnings():
                    # SDPA explains at length why a forced backend cannot run a shape; the
                    # error below says it in one line.
                    warnings.simplefilter("ignore", UserWarning)
                    timings[name] = three_timings(fn, p, dev, rep_ms=rep_ms)
            except Exception as e:  # an anchor that cannot run this shape is left out
                errors.append(f"{_shape(p)}: {name}: {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}")
        for kind in ("fwd", "bwd", "infer"):
            flops = p.flops("bwd" if kind == "bwd" else "fwd")
            tf = {n: t[kind].tflops(flops) for n, t in timings.items()}
            ms = {n: t[kind].median_ms for n, t in timings.items()}
            rows.append({"problem": p.as_dict(), "shape": _shape(p), "timing": kind,
                         "tflops": tf, "ms": ms, "ratios": _ratios(tf),
                         "tuned_directions": info["tuned"]})
    return rows, errors


def _ratios(tf: dict[str, float]) -> dict[str, float]:
    """Ours against the others: tuned (or default when untuned) over each other impl."""
    ours = "tuned" if "tuned" in tf else "default"
    return {f"{ours}/{n}": tf[ours] / v for n, v in tf.items() if n != ours and v > 0}


@_command
@_shape_options
@click.option("--rep-ms", type=click.FloatRange(min=1), default=100.0, show_default=True,
              help="do_bench repetition time per measurement.")
@click.option("--interpret", is_flag=True,
              help="Run Triton's CPU interpreter (tests and demos; not GPU timings).")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def bench(preset: str | None, shapes: str | None, from_misses: bool, rep_ms: float,
          interpret: bool, db_url: str | None, as_json: bool) -> None:
    """Compare tuned, default, the SDPA backends and FlexAttention over a shape set.

    TFLOP/s by the house protocol: training forward, backward ((fwd+bwd) - fwd) and
    inference forward, all timed in this process; ratios are ours over each other.
    """
    interpreter = _kernel_mode("bench", interpret)
    _, problems = _shape_set(preset, shapes, from_misses, db_url)
    from flashtune.db.fingerprint import device_info, software_info
    from flashtune.db.storage import open_storage
    from flashtune.exceptions import DatabaseMissingError
    from flashtune.timing import geomean

    with _clean_errors():
        try:
            storage = open_storage(db_url, read_only=True)
        except DatabaseMissingError:
            storage = None  # nothing tuned yet: default and anchors only
        try:
            quiet = (lambda _m: None) if as_json else (lambda m: click.echo(m, err=True))
            rows, errors = _bench_rows(problems, storage, interpreter, rep_ms, quiet)
        finally:
            if storage is not None:
                storage.close()
    names = sorted({r for row in rows for r in row["ratios"]})
    summary = {kind: {n: geomean([row["ratios"][n] for row in rows
                                  if row["timing"] == kind and n in row["ratios"]])
                      for n in names} for kind in ("fwd", "bwd", "infer")}
    if as_json:
        import datetime

        click.echo(json.dumps({
            "device": device_info().as_dict(), "software": software_info().as_dict(),
            "interpreter": interpreter,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rows": rows, "geomean_ratios": summary, "errors": errors},
            indent=2, sort_keys=True, default=str))
        return
    _console().print(_bench_table(rows, interpreter))
    for kind, r in summary.items():
        shown = "  ".join(f"{n} {v:.2f}x" for n, v in r.items() if v == v)
        if shown:
            click.echo(f"geomean {kind}: {shown}")
    for e in errors:
        click.echo(f"skipped {e}", err=True)


_IMPL_ORDER = ("tuned", "default", "cudnn", "fa2", "efficient", "flex")


def _bench_table(rows: list[dict[str, Any]], interpreter: bool) -> Any:
    from rich.table import Table

    impls = [n for n in _IMPL_ORDER if any(n in r["tflops"] for r in rows)]
    ratios = sorted({n for r in rows for n in r["ratios"]},
                    key=lambda n: _IMPL_ORDER.index(n.split("/")[1]))
    unit = "TFLOP/s, interpreter" if interpreter else "TFLOP/s"
    table = Table(title=f"attention {unit}")
    table.add_column("shape")
    table.add_column("timing")
    for n in impls:
        table.add_column(n, justify="right")
    for n in ratios:
        table.add_column(n, justify="right", style="bold")
    for r in rows:
        table.add_row(r["shape"], r["timing"], *[_fmt(r["tflops"].get(n), ".3g") for n in impls],
                      *[_fmt(r["ratios"].get(n), ".2f") for n in ratios])
    return table


# ------------------------------------------------------------------------------ report


@_command
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="flashtune-report",
              show_default=True, help="Folder for report.png and report.html.")
@click.option("--bench", "bench_file", type=click.Path(exists=True, dir_okay=False),
              default=None, metavar="FILE",
              help="`autotune bench --json` output: TFLOP/s of every implementation.")
@click.option("--device", default=None, metavar="TEXT",
              help="Only this device: a fingerprint or part of its name.")
@db_option
def report(out_dir: str, bench_file: str | None, device: str | None,
           db_url: str | None) -> None:
    """Draw TFLOP/s per shape for each implementation and the tuning progress curves."""
    from flashtune import _report

    with _clean_errors():
        bench_doc = None
        if bench_file:
            try:
                bench_doc = json.loads(Path(bench_file).read_text())
                if not isinstance(bench_doc, dict) or "rows" not in bench_doc:
                    raise ValueError("no 'rows'")
            except ValueError as e:
                raise click.ClickException(
                    f"{bench_file}: not `autotune bench --json` output ({e})") from None
        png, html = _report.build(db_url, Path(out_dir), bench=bench_doc, device=device)
    click.echo(f"wrote {png} and {html}")


# -------------------------------------------------------------------------------- info


def _layer(name: str, source: str, results: list[Any]) -> dict[str, Any]:
    by_dev: dict[str, int] = {}
    for r in results:
        by_dev[r.device.name] = by_dev.get(r.device.name, 0) + 1
    return {"name": name, "source": source, "entries": len(results),
            "stale": sum(r.stale for r in results), "entries_by_device": by_dev}


def info_dict(db_url: str | None) -> dict[str, Any]:
    """What ``autotune info`` reports, as a dict (no GPU needed)."""
    import platform
    from importlib import metadata

    import torch

    from flashtune import __version__
    from flashtune.db.exchange import shipped_results
    from flashtune.db.fingerprint import device_info, software_info
    from flashtune.db.storage import open_storage, resolve_url
    from flashtune.exceptions import DatabaseMissingError

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    dev, sw = device_info(), software_info()
    url = resolve_url(db_url)
    exists, results, misses = True, [], 0
    try:
        with open_storage(url, read_only=True) as st:
            results = st.results(software=sw)
            misses = sum(c for _, c, _ in st.misses())
    except DatabaseMissingError:
        exists = False
    user = _layer("user", _where(url), results)
    shipped = _layer("shipped", "flashtune/data/shipped.json", shipped_results(sw))
    return {
        "flashtune": __version__,
        "device": {**dev.as_dict(), "fingerprint": dev.fingerprint},
        "cuda_available": torch.cuda.is_available(),
        "interpreter": interpreting(),
        "software": {**sw.as_dict(), "fingerprint": sw.fingerprint},
        "versions": {"python": platform.python_version(), "flashtune": __version__,
                     "torch": sw.torch, "triton": sw.triton, "cuda": sw.cuda,
                     "optuna": version("optuna"), "sqlalchemy": version("sqlalchemy")},
        "database": {"url": _where(url), "path": _db_file(url), "exists": exists},
        "entries": user["entries"], "stale": user["stale"], "misses": misses,
        "layers": [user, shipped],
    }


@_command
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def info(db_url: str | None, as_json: bool) -> None:
    """Show the device fingerprint, versions, the database and its entry counts."""
    with _clean_errors():
        d = info_dict(db_url)
    if as_json:
        click.echo(json.dumps(d, indent=2, sort_keys=True))
        return
    dev, sw, db = d["device"], d["software"], d["database"]
    gpu = "" if d["cuda_available"] else "  (no CUDA GPU: kernels need --interpret)"
    click.echo(f"device     {dev['name']} (sm {dev['capability']}, {dev['sm_count']} SMs, "
               f"{dev['memory_gb']} GiB)  fingerprint {dev['fingerprint']}{gpu}")
    click.echo(f"software   fingerprint {sw['fingerprint']} (kernels {sw['kernels_hash'][:12]})")
    click.echo("versions   " + "  ".join(f"{k} {v}" for k, v in d["versions"].items()))
    state = "" if db["exists"] else "  (not created yet)"
    click.echo(f"database   {db['path'] or db['url']}{state}")
    click.echo(f"entries    {d['entries']} ({d['stale']} stale), {d['misses']} recorded misses")
    for layer in d["layers"]:
        per = ", ".join(f"{k}: {v}" for k, v in sorted(layer["entries_by_device"].items()))
        click.echo(f"layer      {layer['name']:<8} {layer['entries']:>5} entries "
                   f"({layer['stale']} stale)  {layer['source']}" + (f"  [{per}]" if per else ""))

