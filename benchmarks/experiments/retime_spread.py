"""How far apart do repeated side-by-side re-timings of the same configs land?

    PYTHONPATH=.:benchmarks python benchmarks/experiments/retime_spread.py quality.json ROW \
        [--repeats 4] [--rounds 5]

Reads one row of a ``tune_autotuner.py quality`` file: the exhaustive search's winner,
the tuner's winner and the tuner's three fastest trials (its finalists, as ``tune``
picks them, with the default). Re-times that set ``--repeats`` times with the tuner's
final protocol (``retime``: house timing, ``--rounds`` rounds' worth, launches
interleaved since session 17; in alternating rounds before), and
each config alone with the search's trial timing, in one process. Prints each
config's medians per repeat and the winner of each repeat: if the winner changes from
one repeat to the next, the final re-timing cannot separate these configs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from flashtune.autotune.measure import Bench, retime
from flashtune.autotune.tuner import SEARCH_TIMING
from flashtune.kernels.config import config_from_dict, config_to_dict, default_config
from tune_autotuner import problem_of_label

KEYS = ("variant", "block_m", "block_n", "num_warps", "num_stages", "persistent",
        "tile_order", "pingpong", "dkdv_block_m", "dkdv_block_n", "dq_block_m", "dq_block_n")


def _short(c: dict) -> str:
    return " ".join(f"{k}={c[k]}" for k in KEYS if k in c)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("row", type=int)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    row = json.load(open(args.file))["rows"][args.row]
    d, p = row["direction"], problem_of_label(row["problem"])
    ok = sorted((t for t in row["tpe_trials_log"] if t["status"] == "ok"),
                key=lambda t: t["value_ms"])
    cfgs: list[dict] = []
    for c in [row["exhaustive_config"], row["tpe_config"], *(t["config"] for t in ok[:3]),
              config_to_dict(default_config(d, p))]:
        if c not in cfgs:
            cfgs.append(c)
    bench = Bench(p, "cuda")
    objs = [config_from_dict(d, c) for c in cfgs]
    for o in objs:
        bench.fn(d, o)()
    torch.cuda.synchronize()
    print(f"{d} {row['problem']} on {torch.cuda.get_device_name()}")
    for i, c in enumerate(cfgs):
        print(f"  [{i}] {_short(c)}")
    per: list[list[float]] = [[] for _ in cfgs]
    for r in range(args.repeats):
        ts = retime(bench, d, objs, rounds=args.rounds)
        for i, t in enumerate(ts):
            per[i].append(t.median_ms)
        alone = [bench.time(d, o, **SEARCH_TIMING).median_ms for o in objs]
        win = min(range(len(ts)), key=lambda j: ts[j].median_ms)
        print(f"repeat {r}: retime " + " ".join(f"{t.median_ms:.4f}" for t in ts)
              + f" -> [{win}]; trial timing " + " ".join(f"{a:.4f}" for a in alone))
    print("median over repeats: " + " ".join(f"[{i}] {statistics.median(v):.4f}"
                                             for i, v in enumerate(per)))


if __name__ == "__main__":
    main(sys.argv[1:])
