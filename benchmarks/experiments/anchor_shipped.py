"""Re-take the shipped entries' figures with the tuner's anchored timing (issue 17).

Since the tuner's step 6 (``flashtune.autotune.tuner``), a result's stored time is taken
in one interleaved loop with the heuristic default and SDPA's cuDNN, FA2 and efficient
backends, as the bench takes a tuned row; before, it came from the loop of the
finalists alone, whose dense company held the GPU at a lower clock. This runs that last
step, unchanged (``anchored_request``, the tuner's measurement worker), on each shipped
winner of this GPU at the entry's own shape, without searching again: the configs stay,
their figures are re-taken. Prints stored and re-taken ms per entry, writes the rows as
JSON (``--out``) and, with ``--write``, a copy of shipped.json in which this GPU's
entries carry the new median/p20/p80 and TFLOP/s (entries that fail keep theirs and are
listed). ``--defer-o``: before the re-timing, each forward Hopper winner that can take
``defer_o=1`` takes it (bit-identical to the serial consumer, and 1.012x geomean over it on
the standard matrix's shipped configs of S <= 2048; session 38), so its figure is taken as
it will be dispatched. A run cut short by ``timeout`` keeps the entries re-taken so far in
both files.

    timeout -k 10 500 python3 benchmarks/experiments/anchor_shipped.py --out $OUT/a.json \\
        --write $OUT/shipped.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any

import torch

from flashtune.autotune._isolation import Worker
from flashtune.autotune.tuner import ANCHORED_ROUNDS, anchored_request
from flashtune.db.exchange import _dump
from flashtune.kernels.config import (
    HOPPER,
    _defer_o,
    config_from_dict,
    config_to_dict,
    default_config,
)
from flashtune.problem import Problem

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "flashtune",
                       "data", "shipped.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--write", default=None, help="where to write the updated shipped.json")
    ap.add_argument("--direction", choices=("fwd", "bwd"), default=None)
    ap.add_argument("--trial-timeout", type=float, default=120.0)
    ap.add_argument("--defer-o", action="store_true",
                    help="forward Hopper winners take defer_o=1 where feasible")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    with open(SHIPPED) as f:
        doc = json.load(f)
    todo = [i for i, e in enumerate(doc["entries"]) if e["device"]["name"] == device
            and (args.direction is None or e["direction"] == args.direction)]
    worker = Worker(interpret=False)
    rows: list[dict[str, Any]] = []
    new = copy.deepcopy(doc)
    t_all = time.perf_counter()
    try:
        for n, i in enumerate(todo):
            e = doc["entries"][i]
            d, p = e["direction"], Problem.from_dict(e["example"])
            c = config_from_dict(d, e["config"])
            if args.defer_o and d == "fwd" and c.variant == HOPPER:
                c = _defer_o(c, p)  # as default_fwd takes it
            winner = config_to_dict(c)
            dflt = config_to_dict(default_config(d, p))
            configs = [winner] + ([dflt] if dflt != winner else [])
            msg, launches = anchored_request(p, d, configs, {}, interpret=False)
            t0 = time.perf_counter()
            reply = worker.request(msg, timeout=args.trial_timeout * launches * ANCHORED_ROUNDS)
            row: dict[str, Any] = {"index": i, "direction": d, "shape": p.label(),
                                   "stored_ms": e["median_ms"],
                                   "seconds": round(time.perf_counter() - t0, 2)}
            if reply.get("status") != "ok":
                row["error"] = str(reply.get("detail", reply.get("status")))[:300]
            else:
                t = reply["timings"][0]
                row.update(anchored_ms=t["median_ms"], ratio=t["median_ms"] / e["median_ms"],
                           default_ms=(reply["timings"][1]["median_ms"]
                                       if len(configs) > 1 else t["median_ms"]),
                           company={k: v["median_ms"] for k, v in reply["company"].items()},
                           company_errors=reply.get("company_errors", {}),
                           sm_mhz=(reply["clocks"] or {}).get("sm_mhz", {}).get("median"))
                ne = new["entries"][i]
                ne["config"] = {**ne["config"], **winner}
                ne["median_ms"], ne["p20_ms"] = t["median_ms"], min(t["p20_ms"], t["median_ms"])
                ne["p80_ms"] = max(t["p80_ms"], t["median_ms"])
                ne["tflops"] = p.flops(d) / (t["median_ms"] * 1e-3) / 1e12
            rows.append(row)
            print(f"[{n + 1}/{len(todo)}] {d} {row['shape']}: stored {e['median_ms']:.4f} ms, "
                  + (f"anchored {row['anchored_ms']:.4f} ms ({row['ratio']:.3f}) at "
                     f"{row['sm_mhz']} MHz" if "anchored_ms" in row else row["error"]),
                  file=sys.stderr, flush=True)
            with open(args.out, "w") as f:  # after every entry: a run cut short keeps its rows
                json.dump({"device": device, "rows": rows,
                           "seconds": round(time.perf_counter() - t_all, 1)}, f, indent=1)
            if args.write and "error" not in row:
                with open(args.write + ".part", "wb") as f:
                    f.write(_dump(new))
                os.replace(args.write + ".part", args.write)
    finally:
        worker.close()
    done = [r for r in rows if "ratio" in r]
    for d in ("fwd", "bwd"):
        rs = sorted(r["ratio"] for r in done if r["direction"] == d)
        if rs:
            print(f"{d}: {len(rs)} re-taken, anchored/stored median {rs[len(rs) // 2]:.3f} "
                  f"(min {rs[0]:.3f}, max {rs[-1]:.3f})")
    print(f"failed: {len(rows) - len(done)}; {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
