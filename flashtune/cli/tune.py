"""`autotune` commands: tune family.

``autotune tune`` tunes one problem (forward, backward or both) and writes the
winners to the tuning database. Progress goes to stderr, one line per trial; the
summary (or ``--json``) goes to stdout. Re-running the same command resumes the
stored study.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import click

from flashtune.cli._common import (
    SECONDS,
    SEED,
    SIZE,
    TRIALS,
    FiniteRange,
    clean_errors,
    db_option,
    json_stdout,
    search_options,
    where,
)

WINDOW_BOUND = click.IntRange(min=-1)


def _head_dim(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if value % 8:
        raise click.BadParameter(f"{value} is not a multiple of 8 (allowed: 16, 24, ... 256).")
    return value


def _progress(ev: dict[str, Any]) -> None:
    kind = ev.get("event")
    if kind == "trial":
        val = ev.get("value_ms")
        shown = f"{val:.4g} ms" if isinstance(val, float) and math.isfinite(val) else "-"
        best = ev["best_ms"]
        best_s = f"{best:.4g} ms" if math.isfinite(best) else "-"
        detail = f"  {ev['detail'][:120]}" if ev.get("status") != "ok" else ""
        click.echo(f"[{ev['direction']}] trial {ev['number']:>4} {ev['status']:<7} {shown:>12} "
                   f"best {best_s:>12}  {ev['measured']}/{ev['budget'] or '-'}  "
                   f"{ev['elapsed_s']:.0f}s{detail}", err=True)
    elif kind == "retime":
        click.echo(f"[{ev['direction']}] re-timing the top {len(ev['configs'])}", err=True)


@click.command("tune")
@click.option("--interpret", is_flag=True,
              help="Run under Triton's CPU interpreter (for tests; timings are not GPU timings).")
@db_option
@click.option("--batch", type=SIZE, required=True)
@click.option("--heads", type=SIZE, required=True, help="Query heads.")
@click.option("--kv-heads", type=SIZE, default=None, help="Key/value heads (default: --heads).")
@click.option("--seqlen", type=SIZE, required=True, help="Query length.")
@click.option("--seqlen-k", type=SIZE, default=None, help="Key length (default: --seqlen).")
@click.option("--head-dim", type=click.IntRange(16, 256), required=True, callback=_head_dim,
              help="A multiple of 8 from 16 to 256.")
@click.option("--dtype", type=click.Choice(["fp16", "bf16"]), default="bf16", show_default=True)
@click.option("--causal", is_flag=True)
@click.option("--window", type=(WINDOW_BOUND, WINDOW_BOUND), default=(-1, -1),
              metavar="LEFT RIGHT", help="Sliding window (-1 = unbounded).")
@click.option("--softcap", type=FiniteRange(min=0), default=0.0,
              help="Soft-capping of the scores (0 = off).")
@click.option("--deterministic/--no-deterministic", default=True, show_default=True,
              help="The backward's kind: --no-deterministic also tunes backward variants whose "
                   "dQ accumulation order is not fixed (stored under their own key).")
@click.option("--tokens", type=SIZE, default=None,
              help="A packed (varlen) batch of this many tokens: --batch sequences of at most "
                   "--seqlen tokens each (default: a dense batch).")
@search_options("Candidates to measure per direction (a resumed study's count included).",
                "Seconds per direction.")
@click.option("--patience", type=TRIALS, default=None,
              help="Stop after this many trials without improvement.")
@click.option("--trial-timeout", type=SECONDS, default=None,
              metavar="S", help="Seconds one candidate may take before its worker is killed.")
@click.option("--compile-workers", type=click.IntRange(min=0, max=1024), default=None,
              help="Processes compiling upcoming candidates (GPU only).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--quiet", is_flag=True, help="No per-trial progress on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def tune_cmd(interpret: bool, db_url: str | None, batch: int, heads: int, kv_heads: int | None,
             seqlen: int, seqlen_k: int | None, head_dim: int, dtype: str, causal: bool,
             window: tuple[int, int], softcap: float, deterministic: bool, tokens: int | None,
             direction: str, trials: int | None,
             time_budget: float | None, patience: int | None, trial_timeout: float | None,
             compile_workers: int | None, seed: int, quiet: bool, as_json: bool) -> None:
    """Tune one attention problem and store the fastest correct config(s)."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    from flashtune.autotune import tune
    from flashtune.kernels.config import config_to_dict
    from flashtune.problem import Problem

    if tokens is not None and not seqlen <= tokens <= batch * seqlen:
        raise click.BadParameter(f"{tokens} is not from --seqlen {seqlen} to --batch * --seqlen "
                                 f"{batch * seqlen}", param_hint="'--tokens'")
    if heads % (kv_heads or heads):
        raise click.UsageError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads} "
                               "(grouped-query attention)")
    try:
        problem = Problem(batch=batch, heads_q=heads, heads_kv=kv_heads or heads,
                          seqlen_q=seqlen, seqlen_k=seqlen_k or seqlen, head_dim=head_dim,
                          dtype=dtype, causal=causal, window=window, softcap=softcap,
                          deterministic=deterministic,
                          total_q=tokens or 0, total_k=tokens or 0)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    with clean_errors(), json_stdout(as_json) as emit:
        res = tune(problem, direction, trials=trials, time_budget=time_budget,
                   storage=db_url, interpret=interpret or None, patience=patience,
                   trial_timeout=trial_timeout, compile_workers=compile_workers, seed=seed,
                   progress=None if quiet else _progress)
        results = res if isinstance(res, dict) else {direction: res}
        if as_json:
            # The storage URL is shown without its password, here as everywhere.
            emit(json.dumps({d: r.as_dict() | {"storage_url": where(r.storage_url)}
                             for d, r in results.items()}, indent=2, sort_keys=True,
                            default=str))
            return
    for d, r in results.items():
        label = " (interpreter timings)" if r.interpreter else ""
        dflt = (f", {r.speedup_over_default:.2f}x over the default"
                if r.default_ms else "")
        click.echo(f"{d}: {r.key.short()} on {r.device}{label}")
        click.echo(f"  config   {json.dumps(config_to_dict(r.config), sort_keys=True)}")
        click.echo(f"  time     {r.median_ms:.4g} ms (p20 {r.p20_ms:.4g}, p80 {r.p80_ms:.4g}), "
                   f"{r.tflops:.3g} TFLOP/s{dflt}")
        if r.retime_clocks:
            mhz = r.retime_clocks["sm_mhz"]
            click.echo(f"  clock    {mhz['median']:g} MHz median ({mhz['min']:g}-{mhz['max']:g}) "
                       f"while the finalists were re-timed")
        if r.anchored:
            beside = ", ".join(f"{n} {ms:.4g} ms" for n, ms in r.anchored["ms"].items()
                               if n != "winner")
            clk = r.anchored.get("clocks")
            at = f" at {clk['sm_mhz']['median']:g} MHz" if clk else ""
            # For the backward the anchors run forward and backward, the default (like the
            # winner) its backward alone: the anchors' times are not backward times.
            whose = ("; SDPA's times are forward and backward"
                     if d == "bwd" and set(r.anchored["ms"]) - {"winner", "default"} else "")
            click.echo(f"  beside   {beside or 'nothing else'}{at} (the time above was "
                       f"taken in that loop){whose}")
        click.echo(f"  trials   {r.trials} measured ({r.complete} ok, {r.failed} failed, "
                   f"{r.pruned} pruned), {r.infeasible} infeasible; stopped: {r.stop_reason}; "
                   f"{r.search_seconds:.1f} s")
        click.echo(f"  stored   {'yes' if r.stored else 'no (a faster result was kept)'} in "
                   f"{where(r.storage_url)}; study {r.study_name}")

