"""`autotune bench`: tuned, default, SDPA backends and FlexAttention over a shape set."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import click

from flashtune.cli._common import (
    FiniteRange,
    LeadMs,
    clean_errors,
    console,
    db_option,
    exit_when_stuck,
    fmt,
    json_stdout,
    kernel_mode,
    read_input,
    shape_label,
    shape_options,
    shape_set,
)

_IMPL_ORDER = ("tuned", "default", "cudnn", "fa2", "efficient", "flex")


class Part(click.ParamType):
    """``K/N``: the K-th (1-based) of N slices of a shape set (:meth:`select`)."""

    name = "K/N"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None,
                ) -> Any:
        if isinstance(value, tuple):
            return value
        k, sep, n = str(value).partition("/")
        if not (sep and k.strip().isdigit() and n.strip().isdigit()
                and 1 <= int(k) <= int(n) <= 1000):
            self.fail(f"{value!r} is not K/N with 1 <= K <= N <= 1000 (e.g. 1/2)", param, ctx)
        return int(k), int(n)

    @staticmethod
    def select(items: list[Any], k: int, n: int) -> list[Any]:
        """The K-th of N consecutive slices whose sizes differ by at most one (the first
        ones the larger); together they hold every item once, in order."""
        size, extra = divmod(len(items), n)
        start = (k - 1) * size + min(k - 1, extra)
        return items[start:start + size + (k <= extra)]


class ImplNames(click.ParamType):
    """``NAME[,NAME...]``: a subset of the bench's implementations, with ours (tuned or
    default) among them."""

    name = "NAME[,NAME...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None,
                ) -> Any:
        if isinstance(value, frozenset):
            return value
        names = [n.strip() for n in str(value).split(",") if n.strip()]
        unknown = [n for n in names if n not in _IMPL_ORDER]
        if not names or unknown:
            self.fail(f"{', '.join(unknown) or repr(value)}: not an implementation; choose "
                      f"from {', '.join(_IMPL_ORDER)}", param, ctx)
        if not {"tuned", "default"} & set(names):
            self.fail("name tuned or default too: the ratios are ours over the others",
                      param, ctx)
        return frozenset(names)


def _configs(p: Any, table: Any) -> tuple[tuple[Any, Any], dict[str, Any], dict[str, str]]:
    """(the heuristic default (fwd, bwd), {direction: tuned config}, {direction: where it
    came from}): "tuned" is what the dispatcher serves from its table for the problem's key,
    the user database over the shipped layer: that key's own entry (where: its layer), or,
    without one, the nearest entry that can serve it (where: ``"<layer> nearest <its
    key>"``), as a ``deterministic=False`` call is served its deterministic twin's entry.
    Only the heuristic default, where the table has neither, is not "tuned"."""
    from flashtune.kernels.config import default_bwd, default_fwd

    tuned: dict[str, Any] = {}
    layers: dict[str, str] = {}
    for d in ("fwd", "bwd"):
        choice = table.choose(p, d)
        if choice.source == "tuned":
            tuned[d], layers[d] = choice.config, choice.layer
        elif choice.source == "nearest":
            tuned[d] = choice.config
            layers[d] = f"{choice.layer} nearest {choice.entry.key.short()}"
    return (default_fwd(p), default_bwd(p)), tuned, layers


def _impls(p: Any, table: Any, interpreter: bool, only: frozenset[str] | None = None,
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """({name: attn(q, k, v)}, {"tuned": which directions were tuned, "layers": the layer
    each tuned config came from}); see :func:`_configs`. ``only``: just these names."""
    from flashtune.kernels.attention import flash_attention
    from flashtune.kernels.varlen import flash_attn_varlen_func
    from flashtune.timing import ANCHOR_NAMES, anchors, packed_layout

    layout = packed_layout(p, "cpu" if interpreter else "cuda")

    def ours(fwd: Any, bwd: Any) -> Any:
        kw = dict(causal=p.causal, window_size=p.window, softcap=p.softcap, config=(fwd, bwd),
                  deterministic=p.deterministic)
        if layout is not None:  # a packed problem: its representative packed batch
            return lambda q, k, v: flash_attn_varlen_func(q, k, v, *layout, **kw)
        return lambda q, k, v: flash_attention(q, k, v, **kw)

    dflt, tuned, layers = _configs(p, table)
    keep_tuned, keep_default = _ours(tuned, only)
    impls: dict[str, Any] = {}
    if keep_tuned:
        impls["tuned"] = ours(tuned.get("fwd", dflt[0]), tuned.get("bwd", dflt[1]))
    if keep_default:
        impls["default"] = ours(*dflt)
    if not interpreter:
        impls.update(anchors(p, tuple(only) if only is not None else ANCHOR_NAMES))
    return impls, {"tuned": sorted(tuned), "layers": layers}


def _ours(tuned: dict[str, Any], only: frozenset[str] | None) -> tuple[bool, bool]:
    """Whether a shape's bench runs the tuned and the default implementation: both by
    default (tuned where something is tuned); with ``only``, those it names, and the
    default in place of tuned on a shape with nothing tuned (ratios are ours over the
    others)."""
    keep_tuned = bool(tuned) and (only is None or "tuned" in only)
    keep_default = only is None or "default" in only or not keep_tuned
    return keep_tuned, keep_default


def compile_jobs(problems: list[Any], table: Any, only: frozenset[str] | None = None,
                 ) -> list[tuple[Any, str, dict[str, Any]]]:
    """Every flashtune kernel build the bench will ask for, in the order it will: (problem,
    direction, config as a dict) for the tuned and the default config of each shape (those
    of the two that ``only`` names), each build once."""
    from flashtune.kernels.config import config_to_dict

    jobs: list[tuple[Any, str, dict[str, Any]]] = []
    seen: set[tuple[Any, ...]] = set()
    for p in problems:
        dflt, tuned, _ = _configs(p, table)
        keep_tuned, keep_default = _ours(tuned, only)
        for i, d in enumerate(("fwd", "bwd")):
            # the tuned implementation runs the default in a direction that is not tuned
            for cfg in (tuned.get(d, dflt[i]) if keep_tuned else None,
                        dflt[i] if keep_default else None):
                if cfg is None:
                    continue
                as_dict = config_to_dict(cfg)
                key = (p, d, json.dumps(as_dict, sort_keys=True))
                if key not in seen:
                    seen.add(key)
                    jobs.append((p, d, as_dict))
    return jobs


def _precompile(problems: list[Any], table: Any, progress: Callable[[str], None],
                only: frozenset[str] | None = None) -> None:
    """Build every shape's flashtune kernels on a pool of compile processes before any
    timing (:mod:`flashtune.autotune._compile`: compile only, into Triton's on-disk cache,
    where the timed calls then load them). On a cold cache, compiling one shape after
    another left the GPU idle for most of a bench. The GPU idles here too, but once, and
    no compile competes with a timing for the host's cores. A build that fails here is
    left for the timed call, which reports it."""
    import os
    from concurrent.futures import FIRST_COMPLETED, wait

    from flashtune.autotune._compile import CompilePool
    from flashtune.autotune.sweep import check_interrupted

    jobs = compile_jobs(problems, table, only)
    if not jobs:
        return
    n = max(1, min(14, (os.cpu_count() or 2) - 2, len(jobs)))
    progress(f"compiling {len(jobs)} kernel configs on {n} processes")
    t0 = time.perf_counter()
    pool = CompilePool(n)
    try:
        left = {pool.submit(p.as_dict(), d, cfg) for p, d, cfg in jobs}
        while left:
            _, left = wait(left, timeout=1.0, return_when=FIRST_COMPLETED)
            check_interrupted()  # an interrupt lost in a callback still stops here
    finally:
        pool.close()
    progress(f"compiled in {time.perf_counter() - t0:.0f} s")


def flex_jobs(problems: list[Any], only: frozenset[str] | None = None) -> list[Any]:
    """The shapes whose FlexAttention calls ``--warm-flex`` compiles ahead: each distinct
    shape that the anchors can run, when Flex is among the implementations."""
    from flashtune.timing import anchors_apply

    if only is not None and "flex" not in only:
        return []
    out: list[Any] = []
    for p in problems:
        if anchors_apply(p) and p not in out:
            out.append(p)
    return out


def _warm_flex(problems: list[Any], only: frozenset[str] | None,
               progress: Callable[[str], None], timeout_s: float = 600.0) -> None:
    """Compile every shape's FlexAttention calls in a pool of processes before any timing
    (:func:`flashtune.timing.warm_flex`), so that the bench's own first calls load them from
    the on-disk caches. The pool is terminated when it is done, cut by ``timeout_s`` or
    interrupted: nothing of it runs while the bench times. A shape it could not compile is
    left to the timed call, which compiles (or reports) it."""
    import multiprocessing
    import os

    from flashtune.autotune.sweep import check_interrupted
    from flashtune.timing import warm_flex

    jobs = flex_jobs(problems, only)
    if not jobs:
        return
    n = max(1, min(8, (os.cpu_count() or 2) - 2, len(jobs)))
    progress(f"compiling FlexAttention for {len(jobs)} shapes on {n} processes")
    t0 = time.perf_counter()
    pool = multiprocessing.get_context("spawn").Pool(n)
    try:
        res = pool.map_async(warm_flex, [p.as_dict() for p in jobs], chunksize=1)
        while not res.ready():
            res.wait(1.0)
            check_interrupted()  # an interrupt lost in a callback still stops here
            if time.perf_counter() - t0 > timeout_s:
                progress(f"FlexAttention warm-up cut after {timeout_s:.0f} s; the timed "
                         "calls compile what it did not")
                return
        failed = [e for _, e in res.get() if e]
    finally:
        pool.terminate()
        pool.join()
    progress(f"FlexAttention compiled in {time.perf_counter() - t0:.0f} s"
             + (f" ({len(failed)} shapes failed: {failed[0]})" if failed else ""))


def _bench_rows(problems: list[Any], table: Any, interpreter: bool, rep_ms: float,
                progress: Callable[[str], None], rows: list[dict[str, Any]],
                errors: list[str], interleave: bool = False, clocks: Any = None,
                only: frozenset[str] | None = None, warmup_ms: float = 25.0,
                lead_ms: float | str = 0.0) -> bool:
    """Append each shape's three rows to ``rows`` (and what could not run to ``errors``);
    True when interrupted. A SIGINT or SIGTERM (under
    :func:`~flashtune.autotune.sweep.interrupt_on_sigterm`) stops the run between two
    timings: the shapes measured whole are kept, the one in hand is dropped.

    With a :class:`~flashtune.gpu_clocks.ClockSampler` (``clocks``), each row also says
    at what GPU clocks it was timed: ``"clocks"`` maps "all" (side by side: one loop for
    every implementation) or each implementation's name (in turn) to the summary of the
    samples read during that timing (for the backward row: the forward+backward's).

    Every row gives its shape's wall time (``shape_wall_s``: first calls and timings), and
    side by side each implementation's first calls (``first_calls_s``: its compiles, plan
    builds and cache loads), which is where a bench on cold caches spends its time.

    Where the OS reports it, ``host_load`` is the host's 1-minute load average at the
    shape's start and end: calls whose time includes Python launches (ours, Flex) slow
    down when other processes crowd the CPUs, and cuDNN's less, so a row timed on a
    crowded host misstates the ratios (BENCHMARKS.md, issue 13, session 62: two short
    rows at 0.47x and 0.62x while another process compiled on 14 processes).

    Side by side on a GPU, each row also gives ``host``: the implementations' host time
    to issue one call ("issue_ms", read while the GPU is busy), the GPU wait put before
    each timed launch ("lead_ms", see :func:`~flashtune.timing.time_interleaved`) and
    "host_bound", those whose reading was mostly host time (session 65: 0.53-0.67x rows
    of a host that took 1 ms to issue a training step). ``lead_ms`` is that wait: 0 (the
    protocol as it stood), a number of ms, or "auto"."""
    from flashtune.autotune.sweep import check_interrupted

    dev = "cpu" if interpreter else "cuda"
    for i, p in enumerate(problems):
        progress(f"[{i + 1}/{len(problems)}] {shape_label(p)}")
        load_start = host_load()
        start = time.perf_counter()
        try:
            timings, info = _time_shape(p, table, interpreter, dev, rep_ms, errors,
                                        interleave, clocks, only, warmup_ms, lead_ms)
            check_interrupted()  # an interrupt lost in a callback still stops here
        except KeyboardInterrupt:
            return True
        wall = time.perf_counter() - start
        load_end = host_load()
        shape_rows = []
        for kind in ("fwd", "bwd", "infer"):
            flops = p.flops("bwd" if kind == "bwd" else "fwd")
            tf = {n: t[kind].tflops(flops) for n, t in timings.items()}
            ms = {n: t[kind].median_ms for n, t in timings.items()}
            row = {"problem": p.as_dict(), "shape": shape_label(p), "timing": kind,
                   "tflops": tf, "ms": ms, "ratios": _ratios(tf),
                   "tuned_directions": info["tuned"], "tuned_layers": info["layers"],
                   "shape_wall_s": round(wall, 2)}
            if load_start is not None and load_end is not None:
                row["host_load"] = [round(load_start, 2), round(load_end, 2)]
            if info["first_calls_s"]:
                row["first_calls_s"] = {n: round(t, 3)
                                        for n, t in info["first_calls_s"].items()}
            run = "fwd_bwd" if kind == "bwd" else kind
            if run in info["host"]:
                row["host"] = info["host"][run]
            if clocks is not None:
                row["clocks"] = {n: log.get(run) for n, log in info["clocks"].items()
                                 if n == "all" or n in timings}
            shape_rows.append(row)
        rows += shape_rows  # one step: a report from another thread sees whole shapes
    return False


def host_load() -> float | None:
    """The host's 1-minute load average (runnable and waiting threads), None where the OS
    has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def host_cpus() -> int | None:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def _time_shape(p: Any, table: Any, interpreter: bool, dev: str, rep_ms: float,
                errors: list[str], interleave: bool = False, clocks: Any = None,
                only: frozenset[str] | None = None, warmup_ms: float = 25.0,
                lead_ms: float | str = 0.0,
                ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every implementation's three timings of ``p`` (``interleave``: side by side, see
    :func:`~flashtune.timing.three_timings_interleaved`; else one after another); one that
    cannot run it is left out, with its reason in ``errors``. ``info["clocks"]``: the
    clock logs of the timings (see :func:`_bench_rows`)."""
    from flashtune.autotune.sweep import check_interrupted
    from flashtune.timing import error_text, three_timings, three_timings_interleaved

    impls, info = _impls(p, table, interpreter, only)
    timings: dict[str, dict[str, Any]] = {}
    logs: dict[str, dict[str, Any]] = {}
    info["clocks"] = logs
    info["first_calls_s"] = {}
    info["host"] = {}
    with warnings.catch_warnings():
        # SDPA explains at length why a forced backend cannot run a shape; the error
        # below says it in one line.
        warnings.simplefilter("ignore", UserWarning)
        if interleave:
            failed: dict[str, str] = {}
            try:
                timings = three_timings_interleaved(impls, p, dev, warmup_ms=warmup_ms,
                                                    rep_ms=rep_ms,
                                                    errors=failed, clocks=clocks,
                                                    clock_log=logs.setdefault("all", {}),
                                                    first_calls=info["first_calls_s"],
                                                    lead_ms=lead_ms,
                                                    host_log=info["host"] if dev == "cuda"
                                                    else None)
            except Exception as e:  # past every one's first calls: the shape is lost
                failed[", ".join(impls)] = error_text(e)
            errors += [f"{shape_label(p)}: {name}: {e}" for name, e in failed.items()]
            return timings, info
        for name, fn in impls.items():
            check_interrupted()
            try:
                timings[name] = three_timings(fn, p, dev, warmup_ms=warmup_ms, rep_ms=rep_ms,
                                              clocks=clocks,
                                              clock_log=logs.setdefault(name, {}))
            except Exception as e:  # an anchor that cannot run this shape is left out
                errors.append(f"{shape_label(p)}: {name}: {error_text(e)}")
    return timings, info


def _ratios(tf: dict[str, float]) -> dict[str, float]:
    """Ours against the others: tuned (or default when untuned) over each other impl."""
    ours = "tuned" if "tuned" in tf else "default"
    return {f"{ours}/{n}": tf[ours] / v for n, v in tf.items() if n != ours and v > 0}


@click.command("bench")
@shape_options
@click.option("--rep-ms", type=FiniteRange(min=1, max=60_000), default=100.0, show_default=True,
              help="do_bench repetition time per measurement.")
@click.option("--warmup-ms", type=FiniteRange(min=0, max=60_000), default=25.0,
              show_default=True,
              help="Warm-up launches before each measurement (do_bench's warmup). A long "
                   "one (1000) times every implementation at its sustained clocks, after "
                   "the GPU has met its power limit.")
@click.option("--interpret", is_flag=True,
              help="Run Triton's CPU interpreter (tests and demos; not GPU timings).")
@click.option("--interleave/--in-turn", default=True, show_default=True,
              help="Time the implementations side by side, launch by launch, so that all "
                   "meet the same GPU clocks; or one after another, each with do_bench "
                   "(how benches were timed before the side-by-side order).")
@click.option("--lead-ms", type=LeadMs(), default=0.0, show_default=True,
              help="Side by side on a GPU: a GPU wait (ms, or 'auto': 1.5x the largest "
                   "host issue time of the row's launches, at most 20) before each timed "
                   "launch, so that the host has issued it before the GPU reaches it and "
                   "the events time its kernels, not its Python. 0: the protocol as it "
                   "stood, where a launch that needs more host time than GPU time reads "
                   "its host time (rows give 'host_bound').")
@click.option("--part", type=Part(), default=None, metavar="K/N",
              help="Only the K-th of N equal consecutive slices of the shape set, to split "
                   "a bench across jobs with time limits (merge the --json outputs with "
                   "benchmarks/merge_bench.py).")
@click.option("--precompile/--no-precompile", default=True, show_default=True,
              help="On a GPU, build every shape's flashtune kernels in parallel processes "
                   "before timing, rather than each at its shape's first call.")
@click.option("--warm-flex/--no-warm-flex", default=False, show_default=True,
              help="On a GPU, compile every shape's FlexAttention calls in parallel "
                   "processes before timing, into the on-disk caches the timed calls then "
                   "load (not yet measured to pay on a GPU).")
@click.option("--impls", type=ImplNames(), default=None,
              help="Only these implementations (comma-separated; default: all of "
                   f"{', '.join(_IMPL_ORDER)}, where they run), ours among them. Side by "
                   "side, the others in the loop share its clocks: slow, low-power ones "
                   "such as efficient likely let them rise.")
@click.option("--clocks/--no-clocks", default=True, show_default=True,
              help="On a GPU, sample its SM clock, power and clock-limit reasons during each "
                   "timing (NVML) and give them in the --json rows.")
@click.option("--skip-measured", "skip_docs", multiple=True, metavar="FILE",
              help="Leave out the shapes that this `bench --json` document (of this device) "
                   "measured; repeatable. Finishes a bench that a time limit cut: merge the "
                   "documents with benchmarks/merge_bench.py.")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def bench(preset: str | None, shapes: str | None, from_misses: bool, rep_ms: float,
          warmup_ms: float, interpret: bool, interleave: bool, lead_ms: float | str,
          part: tuple[int, int] | None,
          precompile: bool, warm_flex: bool, impls: frozenset[str] | None, clocks: bool,
          skip_docs: tuple[str, ...], db_url: str | None, as_json: bool) -> None:
    """Compare tuned, default, the SDPA backends and FlexAttention over a shape set.

    TFLOP/s by the house protocol: training forward, backward ((fwd+bwd) - fwd) and
    inference forward, all timed in this process, side by side (every implementation in
    one loop per timing; --in-turn: one after another); ratios are ours over each other.
    On a GPU, --json rows also give the SM clocks and power each timing ran at (NVML).
    Interrupted (Ctrl-C, SIGTERM), it reports the shapes measured so far, marked as
    interrupted, and exits with 130 / 143; also when the signal finds it waiting on a hung
    kernel (after $FLASHTUNE_SIGNAL_GRACE seconds, default 20).
    """
    interpreter = kernel_mode("bench", interpret)
    if lead_ms != 0 and not interleave:
        raise click.UsageError("--lead-ms times side by side only; leave out --in-turn")
    _, problems = shape_set(preset, shapes, from_misses, db_url)
    skipped = 0
    if skip_docs:
        from flashtune.db.fingerprint import device_info

        problems, skipped = skip_measured(problems, skip_docs, device_info().name, interpreter)
        if not problems:
            raise click.UsageError(f"--skip-measured: the documents measured all {skipped} "
                                   "shapes of the set; nothing is left to bench")
    if part is not None:
        total = len(problems)
        problems = Part.select(problems, *part)
        if not problems:
            raise click.UsageError(f"--part {part[0]}/{part[1]}: the shape set has only "
                                   f"{total} shapes, so this part is empty")
    from flashtune._env import database_url
    from flashtune.autotune.sweep import interrupt_on_sigterm, interrupted_status
    from flashtune.db.fingerprint import device_info, software_info
    from flashtune.dispatch._table import load_table

    with clean_errors(), json_stdout(as_json) as emit:
        # Read up front: a report made while the GPU hangs (exit_when_stuck) asks it nothing.
        meta = {"device": device_info().as_dict(), "software": software_info().as_dict(),
                "interpreter": interpreter,
                "order": "interleaved" if interleave else "in turn",
                "warmup_ms": warmup_ms, "rep_ms": rep_ms, "lead_ms": lead_ms,
                "host_cpus": host_cpus(),
                **({"impls": sorted(impls, key=_IMPL_ORDER.index)} if impls else {}),
                **({"part": f"{part[0]}/{part[1]}"} if part else {})}
        with warnings.catch_warnings():  # the dispatcher's warning is for training runs
            warnings.simplefilter("ignore", RuntimeWarning)
            # --db, else $FLASHTUNE_DB, else the default place; missing: nothing tuned yet
            table = load_table(device_info(), db_url or database_url())
        if table.error is not None:
            raise click.ClickException(f"cannot use the tuning database: {table.error}")
        rows: list[dict[str, Any]] = []
        errors: list[str] = []
        sampler = None
        if not interpreter and not clocks:
            meta["clocks"] = "not sampled: --no-clocks"
        elif not interpreter:
            import torch

            from flashtune.gpu_clocks import ClockSampler

            sampler = ClockSampler.for_cuda_device(torch.cuda.current_device())
            meta["clocks"] = ("sampled with NVML every 20 ms" if sampler.available
                              else f"not sampled: {sampler.reason}")
            if not sampler.available:
                sampler = None

        def stuck(signum: int) -> int:  # the main thread never answered the signal
            try:
                _report(list(rows), list(errors), len(problems), meta, as_json,
                        interrupted=True, emit=emit, skipped=skipped)
            except click.ClickException as e:
                e.show()
            return 128 + signum

        # Progress goes to stderr with --json too (stdout stays one JSON document): a run
        # cut by a time limit then says which shape it was timing.
        restore = interrupt_on_sigterm()
        try:
            def say(message: str) -> None:
                click.echo(message, err=True)

            with exit_when_stuck(stuck):
                try:
                    if precompile and not interpreter:
                        _precompile(problems, table, say, impls)
                    if warm_flex and not interpreter:
                        _warm_flex(problems, impls, say)
                    with sampler or contextlib.nullcontext():
                        interrupted = _bench_rows(problems, table, interpreter, rep_ms,
                                                  say, rows, errors, interleave, sampler,
                                                  impls, warmup_ms, lead_ms)
                    if sampler is not None and sampler.error:
                        meta["clocks"] = f"{meta['clocks']}; sampling stopped: {sampler.error}"
                except KeyboardInterrupt:  # during the compiles: nothing measured
                    interrupted = True
        finally:
            restore()
        done = _report(rows, errors, len(problems), meta, as_json, interrupted, emit,
                       skipped)
    if not done:
        sys.exit(interrupted_status())


def _report(rows: list[dict[str, Any]], errors: list[str], total: int, meta: dict[str, Any],
            as_json: bool, interrupted: bool,
            emit: Callable[[str], None] = click.echo, skipped: int = 0) -> bool:
    """Print the rows (a table, or one JSON document with ``as_json``, through ``emit``:
    see :func:`json_stdout`; it holds ``meta``: device, software, interpreter), the
    geomeans and the errors; False when interrupted (the command then exits with the
    signal's status). A ClickException when nothing at all was measured. ``total`` counts
    the shapes this run set out to measure, ``skipped`` those --skip-measured left out."""
    done = len(rows) // 3  # three timings (rows) per shape measured
    if interrupted:
        click.echo(f"interrupted: {done} of {total} shapes measured; the results "
                   f"below are theirs", err=True)
        if not rows:
            return False
    if not any(row["tflops"] for row in rows):
        for e in errors[:20]:
            click.echo(f"failed {e}", err=True)
        raise click.ClickException("every implementation failed on every shape: nothing "
                                   "was measured")
    summary = geomean_ratios(rows)
    if as_json:
        import datetime

        emit(json.dumps({
            **meta,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rows": rows, "geomean_ratios": summary, "errors": errors,
            "shapes": {"measured": done, "total": total,
                       **({"skipped": skipped} if skipped else {})},
            "interrupted": interrupted},
            indent=2, sort_keys=True, default=str))
    else:
        console().print(_bench_table(rows, meta["interpreter"]))
        for kind, r in summary.items():
            shown = "  ".join(f"{n} {v:.2f}x" for n, v in r.items() if v == v)
            if shown:
                click.echo(f"geomean {kind}: {shown}")
        bound = [f"{r['shape']} {r['timing']}: {', '.join(r['host']['host_bound'])}"
                 for r in rows if r.get("host", {}).get("host_bound")]
        if bound:
            click.echo("host-bound (the reading is mostly the host's time to issue the "
                       "call; --lead-ms auto times the kernels): " + "; ".join(bound))
        for e in errors:
            click.echo(f"skipped {e}", err=True)
    return not interrupted


def skip_measured(problems: list[Any], paths: tuple[str, ...], device: str,
                  interpreter: bool) -> tuple[list[Any], int]:
    """``problems`` less those measured (whole: a document holds a shape's three rows or
    none) in the ``bench --json`` documents at ``paths``, and how many were left out. A
    document that is not a bench's, or was measured on another device (or the other side
    of the interpreter), is a BadParameter: a bench is of one device."""
    from flashtune.cli.report import validate_bench
    from flashtune.problem import Problem

    hint = "'--skip-measured'"
    done: set[Any] = set()
    for path in paths:
        try:
            doc = validate_bench(json.loads(read_input(path, "a bench document")))
            measured = {Problem.from_dict(r["problem"]) for r in doc["rows"]
                        if r["timing"] == "fwd"}
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise click.BadParameter(f"{path}: not an `autotune bench --json` document "
                                     f"({str(e)[:200]})", param_hint=hint) from None
        name = (doc.get("device") or {}).get("name")
        if name != device:
            raise click.BadParameter(f"{path} was measured on {name}, this bench runs on "
                                     f"{device}; one bench is of one device", param_hint=hint)
        if bool(doc.get("interpreter")) != interpreter:
            how = {True: "under", False: "without"}
            raise click.BadParameter(
                f"{path} was measured {how[not interpreter]} Triton's interpreter, this bench "
                f"runs {how[interpreter]} it", param_hint=hint)
        done |= measured
    kept = [p for p in problems if p not in done]
    return kept, len(problems) - len(kept)


def geomean_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{timing: {ratio name: geometric mean over the rows of that timing}}."""
    from flashtune.timing import geomean

    names = sorted({r for row in rows for r in row["ratios"]})
    return {kind: {n: geomean([row["ratios"][n] for row in rows
                               if row["timing"] == kind and n in row["ratios"]])
                   for n in names} for kind in ("fwd", "bwd", "infer")}


def merge_parts(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One bench document from the ``--json`` documents of ``--part 1/N`` .. ``N/N`` (or
    any benches of one device, software and order): rows and errors in order, the
    geomeans recomputed over all rows. ValueError when they cannot be one bench."""
    if not docs:
        raise ValueError("nothing to merge")
    first = docs[0]
    for field in ("device", "software", "interpreter", "order", "impls", "warmup_ms",
                  "rep_ms", "lead_ms"):
        # A bench from before --lead-ms timed with none: 0.
        values = {json.dumps(d.get(field, 0.0 if field == "lead_ms" else None),
                             sort_keys=True) for d in docs}
        if len(values) > 1:
            raise ValueError(f"the parts differ in {field}: {sorted(values)}; one bench "
                             "is measured on one device and software, in one protocol")
    rows = [row for d in docs for row in d["rows"]]
    shapes = [row["shape"] for row in rows if row["timing"] == "fwd"]
    twice = sorted({s for s in shapes if shapes.count(s) > 1})
    if twice:
        raise ValueError(f"shapes measured in more than one part: {twice}")
    measured = sum(d["shapes"]["measured"] for d in docs)
    # A run with --skip-measured set out to measure the shapes the others did not (its
    # "skipped"): the union counts each shape once.
    total = max(measured, sum(d["shapes"]["total"] - d["shapes"].get("skipped", 0)
                              for d in docs))
    return {**{k: first[k] for k in ("device", "software", "interpreter", "order", "impls",
                                     "warmup_ms", "rep_ms", "lead_ms", "clocks", "host_cpus")
               if k in first},
            "date": max(d["date"] for d in docs), "rows": rows,
            "geomean_ratios": geomean_ratios(rows),
            "errors": [e for d in docs for e in d.get("errors", [])],
            "shapes": {"measured": measured, "total": total},
            # Cut parts that a --skip-measured run finished make a whole bench.
            "interrupted": measured < total,
            "parts": [d.get("part") for d in docs]}



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
        table.add_row(r["shape"], r["timing"], *[fmt(r["tflops"].get(n), ".3g") for n in impls],
                      *[fmt(r["ratios"].get(n), ".2f") for n in ratios])
    return table
