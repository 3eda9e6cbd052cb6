"""Does a kernel's time drift as the GPU stays loaded, and does the re-timing's order
favour some positions?

    PYTHONPATH=.:benchmarks python benchmarks/experiments/timing_drift.py quality.json ROW \
        [ROW ...] [--span-ms 400] [--idle-s 1.0] [--repeats 4] [--json OUT]

For each row of a ``tune_autotuner.py quality`` file, three or four configs: the
exhaustive search's winner, the tuner's winner, and the fastest trial of each kernel
family (portable, Hopper) in the tuner's trials. For a row of a ``budget`` file, the
short and the long search's winners (``--block head`` picks a run of a file that keeps
several), to see whether a near tie ranks one way in a trial's first milliseconds and the
other under the re-timing's sustained load.

- **Timeline.** After ``--idle-s`` of an idle GPU, each config runs back to back for
  ``--span-ms`` (L2 flushed before each launch, CUDA events around it, as every
  timing here), repeated ``--repeats`` times in turn. Printed: the median launch time
  in windows of time since the load began (0-10 ms is what a trial's warm-up
  covers; a trial's own repetitions follow it; the re-timing's 100 ms come after 25 ms
  of warm-up), relative to the 200-400 ms window, and the SM clock and power that
  ``nvidia-smi`` read in each window (when it can be run).
- **Position.** The tuner's final re-timing (``retime``'s order: 5 rounds, alternating)
  of four copies of one config, after ``--idle-s`` idle and after 300 ms of load: any
  spread between the copies is the protocol's, since the kernels are the same. Each
  reading is kept in sequence order. Then ``retime`` itself on the four copies (its
  launches interleaved). Repeated ``--repeats`` times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from typing import Any

import torch
from tune_autotuner import problem_of_label

from flashtune.autotune.candidates import family
from flashtune.autotune.measure import Bench, retime
from flashtune.kernels.config import config_from_dict

WINDOWS = ((0, 2), (2, 5), (5, 10), (10, 25), (25, 50), (50, 125), (125, 200), (200, 400))


def _configs(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    d = row["direction"]
    if "short_config" in row:  # a ``tune_autotuner.py budget`` row: its two winners
        out = {"short": row["short_config"]}
        if row["long_config"] != row["short_config"]:
            out["long"] = row["long_config"]
        return out
    out = {"exhaustive": row["exhaustive_config"], "tuner": row["tpe_config"]}
    ok = sorted((t for t in row["tpe_trials_log"] if t["status"] == "ok"),
                key=lambda t: t["value_ms"])
    for fam in ("portable", "hopper"):
        best = next((t["config"] for t in ok if family(d, t["config"]) == fam), None)
        if best is not None and best not in out.values():
            out[f"best {fam}"] = best
    return out


class _Smi:
    """nvidia-smi's SM clock and power every 20 ms, in the background, by wall time."""

    def __init__(self) -> None:
        try:
            self.log = tempfile.TemporaryFile("w+")  # a pipe would fill and stall it
            self.p: subprocess.Popen[str] | None = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", "-lms", "20"],
                stdout=self.log, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.p = None

    def samples(self) -> list[tuple[float, float, float]]:
        if self.p is None:
            return []
        self.p.terminate()
        self.p.wait(timeout=10)
        self.log.seek(0)
        out = self.log.read()
        rows = []
        for line in out.splitlines():
            try:
                ts, clk, pw = (x.strip() for x in line.split(","))
                t = datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((t, float(clk), float(pw)))
            except ValueError:
                continue
        return rows


def _timeline(fn: Any, span_ms: float) -> tuple[float, list[tuple[float, float]]]:
    """(wall time at the start, [(ms since the start, launch ms)]) of back-to-back
    launches for ``span_ms``."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    begin = torch.cuda.Event(enable_timing=True)
    evs = []
    torch.cuda.synchronize()
    wall0 = time.time()
    begin.record()
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < span_ms or len(evs) < 4:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        a.record()
        fn()
        b.record()
        evs.append((a, b))
        if len(evs) % 16 == 0:  # keep the host at most 16 launches ahead
            evs[-16][1].synchronize()
    torch.cuda.synchronize()
    return wall0, [(begin.elapsed_time(a), a.elapsed_time(b)) for a, b in evs]


def _sequence(bench: Bench, d: str, cfg: Any, k: int, rounds: int,
              ) -> list[tuple[int, int, float]]:
    """``retime``'s order over ``k`` copies of ``cfg``, each reading kept:
    [(copy, slot in its round, median ms)]."""
    out = []
    for r in range(rounds):
        order = list(range(k)) if r % 2 == 0 else list(range(k))[::-1]
        for slot, i in enumerate(order):
            out.append((i, slot, bench.time(d, cfg).median_ms))
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("rows", type=int, nargs="+")
    ap.add_argument("--span-ms", type=float, default=400)
    ap.add_argument("--idle-s", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--block", default="",
                    help="the block of a file that keeps several runs (budget_*_s45.json)")
    ap.add_argument("--positions-only", action="store_true", help="skip the timelines")
    args = ap.parse_args(argv)
    data = json.load(open(args.file))
    if args.block:
        data = data[args.block]
    report: list[dict[str, Any]] = []
    smi = _Smi()
    marks: list[tuple[str, str, float, float]] = []  # row, config, wall from, to
    for ri in args.rows:
        row = data["rows"][ri]
        d, p = row["direction"], problem_of_label(row["problem"])
        cfgs = _configs(row)
        bench = Bench(p, "cuda")
        objs = {n: config_from_dict(d, c) for n, c in cfgs.items()}
        fns = {n: bench.fn(d, o) for n, o in objs.items()}
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        print(f"\n{d} {row['problem']} on {torch.cuda.get_device_name()}", flush=True)
        lines: dict[str, list[list[float]]] = {n: [] for n in cfgs}
        for _ in range(0 if args.positions_only else args.repeats):
            for n, f in fns.items():
                time.sleep(args.idle_s)
                wall0, tl = _timeline(f, args.span_ms)
                marks.append((row["problem"], n, wall0, wall0 + tl[-1][0] / 1e3))
                lines[n].append([statistics.median([ms for t, ms in tl if lo <= t < hi] or
                                                   [float("nan")]) for lo, hi in WINDOWS])
        entry: dict[str, Any] = {"direction": d, "problem": row["problem"], "configs": cfgs,
                                 "windows_ms": WINDOWS, "timeline": {}}
        if not args.positions_only:
            print(f"  {'config':16} " + " ".join(f"{f'{lo}-{hi}':>9}" for lo, hi in WINDOWS)
                  + "   (median launch ms per window since the load began; then / 200-400)")
        for n, reps in lines.items():
            if not reps:
                continue
            med = [statistics.median(r[i] for r in reps) for i in range(len(WINDOWS))]
            entry["timeline"][n] = {"per_repeat": reps, "median": med}
            ref = med[-1]
            print(f"  {n:16} " + " ".join(f"{m:9.4f}" for m in med))
            print(f"  {'':16} " + " ".join(f"{m / ref:9.3f}" for m in med))
        # The copies re-timed: a quality row's exhaustive winner, a budget row's short one.
        first = "exhaustive" if "exhaustive" in objs else next(iter(objs))
        one = objs[first]
        for prewarm in (0.0, 300.0):
            pos: list[list[float]] = []
            seqs: list[list[float]] = []
            for _ in range(args.repeats):
                time.sleep(args.idle_s)
                if prewarm:
                    _timeline(fns[first], prewarm)
                seq = _sequence(bench, d, one, 4, 5)
                seqs.append([ms for _, _, ms in seq])
                pos.append([statistics.median(ms for c, _, ms in seq if c == i)
                            for i in range(4)])
            entry[f"position_prewarm{prewarm:.0f}"] = {"medians": pos, "sequences": seqs}
            mean = [statistics.mean(r[i] for r in pos) for i in range(4)]
            print(f"  re-timing four copies of the {first} winner (prewarm {prewarm:.0f} ms),"
                  " per position: " + " ".join(f"{m:.4f}" for m in mean))
            print("    in sequence order, median over repeats: " + " ".join(
                f"{statistics.median(s[j] for s in seqs):.4f}" for j in range(len(seqs[0]))))
        inter: list[list[float]] = []
        for _ in range(args.repeats):
            time.sleep(args.idle_s)
            inter.append([t.median_ms for t in retime(bench, d, [one] * 4, rounds=5)])
        entry["position_interleaved"] = inter
        print("  the same four copies interleaved launch by launch (retime), per copy: "
              + " ".join(f"{statistics.mean(r[i] for r in inter):.4f}" for i in range(4))
              + "; per repeat: " + "; ".join(" ".join(f"{x:.4f}" for x in r) for r in inter))
        if len(objs) == 2 and "exhaustive" not in objs:
            # A budget row: the judge's own re-timing of its two winners, repeated, beside
            # the timelines' ratio.
            judge: list[list[float]] = []
            for _ in range(args.repeats):
                time.sleep(args.idle_s)
                judge.append([t.median_ms for t in retime(bench, d, list(objs.values()),
                                                          rounds=9)])
            entry["judge"] = judge
            print("  the judge's re-timing (9 rounds, interleaved), second / first per repeat: "
                  + " ".join(f"{r[1] / r[0]:.4f}" for r in judge)
                  + "; ms: " + "; ".join(" ".join(f"{x:.4f}" for x in r) for r in judge))
        report.append(entry)
        del bench, fns, objs
        torch.cuda.empty_cache()
    samples = smi.samples()
    if samples and marks:
        print("\nnvidia-smi per timeline window (SM MHz / W), median over repeats:")
        for prob in dict.fromkeys(m[0] for m in marks):
            for n in dict.fromkeys(m[1] for m in marks if m[0] == prob):
                cells = []
                for lo, hi in WINDOWS:
                    clk, pw = [], []
                    for m in marks:
                        if m[0] != prob or m[1] != n:
                            continue
                        for t, c, w in samples:
                            if m[2] + lo / 1e3 <= t < m[2] + hi / 1e3:
                                clk.append(c)
                                pw.append(w)
                    cells.append(f"{statistics.median(clk):.0f}/{statistics.median(pw):.0f}"
                                 if clk else "-")
                print(f"  {prob:24} {n:16} " + " ".join(f"{c:>9}" for c in cells))
        for e in report:
            e["smi_samples"] = len(samples)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": report, "smi": samples, "marks": marks}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
