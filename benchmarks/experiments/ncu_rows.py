"""Nsight Compute's ``--csv --page raw`` output as a few numbers per kernel: time, grid,
registers, shared memory, the tensor pipe's share of the elapsed cycles and of the SMs'
active cycles (their ratio is the share of the kernel an SM held no program), and the
warp stall reasons per issued instruction. A JSON list on standard output, and a table on
standard error; CPU only.

    python3 benchmarks/experiments/ncu_rows.py run.csv [--only hopper] > rows.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

STALLS = ("long_scoreboard", "barrier", "membar", "short_scoreboard", "wait", "gmma")


def rows_of(path: str, only: str = "") -> list[dict]:
    """One dict per profiled kernel launch of ``path`` whose name contains ``only``."""
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    start = next(i for i, r in enumerate(table) if r and r[0] == "ID")
    head = table[start]
    col = {h: i for i, h in enumerate(head)}

    def num(r: list[str], key: str) -> float:
        return float(r[col[key]].replace(",", ""))

    out = []
    for r in table[start + 2:]:
        name = r[col["Kernel Name"]]
        if only not in name:
            continue
        active, elapsed = num(r, "sm__cycles_active.avg"), num(r, "sm__cycles_elapsed.avg")
        tensor = num(r, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed")
        row = {"kernel": name[:60], "duration_ns": num(r, "gpu__time_duration.sum"),
               "grid": num(r, "launch__grid_size"),
               "regs": num(r, "launch__registers_per_thread"),
               "smem_per_block": num(r, "launch__shared_mem_per_block_dynamic"),
               "tensor_pct_elapsed": tensor,
               "tensor_pct_active": round(tensor * elapsed / active, 2) if active else 0.0,
               "sm_idle_pct": round(100 * (1 - active / elapsed), 2) if elapsed else 0.0}
        for s in STALLS:
            row[f"stall_{s}"] = num(
                r, f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio")
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--only", default="", help="keep kernels whose name contains this")
    args = ap.parse_args()
    rows = rows_of(args.csv, args.only)
    for r in rows:
        print(f"{r['kernel'][:32]:32s} {r['duration_ns'] / 1e3:9.1f} us grid {r['grid']:6.0f} "
              f"tensor {r['tensor_pct_elapsed']:5.1f}/{r['tensor_pct_active']:5.1f}% idle "
              f"{r['sm_idle_pct']:5.1f}% long-sb {r['stall_long_scoreboard']:.2f} barrier "
              f"{r['stall_barrier']:.2f} membar {r['stall_membar']:.2f}", file=sys.stderr)
    json.dump(rows, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
