"""Does a backward config's time depend on where its inputs live in memory?

Session 46 and 47 (BENCHMARKS.md, issue 17) found one config of B1 H16 S16384 D128 causal
reading 5.74 ms in one judge and 5.97 ms in another, while copies of it within one judge
agree within 0.4%, and a pair's ratio that moves with the judge's company. This holds
several :class:`Bench` objects of one problem alive at once (the same seed, so the same
values at different addresses), times a budget row's two winners on each, interleaved
(``flashtune.timing.time_interleaved``, one round) and each alone (the house loop of
``protocol_probe``), then times the first bench again. If a config moves between benches
by more than it moves between the first bench's two visits, the addresses matter.

    PYTHONPATH=.:benchmarks python benchmarks/experiments/alloc_probe.py budget.json \
        2 --block head [--benches 5] [--json OUT]
"""

from __future__ import annotations

import sys

import torch
from protocol_probe import _loop, budget_rows, save_rows
from tune_autotuner import problem_of_label

from flashtune.autotune.measure import Bench
from flashtune.kernels.config import config_from_dict
from flashtune.timing import time_interleaved


def _visit(bench: Bench, d: str, cfgs: list) -> dict:
    fns = [bench.fn(d, c) for c in cfgs]
    inter = [t.median_ms for t in time_interleaved(fns)]
    alone = [_loop(f, None) for f in fns]
    q, k, v = bench.q, bench.k, bench.v
    return {"inter": inter, "alone": alone,
            "ptr_mod_2m": [t.data_ptr() % (2 << 20) for t in (q, k, v, bench._do)]}


def main(argv: list[str]) -> None:
    args, rows = budget_rows(argv, benches=(int, 5))
    out = []
    for row in rows:
        d, p = row["direction"], problem_of_label(row["problem"])
        cfgs = [config_from_dict(d, row["short_config"]), config_from_dict(d, row["long_config"])]
        benches = [Bench(p, "cuda") for _ in range(args.benches)]
        visits = [_visit(b, d, cfgs) for b in benches]
        visits.append(_visit(benches[0], d, cfgs))  # the first bench again
        print(f"\n{d} {row['problem']} on {torch.cuda.get_device_name()}")
        print("  bench  inter short  inter long  ratio   alone short  alone long  ratio")
        for i, vis in enumerate(visits):
            name = "0 again" if i == len(benches) else str(i)
            a, b = vis["inter"], vis["alone"]
            print(f"  {name:7} {a[0]:10.4f} {a[1]:11.4f} {a[0] / a[1]:7.4f}"
                  f"  {b[0]:11.4f} {b[1]:11.4f} {b[0] / b[1]:7.4f}")
        out.append({"problem": row["problem"], "visits": visits})
        del benches
        torch.cuda.empty_cache()
    save_rows(args.json, out)


if __name__ == "__main__":
    main(sys.argv[1:])
