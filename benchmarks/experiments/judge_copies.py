"""Does the judge's re-timing tell apart two configs that differ in one small knob, or
is that its noise? For rows of a ``tune_autotuner.py budget`` file: the short and the long
winner, each twice (as distinct objects, so each copy has its own buffers), re-timed
together as the judge does (house timing, ``--rounds`` rounds, launches interleaved),
``--repeats`` times.

    PYTHONPATH=.:benchmarks python benchmarks/experiments/judge_copies.py budget.json \
        --block head 2 5 [--rounds 9] [--repeats 3]

Printed per row: each copy's median ms per repeat, and the short / long ratio of the
copies' means. Copies of one config agreeing while the two configs differ is a real
difference; copies apart by as much is the protocol's spread.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from protocol_probe import budget_rows, save_rows
from tune_autotuner import problem_of_label

from flashtune.autotune.measure import Bench, retime
from flashtune.kernels.config import config_from_dict


def main(argv: list[str]) -> None:
    args, rows = budget_rows(argv, rounds=(int, 9), repeats=(int, 3))
    out = []
    for row in rows:
        d, p = row["direction"], problem_of_label(row["problem"])
        diff = {k: (row["short_config"][k], row["long_config"][k]) for k in row["short_config"]
                if row["short_config"][k] != row["long_config"].get(k)}
        bench = Bench(p, "cuda")
        names = ["short A", "long A", "short B", "long B"]
        cfgs = [config_from_dict(d, row[f"{n.split()[0]}_config"]) for n in names]
        reps = []
        for _ in range(args.repeats):
            time.sleep(1.0)
            reps.append([t.median_ms for t in retime(bench, d, cfgs, rounds=args.rounds)])
        mean = [statistics.mean(r[i] for r in reps) for i in range(4)]
        print(f"\n{d} {row['problem']} on {torch.cuda.get_device_name()}; differ in {diff}")
        for r in reps:
            print("  " + "  ".join(f"{n} {x:.4f}" for n, x in zip(names, r, strict=True)))
        print(f"  copies: short B / A {mean[2] / mean[0]:.4f}, long B / A {mean[3] / mean[1]:.4f};"
              f" short / long {(mean[0] + mean[2]) / (mean[1] + mean[3]):.4f}")
        out.append({"problem": row["problem"], "differ": diff, "names": names, "ms": reps})
        del bench
        torch.cuda.empty_cache()
    save_rows(args.json, out, rounds=args.rounds)


if __name__ == "__main__":
    main(sys.argv[1:])
