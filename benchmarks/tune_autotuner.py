"""Autotuner benchmarks (issue 4): search quality, parallel compilation, tuned vs default.

    python benchmarks/tune_autotuner.py parallel   --out DIR [--workers 14]
    python benchmarks/tune_autotuner.py quality    --out DIR [--directions fwd,bwd]
    python benchmarks/tune_autotuner.py vs-default --out DIR [--trials 40 | --time-budget S]
    python benchmarks/tune_autotuner.py cost       --out DIR [--trials 12 | --time-budget S]
    python benchmarks/tune_autotuner.py budget     --out DIR --time-budget S [--factor 5]

- parallel: the same seeded TPE search (trials fixed) with N compile workers and with 1,
  each on an empty Triton cache; wall time per trial and the compile share.
- quality: six standard-matrix problems; an exhaustive search of a stated sub-grid,
  then the tuner's own search (TPE, its default trial timing) with a budget of 20% of
  the sub-grid's feasible points, rounded down. ``--grid conditional`` (the default)
  spans the kernel variants (portable and Hopper, each with its own knobs: the
  conditional space); ``--grid portable`` is the earlier portable-only sub-grid. The
  exhaustive search compiles every feasible point in the compile pool first, then has
  the measurement worker gate and time each one in full (``TIMING``, no early stop),
  then re-times its fastest points side by side (3 rounds) to pick its winner. (Through
  the tuner's grid sampler, one problem's 153 points took 195 s on the H100, 12% of it
  compiling on the search's path.) "gap" is the tuner's winner over the exhaustive one: zero
  when both are the same config, else from re-timing both side by side (9 rounds' worth,
  their launches interleaved); "sweep" is the same ratio read off the exhaustive timings.
- vs-default: every standard-matrix shape, forward and backward: a tune with a trial
  or time budget, then the winner and the heuristic default re-timed interleaved.
- cost: where a trial's wall time goes, with the tuner's own timing settings, one
  shared session (as a sweep has) and a cold Triton cache: per trial, the wait for the
  compile pool, the first launch, the gate (and the reference in it), the timing and
  the confirmation of a new incumbent; the rest of a trial's cycle (Optuna, process
  traffic) as the difference to the search time per trial. Runs on older trees too
  (a field they do not record shows as nan), for a before/after in one process.
- budget: eight standard-matrix shapes (COST_PROBLEMS and more), forward and backward,
  in one warmed session (as a sweep's): a tune with --time-budget S and one with --factor
  times S, then both winners
  re-timed side by side (9 rounds' worth, interleaved); "gap" is the short search's winner
  over the long one's. Each search's measured trials are kept (``*_trials_log``), for
  replaying on a CPU where the short search went, and the seconds of the worker's
  setup of the problem (``*_prepare``: the backward's forward, the gate case). Before a
  backward row, the problem's default forward (the one the backward's gate runs) is
  compiled, as a sweep's forward task of that shape compiles it before the backward's:
  otherwise the short search, run first, paid that compile (1.4-4.3 s of 12 on the H200)
  and the long one found it cached (``warm_forward_s`` in the row).
  ``--against FILE`` (repeatable) runs only the short searches and judges each against
  the winners earlier budget files stored for its problem, re-timed in this run;
  ``--against-shipped`` judges them against the shipped layer's config for the problem's
  key on this GPU (alone, or pooled with ``--against``). ``--problem LABEL`` (repeatable,
  e.g. ``'B8 H32 S2048 D64 causal'``) replaces the eight problems.

Every run uses an in-memory tuning database (nothing is stored on the host), without
the shipped layer's seeds (each search starts from the default, as on a new GPU), and
writes a JSON file with the GPU name, versions and date under --out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flashtune.autotune import SearchSpace, TuneSession, tune
from flashtune.kernels.config import config_to_dict, default_config
from flashtune.problem import Problem
from flashtune.timing import geomean, standard_matrix

# Search-timing protocol for every trial (do_bench median, L2 flushed); the final
# re-timing uses the house defaults (25 ms warmup, 100 ms of repetitions) x rounds, the
# candidates' launches interleaved (flashtune.autotune.measure.retime).
# Sub-grids: the fields named vary; every other knob stays at its config default.
TIMING = {"warmup_ms": 10, "rep_ms": 40}
# The searches measured here start from the default, without the shipped layer's winners
# (a tree older than that keyword has no such seeds).
NO_SHIPPED: dict[str, Any] = (
    {"shipped_seeds": False} if "shipped_seeds" in inspect.signature(tune).parameters else {})
FWD_GRID = dict(block_m=(32, 64, 128, 256), block_n=(16, 32, 64, 128), num_warps=(4, 8),
                num_stages=(1, 2, 3, 4, 5), maxnreg=0)
BWD_GRID = dict(dkdv_block_m=(16, 32, 64), dkdv_block_n=(32, 64, 128), dkdv_warps=(4, 8),
                dkdv_stages=2, dq_block_m=(64, 128), dq_block_n=(16, 32, 64),
                dq_warps=(4, 8), dq_stages=2, pre_block_m=64, maxnreg=0)
# The conditional space: both kernel families and their own knobs. A knob a variant does
# not use stays at its default for that variant, so each kernel appears once; feasible
# points on sm90 (bf16, deterministic): fwd 153 at D=64 / 128 at D=128 (portable 45/38,
# Hopper 108/90); bwd 180 / 112 (two-kernel 56/42, one-launch 28/22, Hopper 96/48; the
# atomic variant cannot serve a deterministic problem).
FWD_COND_GRID = dict(variant=(0, 1), block_m=(32, 64, 128), block_n=(32, 64, 128),
                     num_warps=(4, 8), num_stages=(2, 3, 4), persistent=(0, 1),
                     tile_order=(0, 1, 2), pingpong=(0, 1))
BWD_COND_GRID = dict(variant=(0, 1, 2, 3), dkdv_block_m=(32, 64), dkdv_block_n=(64, 128),
                     dkdv_warps=(4, 8), dq_block_m=(64, 128), dq_block_n=(32, 64),
                     dq_warps=(4, 8), dkdv_atomic_tma=(0, 1), hopper_block_m=(64, 128),
                     hopper_block_n=(64, 128), hopper_stages=(1, 2, 3, 4),
                     hopper_regs=(216, 232, 240), hopper_stagger=(0, 1))
GRIDS = {"portable": {"fwd": FWD_GRID, "bwd": BWD_GRID},
         "conditional": {"fwd": FWD_COND_GRID, "bwd": BWD_COND_GRID}}


def _std(s: int, d: int, causal: bool) -> Problem:
    h = 2048 // d
    return Problem(batch=16384 // s, heads_q=h, heads_kv=h, seqlen_q=s, seqlen_k=s,
                   head_dim=d, dtype="bf16", causal=causal)


QUALITY_PROBLEMS = [_std(512, 64, False), _std(1024, 64, True), _std(512, 128, True),
                    _std(1024, 128, False), _std(2048, 128, True), _std(2048, 64, False)]


COST_PROBLEMS = [_std(1024, 64, True), _std(4096, 128, False), _std(16384, 128, True)]
BUDGET_PROBLEMS = [*COST_PROBLEMS, _std(512, 128, False), _std(2048, 64, False),
                   _std(8192, 64, True),
                   Problem(batch=4, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_k=4096,
                           head_dim=128, dtype="bf16", causal=True),
                   _std(1000, 128, True)]


def _env_info() -> dict[str, Any]:
    import torch
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu-interpreter"
    return {"gpu": dev, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "date": datetime.now(timezone.utc).isoformat(),
            "cpus": os.cpu_count()}


def _label(p: Problem) -> str:
    heads = f"{p.heads_q}/{p.heads_kv}" if p.heads_kv != p.heads_q else f"{p.heads_q}"
    return (f"B{p.batch} H{heads} S{p.seqlen_q} D{p.head_dim}{' causal' if p.causal else ''}"
            f"{'' if p.deterministic else ' nondet'}")


def problem_of_label(label: str) -> Problem:
    """The bf16 problem a row's label names (:func:`_label`'s inverse: ``B16 H32 S1024 D64
    causal``; ``H32/8`` is 32 query heads over 8 key/value heads; ``nondet`` last for
    ``deterministic=False``)."""
    words = label.split()
    val = {w[0]: w[1:] for w in words if w[0] in "BHSD"}
    try:
        heads = [int(h) for h in val["H"].split("/")]
        return Problem(batch=int(val["B"]), heads_q=heads[0], heads_kv=heads[-1],
                       seqlen_q=int(val["S"]), seqlen_k=int(val["S"]), head_dim=int(val["D"]),
                       dtype="bf16", causal="causal" in words,
                       deterministic="nondet" not in words)
    except (KeyError, ValueError) as e:
        raise SystemExit(f"problem {label!r}: {e!s}; write it as 'B16 H32 S1024 D64', with "
                         f"'H32/8' for 8 key/value heads, 'causal' after it if masked and 'nondet' "
                         f"last for deterministic=False") from None


def _retime(sess: TuneSession, p: Problem, d: str, configs: list[dict[str, Any]],
            rounds: int = 5) -> list[float]:
    reply = sess.worker.request({"op": "retime", "problem": p.as_dict(), "direction": d,
                                 "configs": configs, "rounds": rounds, "timing": {}},
                                timeout=600)
    if reply.get("status") != "ok":
        raise RuntimeError(f"retime failed: {reply}")
    return [t["median_ms"] for t in reply["timings"]]


def _trial_log(log: list[dict[str, Any]], prepare: list[dict[str, Any]] | None = None
               ) -> Callable[[dict[str, Any]], None]:
    """A progress callback that keeps every measured trial (the landscape a search saw),
    and in ``prepare`` the worker's setup of the problem (when it ended, its seconds)."""
    def cb(ev: dict[str, Any]) -> None:
        if ev.get("event") == "trial":
            log.append({k: ev.get(k) for k in ("number", "status", "config", "value_ms",
                                               "parts_ms", "source", "elapsed_s",
                                               "seconds")})
            if ev.get("status") != "ok":
                log[-1]["detail"] = str(ev.get("detail", ""))[:300]
        elif ev.get("event") == "prepare" and prepare is not None:
            prepare.append({k: ev.get(k) for k in ("status", "elapsed_s", "seconds")})
    return cb


def _write(out: Path, name: str, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def cmd_parallel(args: argparse.Namespace) -> None:
    p = _std(4096, 128, True)
    rows = []
    for d in args.directions.split(","):
        for n in (args.workers, 1):
            os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"tcache{n}")
            t0 = time.perf_counter()
            with TuneSession(compile_workers=n) as sess:
                sess.worker.start()
                if sess.pool is not None:
                    sess.pool.submit(p.as_dict(), d, config_to_dict(default_config(d, p))
                                     ).result()  # start the pool's processes
                t_start = time.perf_counter() - t0
                r = tune(p, d, trials=args.trials or 24, storage="sqlite://", session=sess,
                         timing=TIMING, retime_rounds=0, store=False, **NO_SHIPPED, seed=1)
            rows.append({"direction": d, "workers": n, "trials": r.trials,
                         "infeasible": r.infeasible, "wall_s": r.search_seconds,
                         "per_trial_s": r.search_seconds / r.trials,
                         "critical_compile_s": r.compile_seconds,
                         "compile_share": r.compile_seconds / r.search_seconds,
                         "pool_compile_s": r.pool_compile_seconds, "startup_s": t_start,
                         "best_ms": r.median_ms, "failed": r.failed, "pruned": r.pruned})
            print(json.dumps(rows[-1]), flush=True)
    _write(Path(args.out), "parallel", {"env": _env_info(), "problem": p.as_dict(),
                                        "timing": TIMING, "rows": rows})
    print(f"\n{'dir':4} {'workers':>7} {'trials':>6} {'wall s':>7} {'s/trial':>7} "
          f"{'compile share':>13}")
    for r in rows:
        print(f"{r['direction']:4} {r['workers']:>7} {r['trials']:>6} {r['wall_s']:>7.1f} "
              f"{r['per_trial_s']:>7.2f} {r['compile_share']:>13.0%}")


def _exhaustive(sess: TuneSession, p: Problem, d: str, space: SearchSpace,
                points: list[dict[str, Any]], seed: int
                ) -> tuple[dict[str, Any], list[dict[str, Any]], float, float]:
    """Every point of ``points`` compiled (in the pool, all at once), gated and timed in
    full; the fastest within 3% of the best (at most 4) re-timed side by side. Returns the
    winner, the log (one record per point), the compile wall seconds and the total."""
    t0 = time.perf_counter()
    pd = p.as_dict()
    cfgs = [config_to_dict(space.config(pt)) for pt in points]
    futs = [sess.pool.submit(pd, d, c) for c in cfgs] if sess.pool is not None else []
    built = {json.dumps(c, sort_keys=True): f.result()  # (seconds, compile error)
             for c, f in zip(cfgs, futs, strict=False)}
    t_compiled = time.perf_counter() - t0
    log: list[dict[str, Any]] = []
    for i, c in enumerate(cfgs):
        t1 = time.perf_counter()
        reply = sess.worker.request({"op": "measure", "problem": pd, "direction": d,
                                     "config": c, "seed": seed * 1_000_003 + i,
                                     "timing": {**TIMING, "rel_tol": None}}, timeout=300)
        rec = {"number": i, "status": reply.get("status"), "config": c,
               "value_ms": reply.get("median_ms") if reply.get("status") == "ok" else None,
               "parts_ms": reply.get("parts_ms", {}), "source": "exhaustive",
               "seconds": time.perf_counter() - t1,
               "compile_s": built.get(json.dumps(c, sort_keys=True), (None, ""))[0]}
        if rec["status"] != "ok":
            rec["detail"] = str(reply.get("detail", ""))[:300]
        log.append(rec)
    ok = sorted((r for r in log if r["status"] == "ok"), key=lambda r: r["value_ms"])
    if not ok:
        raise RuntimeError(f"no point of the sub-grid passed the gate for {_label(p)} {d}")
    top = [r["config"] for r in ok if r["value_ms"] <= 1.03 * ok[0]["value_ms"]][:4]
    ms = _retime(sess, p, d, top, rounds=3) if len(top) > 1 else [ok[0]["value_ms"]]
    best = top[min(range(len(top)), key=ms.__getitem__)]
    return best, log, t_compiled, time.perf_counter() - t0


def cmd_quality(args: argparse.Namespace) -> None:
    rows = []
    grids = GRIDS[args.grid]
    t_all = time.perf_counter()
    with TuneSession(compile_workers=args.workers) as sess:
        sess.warm()
        for d in args.directions.split(","):
            space = SearchSpace.subgrid(d, **grids[d])
            for i, p in enumerate(QUALITY_PROBLEMS):
                if args.only and str(i) not in args.only.split(","):
                    continue
                feasible = space.feasible_grid(p)
                n_feasible = len(feasible)
                by_variant = {v: sum(f.get("variant") == v for f in feasible)
                              for v in sorted({f.get("variant") for f in feasible})}
                budget = math.floor(0.2 * n_feasible)  # at most 20% of the exhaustive's
                tp_log: list[dict[str, Any]] = []
                ex_cfg, ex_log, ex_compile_s, ex_s = _exhaustive(sess, p, d, space, feasible,
                                                                 args.seed)
                tp = tune(p, d, sampler="tpe", space=space, trials=budget,
                          storage="sqlite://", session=sess, store=False,
                          **NO_SHIPPED, seed=args.seed, progress=_trial_log(tp_log))
                tp_cfg = config_to_dict(tp.config)
                same = ex_cfg == tp_cfg
                if same:  # one kernel: the gap is zero by definition, not by timing
                    ms = _retime(sess, p, d, [ex_cfg]) * 2
                else:
                    ms = _retime(sess, p, d, [ex_cfg, tp_cfg], rounds=9)
                sweep = {json.dumps(t["config"], sort_keys=True): t["value_ms"]
                         for t in ex_log if t["status"] == "ok"}
                # nan when the tuner's pick is not a point the exhaustive search passed
                sweep_gap = sweep.get(json.dumps(tp_cfg, sort_keys=True), math.nan) \
                    / min(sweep.values()) - 1
                row = {"direction": d, "problem": _label(p), "grid": space.size,
                       "grid_name": args.grid, "feasible": n_feasible,
                       "feasible_by_variant": by_variant,
                       "exhaustive_variant": ex_cfg.get("variant"),
                       "tpe_variant": tp_cfg.get("variant"),
                       "exhaustive_trials": sum(t["status"] == "ok" for t in ex_log),
                       "exhaustive_failed": {s: sum(t["status"] == s for t in ex_log)
                                             for s in {t["status"] for t in ex_log}
                                             if s != "ok"},
                       "exhaustive_s": ex_s, "exhaustive_compile_wall_s": ex_compile_s,
                       "tpe_budget": budget, "tpe_trials": tp.trials, "tpe_s": tp.search_seconds,
                       "tpe_compile_share": tp.compile_seconds / tp.search_seconds,
                       "tpe_infeasible": tp.infeasible, "tpe_winner_source": tp.winner_source,
                       "tpe_stop": tp.stop_reason, "tpe_retimed": tp.retimed,
                       "exhaustive_ms": ms[0], "tpe_ms": ms[1],
                       "same_config": same, "gap": 0.0 if same else ms[1] / ms[0] - 1,
                       "sweep_gap": sweep_gap, "exhaustive_config": ex_cfg,
                       "tpe_config": tp_cfg,
                       "exhaustive_trials_log": ex_log, "tpe_trials_log": tp_log}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("_log")}),
                      flush=True)
                tag = args.grid + "_" + args.directions.replace(",", "_") \
                    + args.only.replace(",", "")
                _write(Path(args.out), f"quality_{tag}",
                       {"env": _env_info(), "timing": TIMING, "grids": grids, "rows": rows,
                        "wall_s": time.perf_counter() - t_all})
    print(f"\n{'dir':4} {'problem':26} {'feas':>4} {'ex ok':>5} {'ex s':>5} {'tpe':>4} "
          f"{'tpe s':>6} {'ex ms':>8} {'tpe ms':>8} {'gap':>6} {'sweep':>6} "
          f"{'variants':>8} {'source':>8}")
    for r in rows:
        print(f"{r['direction']:4} {r['problem']:26} {r['feasible']:>4} "
              f"{r['exhaustive_trials']:>5} {r['exhaustive_s']:>5.0f} {r['tpe_trials']:>4} "
              f"{r['tpe_s']:>6.1f} {r['exhaustive_ms']:>8.4f} "
              f"{r['tpe_ms']:>8.4f} {'same' if r['same_config'] else format(r['gap'], '+6.1%'):>6} "
              f"{r['sweep_gap']:>+6.1%} {r['exhaustive_variant']}/{r['tpe_variant']:<6} "
              f"{r['tpe_winner_source']:>8}")
    if rows:
        print(f"within 2%: {sum(r['gap'] <= 0.02 for r in rows)} of {len(rows)}; "
              f"worst gap {max(r['gap'] for r in rows):+.1%}")


def cmd_vs_default(args: argparse.Namespace) -> None:
    rows = []
    trials = args.trials if args.trials or args.time_budget else 40
    probs = standard_matrix()[args.start:]
    if args.limit:
        probs = probs[: args.limit]
    with TuneSession(compile_workers=args.workers) as sess:
        for d in args.directions.split(","):
            for p in probs:
                log: list[dict[str, Any]] = []
                r = tune(p, d, trials=trials, time_budget=args.time_budget,
                         storage="sqlite://", session=sess, timing=TIMING, store=False,
                         **NO_SHIPPED, retime_rounds=3, seed=args.seed,
                         progress=_trial_log(log))
                dflt = config_to_dict(default_config(d, p))
                ms = _retime(sess, p, d, [config_to_dict(r.config), dflt])
                row = {"direction": d, "problem": _label(p), "gqa": p.gqa_ratio,
                       "trials": r.trials, "search_s": r.search_seconds,
                       "winner_source": r.winner_source, "tuned_ms": ms[0],
                       "default_ms": ms[1], "speedup": ms[1] / ms[0],
                       "tflops": p.flops(d) / (ms[0] * 1e-3) / 1e12,
                       "config": config_to_dict(r.config),
                       "not_ok": [t for t in log if t["status"] != "ok"]}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "not_ok"}), flush=True)
                _write(Path(args.out),
                       f"vs_default_{args.directions.replace(',', '_')}_from{args.start}",
                       {"env": _env_info(), "timing": TIMING, "rows": rows})
    print(f"\n{'dir':4} {'problem':28} {'trials':>6} {'tuned ms':>9} {'default ms':>10} "
          f"{'speedup':>7} {'TFLOP/s':>7}")
    for r in rows:
        print(f"{r['direction']:4} {r['problem'] + (' gqa' if r['gqa'] > 1 else ''):28} "
              f"{r['trials']:>6} {r['tuned_ms']:>9.4f} {r['default_ms']:>10.4f} "
              f"{r['speedup']:>7.3f} {r['tflops']:>7.0f}")
    for d in args.directions.split(","):
        g = geomean([r["speedup"] for r in rows if r["direction"] == d])
        print(f"geomean speedup {d}: {g:.3f}x")


COST_FIELDS = ("pool_wait_s", "compile_s", "gate_s", "reference_s", "time_s", "confirm_s",
               "wall_s")


def cmd_cost(args: argparse.Namespace) -> None:
    import statistics

    import optuna

    from flashtune.autotune.tuner import optuna_storage

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tcache-cost")  # cold
    db = Path(tempfile.mkdtemp(prefix="cost-db")) / "cost.db"
    url = f"sqlite:///{db}"
    rows = []
    with TuneSession(compile_workers=args.workers) as sess:
        for d in args.directions.split(","):
            for p in COST_PROBLEMS:
                t0 = time.perf_counter()
                r = tune(p, d, trials=None if args.time_budget else (args.trials or 12),
                         time_budget=args.time_budget, storage=url, session=sess,
                         seed=args.seed, store=False, **NO_SHIPPED)
                tune_s = time.perf_counter() - t0
                study = optuna.load_study(study_name=r.study_name, storage=optuna_storage(url))
                trials = [t.user_attrs for t in study.trials if t.user_attrs.get("measured")]

                def med(k: str, trials: list[dict[str, Any]] = trials) -> float:
                    xs = [float(t[k]) if k in t else (0.0 if k == "confirm_s" else math.nan)
                          for t in trials]
                    return statistics.median(xs) if xs else math.nan

                cost = [float(t.get("wall_s", math.nan)) + float(t.get("confirm_s", 0.0))
                        for t in trials]
                row = {"direction": d, "problem": _label(p), "trials": r.trials,
                       "search_s": r.search_seconds, "tune_s": tune_s,
                       "per_trial_s": r.search_seconds / max(r.trials, 1),
                       "median_trial_s": statistics.median(cost),
                       "final_retime_s": tune_s - r.search_seconds,
                       **{f"median_{k}": med(k) for k in COST_FIELDS},
                       "confirmed": sum("confirm_s" in t or "confirm_ms" in t for t in trials),
                       "best_ms": r.median_ms}
                rows.append(row)
                print(json.dumps(row), flush=True)
    tag = f"_{args.tag}" if args.tag else ""
    _write(Path(args.out), f"cost{tag}", {"env": _env_info(), "rows": rows,
                                          "trials": args.trials or 12})
    print(f"\n{args.tag or 'cost'}: {'dir':4} {'problem':22} {'trial s':>7} {'mean s':>6} "
          + " ".join(f"{k[:-2]:>9}" for k in COST_FIELDS[:-1]) + f" {'final s':>7}")
    for r in rows:
        print(f"{' ' * len(args.tag or 'cost')}  {r['direction']:4} {r['problem']:22} "
              f"{r['median_trial_s']:>7.2f} {r['per_trial_s']:>6.2f} "
              + " ".join(f"{r['median_' + k]:>9.3f}" for k in COST_FIELDS[:-1])
              + f" {r['final_retime_s']:>7.1f}")
    for d in args.directions.split(","):
        xs = [r["median_trial_s"] for r in rows if r["direction"] == d]
        print(f"median trial cost {d}: {statistics.median(xs):.2f} s (median over problems)")


def _warm_forward(sess: TuneSession, p: Problem, d: str) -> float:
    """Before a backward search: compile the problem's default forward (which the
    backward's gate runs), as a sweep's forward task of the shape does first; its seconds."""
    if d != "bwd" or sess.pool is None:
        return 0.0
    t0 = time.perf_counter()
    sess.pool.submit(p.as_dict(), "fwd", config_to_dict(default_config("fwd", p))).result()
    return time.perf_counter() - t0


def _stored_winners(paths: list[str], direction: str
                    ) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Earlier budget files' winners per problem label: ("BLOCK long" or "BLOCK short",
    config) for every block of each file (a file of one run is the block "run"; a block
    name repeated in a later file gets that file's name in front)."""
    blocks: dict[str, Any] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for k, v in ({"run": data} if "rows" in data else data).items():
            if isinstance(v, dict) and "rows" in v:
                blocks[k if k not in blocks else f"{Path(path).stem}:{k}"] = v
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, block in blocks.items():
        for r in block["rows"]:
            if r["direction"] == direction:
                for which in ("long", "short"):
                    out.setdefault(r["problem"], []).append(
                        (f"{name} {which}", r[f"{which}_config"]))
    return out


def shipped_problems(direction: str, gpu: str | None = None) -> list[Problem]:
    """The problem of each shipped entry of ``direction`` on ``gpu`` (default: this one),
    in the layer's order, deduplicated: what ``budget --shipped-keys`` searches, every key
    the layer serves here (``--start`` and ``--limit`` take a slice, one per process) that
    a row label names (:func:`_label`: dense bf16 calls without a window or softcap)."""
    from flashtune.db.exchange import shipped_results

    if gpu is None:
        import torch

        gpu = torch.cuda.get_device_name()
    out: list[Problem] = []
    for r in shipped_results():
        p = r.problem
        if r.device.name == gpu and r.direction == direction and p is not None \
                and p not in out and problem_of_label(_label(p)).key(direction) == \
                p.key(direction):
            out.append(p)
    return out


def _shipped_winners(probs: list[Problem], direction: str
                     ) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """The shipped layer's config for each problem's key on this GPU, as a stored long
    winner ("shipped long"): a search's start (the priors) judged against the configs
    every earlier session's searches and retimes left in the layer, with no budget file."""
    import torch

    from flashtune.db.exchange import shipped_results

    gpu = torch.cuda.get_device_name()
    mine = {r.key: r.config for r in shipped_results() if r.device.name == gpu}
    return {_label(p): [("shipped long", mine[p.key(direction)])] for p in probs
            if p.key(direction) in mine}


def _budget_against(sess: TuneSession, d: str, p: Problem,
                    stored: list[tuple[str, dict[str, Any]]], short: Any,
                    short_log: list[dict[str, Any]], prep: list[dict[str, Any]],
                    warm_fwd: float, with_finalists: bool) -> dict[str, Any]:
    """A short search judged against an earlier run's winners of the same problem: the
    new winner and every distinct stored one re-timed side by side in this process
    (9 rounds' worth, interleaved), and with ``with_finalists`` the short search's other
    finalists; "gap" is the new winner over the fastest stored long search's winner,
    "stored_short_gaps" the earlier short winners' own gaps in the same re-timing,
    "short_retimed" each finalist's trial, search re-timing and judge times (None where
    it was not in the judge)."""
    cs = config_to_dict(short.config)
    configs = [cs]
    for _name, c in stored:
        if c not in configs:
            configs.append(c)
    if with_finalists:
        # The short search's other finalists join the judge (last), so that its
        # re-timing's ranking and the judge's can be compared config by config. The
        # company moves a pair's ratio (by 3 points at 16k causal, session 46), so the
        # gaps are then not those of the usual judge.
        configs += [c for c in (r["config"] for r in short.retimed) if c not in configs]
    ms = _retime(sess, p, d, configs, rounds=9)
    of = {json.dumps(c, sort_keys=True): t for c, t in zip(configs, ms, strict=True)}
    timed = [(name, of[json.dumps(c, sort_keys=True)]) for name, c in stored]
    best_long = min(t for name, t in timed if name.endswith(" long"))
    return {"direction": d, "problem": _label(p), "short_trials": short.trials,
            "short_s": short.search_seconds, "short_ms": ms[0], "long_ms": best_long,
            "gap": ms[0] / best_long - 1, "same_config": cs in [c for _n, c in stored],
            "stored_ms": dict(timed),
            "stored_short_gaps": {n: t / best_long - 1 for n, t in timed
                                  if n.endswith(" short")},
            "short_variant": cs.get("variant"), "short_winner": short.winner_source,
            "short_stop": short.stop_reason, "short_infeasible": short.infeasible,
            "short_config": cs, "short_prepare": prep, "warm_forward_s": warm_fwd,
            "short_retimed": [{"config": r["config"], "trial_ms": r["trial_ms"],
                               "retime_ms": r["median_ms"],
                               "judge_ms": of.get(json.dumps(r["config"], sort_keys=True))}
                              for r in short.retimed],
            "short_retime_clocks": short.retime_clocks,
            "short_trials_log": short_log}


def cmd_budget(args: argparse.Namespace) -> None:
    if not args.time_budget:
        raise SystemExit("budget needs --time-budget S (the short search's seconds)")
    rows = []
    if args.shipped_keys:
        if args.problem or not args.against_shipped:
            raise SystemExit("--shipped-keys takes no --problem and needs --against-shipped")
        probs = shipped_problems(args.directions.split(",")[0])[args.start:]
    else:
        probs = [problem_of_label(x) for x in args.problem] or BUDGET_PROBLEMS[args.start:]
    if args.limit:
        probs = probs[: args.limit]
    if args.against or args.against_shipped:
        _cmd_budget_against(args, probs)
        return
    with TuneSession(compile_workers=args.workers) as sess:
        # As a sweep does before its first task: the worker's and the compile processes'
        # one-time start (imports, CUDA context) is not charged to the first short search.
        t0 = time.perf_counter()
        sess.warm()
        warm_s = time.perf_counter() - t0
        for d in args.directions.split(","):
            for p in probs:
                short_log: list[dict[str, Any]] = []
                long_log: list[dict[str, Any]] = []
                prep: dict[str, list[dict[str, Any]]] = {"short": [], "long": []}
                warm_fwd = _warm_forward(sess, p, d)
                short = tune(p, d, time_budget=args.time_budget, storage="sqlite://",
                             session=sess, store=False, **NO_SHIPPED, seed=args.seed,
                             progress=_trial_log(short_log, prep["short"]))
                long = tune(p, d, time_budget=args.factor * args.time_budget,
                            storage="sqlite://", session=sess, store=False, **NO_SHIPPED,
                            seed=args.seed + 1, progress=_trial_log(long_log, prep["long"]))
                cs, cl = config_to_dict(short.config), config_to_dict(long.config)
                ms = _retime(sess, p, d, [cs] if cs == cl else [cs, cl], rounds=9)
                row = {"direction": d, "problem": _label(p), "short_trials": short.trials,
                       "long_trials": long.trials, "short_s": short.search_seconds,
                       "long_s": long.search_seconds, "same_config": cs == cl,
                       "short_ms": ms[0], "long_ms": ms[-1],
                       "gap": 0.0 if cs == cl else ms[0] / ms[1] - 1,
                       "short_variant": cs.get("variant"), "long_variant": cl.get("variant"),
                       "short_winner": short.winner_source, "long_winner": long.winner_source,
                       "short_stop": short.stop_reason, "long_stop": long.stop_reason,
                       "short_infeasible": short.infeasible,
                       "long_infeasible": long.infeasible,
                       "short_config": cs, "long_config": cl,
                       "short_prepare": prep["short"], "long_prepare": prep["long"],
                       "warm_forward_s": warm_fwd,
                       "short_trials_log": short_log, "long_trials_log": long_log}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("_log")}),
                      flush=True)
                _write(Path(args.out), f"budget_{args.directions.replace(',', '_')}"
                       f"_from{args.start}", {"env": _env_info(), "rows": rows, "warm_s": warm_s,
                                              "time_budget": args.time_budget,
                                              "factor": args.factor})
    print(f"\n{'dir':4} {'problem':28} {'trials':>11} {'short ms':>9} {'long ms':>9} {'gap':>6} "
          f"{'variants':>8} {'winners (source)':>18}")
    for r in rows:
        print(f"{r['direction']:4} {r['problem']:28} {r['short_trials']:>5}/{r['long_trials']:<5} "
              f"{r['short_ms']:>9.4f} {r['long_ms']:>9.4f} "
              f"{'same' if r['same_config'] else format(r['gap'], '+6.1%'):>6} "
              f"{r['short_variant']}/{r['long_variant']:<6} "
              f"{r['short_winner'] + '/' + r['long_winner']:>18}")
    if rows:
        print(f"worst gap: {max(r['gap'] for r in rows):+.1%}")


def _cmd_budget_against(args: argparse.Namespace, probs: list[Problem]) -> None:
    """``budget --against FILE``: only the short searches, each judged against the winners
    FILE stored for its problem (see :func:`_budget_against`): a change to the search's
    start (the priors) is checked in about half the device time of a full check (265 s
    against about 560 for the eight backward problems on the H200). The
    long searches are the earlier run's, on the kernels and search of that run."""
    rows = []
    with TuneSession(compile_workers=args.workers) as sess:
        sess.warm()
        for d in args.directions.split(","):
            stored = _stored_winners(args.against, d)
            if args.against_shipped:
                for label, winners in _shipped_winners(probs, d).items():
                    stored.setdefault(label, []).extend(winners)
            for p in probs:
                if _label(p) not in stored:
                    print(f"{d} {_label(p)}: no stored winner to judge against (skipped)",
                          flush=True)
                    continue
                short_log: list[dict[str, Any]] = []
                prep: list[dict[str, Any]] = []
                warm_fwd = _warm_forward(sess, p, d)
                short = tune(p, d, time_budget=args.time_budget, storage="sqlite://",
                             session=sess, store=False, **NO_SHIPPED, seed=args.seed,
                             progress=_trial_log(short_log, prep))
                row = _budget_against(sess, d, p, stored[_label(p)], short, short_log,
                                      prep, warm_fwd, args.with_finalists)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("_log")}),
                      flush=True)
                _write(Path(args.out), f"budget_against_{args.directions.replace(',', '_')}"
                       f"_from{args.start}", {"env": _env_info(), "rows": rows,
                                              "against": [Path(a).name
                                                          for a in args.against]
                                              + ["shipped"] * args.against_shipped,
                                              "time_budget": args.time_budget})
    print(f"\n{'dir':4} {'problem':28} {'trials':>6} {'new ms':>9} {'long ms':>9} {'gap':>6} "
          f"{'earlier short gaps':>20}")
    for r in rows:
        old = " ".join(f"{g:+.1%}" for g in r["stored_short_gaps"].values())
        print(f"{r['direction']:4} {r['problem']:28} {r['short_trials']:>6} "
              f"{r['short_ms']:>9.4f} {r['long_ms']:>9.4f} {r['gap']:+6.1%} {old:>20}")
    if rows:
        print(f"worst gap: {max(r['gap'] for r in rows):+.1%}; within 2%: "
              f"{sum(r['gap'] <= 0.02 for r in rows)} of {len(rows)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["parallel", "quality", "vs-default", "cost", "budget"])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--workers", type=int, default=14, help="compile workers")
    ap.add_argument("--directions", default="fwd,bwd")
    ap.add_argument("--trials", type=int, default=None,
                    help="parallel: trials per run (24); vs-default: trials per shape")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="vs-default: seconds per shape (default: 40 trials, no time limit)")
    ap.add_argument("--start", type=int, default=0,
                    help="vs-default, budget: first shape (index)")
    ap.add_argument("--limit", type=int, default=0, help="vs-default: at most this many shapes")
    ap.add_argument("--only", default="", help="quality: comma-separated problem indices")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="conditional",
                    help="quality: the sub-grid searched exhaustively")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="cost: a label for the output file and table")
    ap.add_argument("--against", action="append", default=[],
                    help="budget: judge only short searches against this earlier budget "
                         "file's winners (repeat it to pool several files)")
    ap.add_argument("--against-shipped", action="store_true",
                    help="budget: judge only short searches, against the shipped layer's "
                         "config for the problem's key on this GPU (pooled with --against)")
    ap.add_argument("--problem", action="append", default=[],
                    help="budget: this problem instead of the eight (a row label, e.g. "
                         "'B8 H32 S2048 D64 causal'; repeatable)")
    ap.add_argument("--shipped-keys", action="store_true",
                    help="budget --against-shipped: every key the shipped layer holds for "
                    "this GPU and the first of --directions, in the layer's order "
                    "(--start, --limit: a slice)")
    ap.add_argument("--with-finalists", action="store_true",
                    help="budget --against: the short search's finalists join the judge")
    ap.add_argument("--factor", type=float, default=5.0,
                    help="budget: the long search's budget over the short one's")
    args = ap.parse_args(argv)
    {"parallel": cmd_parallel, "quality": cmd_quality, "vs-default": cmd_vs_default,
     "cost": cmd_cost, "budget": cmd_budget}[args.what](args)


if __name__ == "__main__":
    main(sys.argv[1:])
