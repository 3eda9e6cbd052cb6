"""Why do the searches' trials and the judge rank two backward configs differently?

Session 46 (BENCHMARKS.md, issue 17) found pairs of winners 3% apart in the judge's
interleaved re-timing (copies of one config within 0.4%) and 0.5-0.7% apart when each runs
back to back, as a trial times it. This times a budget row's two winners under protocols
that differ in one thing each, ``--repeats`` times, and prints the short / long ratio:

- ``b2b``: each config alone, launch after launch, L2 flushed before each (a trial's
  loop, at the house length: 25 ms warm-up, 100 ms of repetitions), the two in turn;
- ``b2b-steps``: the same with the trial's own launch (``Bench.launch``: the backward's
  steps prepared once) instead of the judge's (``Bench.fn``: a whole ``attn_bwd`` call);
- ``scrub-mm``: as ``b2b``, with an untimed bf16 matmul (``--scrub-n`` cubed) between
  the flush and each launch: does any other kernel in between move the ranking?
- ``scrub-other``: as ``b2b``, with the other config's launch, untimed, between the flush
  and each launch (the judge's neighbours, in a loop that times one config);
- ``inter``: the judge's loop (``flashtune.timing.time_interleaved``), one round.

If ``scrub-mm`` ranks as ``inter`` does, what runs between two launches (cache state
left behind, not the order) decides, and a trial could put a cheap kernel between its
repetitions; if it ranks as ``b2b`` does, the other config itself matters. Run in
session 47 (``benchmarks/data/protocol_probe_h200_s47.json``): it moved one pair part of
the way and the other not at all; ``alloc_probe.py`` then showed the two loops of ``b2b``
meeting different clocks, and the trials are now timed beside the incumbent
(``flashtune.timing.time_against``).

    PYTHONPATH=.:benchmarks python benchmarks/experiments/protocol_probe.py budget.json \
        5 2 --block head [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tune_autotuner import problem_of_label

from flashtune.autotune.measure import Bench
from flashtune.kernels.config import config_from_dict
from flashtune.timing import time_interleaved


def _loop(fn: Callable[[], Any], scrub: Callable[[], Any] | None, warmup_ms: float = 25,
          rep_ms: float = 100) -> float:
    """Median ms of ``fn`` launched back to back, L2 flushed (and ``scrub`` run) before
    each launch, outside the events."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")

    def pre() -> None:
        flush.zero_()
        if scrub is not None:
            scrub()

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pre()
    fn()
    torch.cuda.synchronize()
    a.record()
    for _ in range(3):
        pre()
        fn()
    b.record()
    torch.cuda.synchronize()
    per = max(a.elapsed_time(b) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / per))):
        pre()
        fn()
    n = max(1, int(rep_ms / per))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(n)]
    for s, e in ev:
        pre()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def budget_rows(argv: list[str], **extra: tuple[type, Any]
                ) -> tuple[argparse.Namespace, list[dict[str, Any]]]:
    """The arguments the probes of a budget file share (FILE ROWS... [--block NAME]
    [--json OUT]) and ``extra`` options (name: (type, default)); returns them and the
    rows chosen, in order."""
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("rows", type=int, nargs="+")
    ap.add_argument("--block", default="")
    ap.add_argument("--json")
    for name, (kind, default) in extra.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    args = ap.parse_args(argv)
    data = json.load(open(args.file))
    if args.block:
        data = data[args.block]
    return args, [data["rows"][i] for i in args.rows]


def save_rows(path: str | None, rows: list[dict[str, Any]], **extra: Any) -> None:
    """Write a probe's rows (with the device, torch and ``extra``) to ``path`` (--json), if
    given."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       **extra, "rows": rows}, f)


def main(argv: list[str]) -> None:
    args, rows = budget_rows(argv, repeats=(int, 3), scrub_n=(int, 2048))
    x = torch.randn(args.scrub_n, args.scrub_n, device="cuda", dtype=torch.bfloat16)

    def scrub() -> None:
        torch.mm(x, x)

    out = []
    for row in rows:
        d, p = row["direction"], problem_of_label(row["problem"])
        bench = Bench(p, "cuda")
        cfgs = [config_from_dict(d, row["short_config"]), config_from_dict(d, row["long_config"])]
        fns = [bench.fn(d, c) for c in cfgs]
        steps = [bench.launch(d, c) for c in cfgs]
        res: dict[str, list[list[float]]] = {k: [] for k in ("b2b", "b2b-steps", "scrub-mm",
                                                              "scrub-other", "inter")}
        for _ in range(args.repeats):
            time.sleep(1.0)
            res["b2b"].append([_loop(f, None) for f in fns])
            res["b2b-steps"].append([_loop(f, None) for f in steps])
            res["scrub-mm"].append([_loop(f, scrub) for f in fns])
            res["scrub-other"].append([_loop(fns[0], fns[1]), _loop(fns[1], fns[0])])
            res["inter"].append([t.median_ms for t in time_interleaved(fns)])
        print(f"\n{d} {row['problem']} on {torch.cuda.get_device_name()}")
        for k, reps in res.items():
            print(f"  {k:10} short / long " + " ".join(f"{r[0] / r[1]:.4f}" for r in reps)
                  + "   ms " + "; ".join(f"{r[0]:.4f} {r[1]:.4f}" for r in reps))
        out.append({"problem": row["problem"], "ms": res})
        del bench, fns, steps
        torch.cuda.empty_cache()
    save_rows(args.json, out)


if __name__ == "__main__":
    main(sys.argv[1:])
