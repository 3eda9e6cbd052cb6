"""Three consumer warpgroups (192-row tiles) in the Hopper forward at D=64, against the
shipped tuned config and cuDNN.

For each D=64 shape of the standard matrix (or ``--shapes all``), times the inference
forward (no grad) of:
- ``shipped``: the config flashtune/data/shipped.json holds for this GPU and problem key
  (whatever its kernels hash: the config, not the entry, is what is compared);
- three-consumer Hopper configs (``block_m=192``), some with ``block_n=128``, which the
  feasibility model rejects (it predicts spills at 160 registers; ptxas reported 84-900
  bytes); they run here with the model's overhead lowered, to measure what it rejects;
beside cuDNN, in one process under the house protocol (DESIGN.md). Every candidate's
output is checked against cuDNN's first (max |diff| <= 2e-2); a wrong one is reported,
never timed. Prints cuDNN ms / ms per shape and the geomeans; writes JSON.

    python benchmarks/experiments/hopper_fwd_consumers.py --out $OUT/consumers.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import _label, environment  # noqa: E402
from fwd_default_scan import time_configs  # noqa: E402

from flashtune.kernels import config as kconfig  # noqa: E402
from flashtune.kernels.config import HOPPER, BwdConfig, FwdConfig, config_from_dict  # noqa: E402
from flashtune.problem import Problem, ProblemKey  # noqa: E402
from flashtune.timing import standard_matrix  # noqa: E402

T3 = FwdConfig(variant=HOPPER, block_m=192, block_n=64, num_stages=3, consumer_regs=160)
CANDIDATES = {
    "c3_n64_s3": T3,
    "c3_n64_s4": dataclasses.replace(T3, num_stages=4),
    "c3_n64_s3_r152": dataclasses.replace(T3, consumer_regs=152),
    "c3_n64_s3_pers": dataclasses.replace(T3, persistent=1, tile_order=1),
    "c3_n128_s2": dataclasses.replace(T3, block_n=128, num_stages=2),
    "c3_n128_s2_r152": dataclasses.replace(T3, block_n=128, num_stages=2, consumer_regs=152),
    "c3_n128_s3": dataclasses.replace(T3, block_n=128),
    "c3_n128_s2_pers": dataclasses.replace(T3, block_n=128, num_stages=2, persistent=1,
                                           tile_order=1),
}


def shipped_config(p: Problem, device_name: str, direction: str = "fwd",
                   ) -> FwdConfig | BwdConfig | None:
    """The committed shipped layer's config for ``p``'s key on this device, if any."""
    path = os.path.join(os.path.dirname(kconfig.__file__), "..", "data", "shipped.json")
    with open(path) as f:
        entries = json.load(f)["entries"]
    want = p.key(direction)
    for e in entries:
        if e["direction"] == direction and e["device"]["name"] == device_name \
                and ProblemKey.from_dict({**e["problem"], "direction": direction}) == want:
            return config_from_dict(direction, e["config"])
    return None


def scan(p: Problem, warmup: float, rep: float) -> dict[str, Any]:
    configs: dict[str, FwdConfig] = {}
    shipped = shipped_config(p, torch.cuda.get_device_name())
    if shipped is not None:
        configs["shipped"] = shipped
    configs.update(CANDIDATES)
    row: dict[str, Any] = {"label": _label(p), "problem": p.as_dict(),
                           "configs": {n: dataclasses.asdict(c) for n, c in configs.items()}}
    row.update(time_configs(p, configs, warmup, rep))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--warmup", type=float, default=25.0)
    ap.add_argument("--rep", type=float, default=100.0)
    ap.add_argument("--shapes", choices=("d64", "all"), default="d64")
    ap.add_argument("--overhead", type=int, default=24,
                    help="the register model's per-thread overhead in this run (the "
                         "product's is config._REG_OVERHEAD)")
    args = ap.parse_args()
    kconfig._REG_OVERHEAD = args.overhead  # measure what the product's model rejects
    rows = []
    for p in standard_matrix():
        if args.shapes == "d64" and p.head_dim != 64:
            continue
        row = scan(p, args.warmup, args.rep)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "command": " ".join(sys.argv),
                   "candidates": {k: dataclasses.asdict(c) for k, c in CANDIDATES.items()},
                   "rows": rows}, f, indent=1)
    names = ["shipped", *CANDIDATES]
    print(f"{'shape':30s}" + "".join(f"{n[:13]:>14s}" for n in names) + "  (cuDNN ms / ms)")
    logs: dict[str, list[float]] = {n: [] for n in names}
    best_new: list[float] = []
    for r in rows:
        ms = r["ms"]
        ratios = {n: ms["cudnn"] / ms[n] for n in names if n in ms}
        for n, x in ratios.items():
            logs[n].append(math.log(x))
        new = [x for n, x in ratios.items() if n != "shipped"]
        if new and "shipped" in ratios:
            best_new.append(math.log(max(new) / ratios["shipped"]))
        print(f"{r['label']:30s}" + "".join(f"{ratios[n]:14.3f}" if n in ratios else
                                            f"{'-':>14s}" for n in names))
    print(f"{'geomean':30s}" + "".join(
        f"{math.exp(sum(v) / len(v)):14.3f}" if len(v) == len(rows) else f"{'-':>14s}"
        for v in logs.values()))
    if best_new:
        print(f"best three-consumer / shipped, geomean over {len(best_new)} shapes: "
              f"{math.exp(sum(best_new) / len(best_new)):.3f}")


if __name__ == "__main__":
    main()
