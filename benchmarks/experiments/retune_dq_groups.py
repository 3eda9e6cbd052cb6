"""Re-search shipped Hopper backward entries around their winners with ``hopper_dq_groups``.

Session 36 measured the fixed order's dQ staged in column groups of eight
(``hopper_dq_groups=1``) at 0.93-0.99x cuDNN on 128-row tiles at D=64 and 4k-16k keys,
against 0.88-0.91x for the rows' staging of the same tiles (H200; BENCHMARKS.md issue 13,
session 36). The shipped entries were searched before the knob existed, and a short
search that starts from them polishes the knob last (it is the last field), so this runs
the tuner over a narrowed space per entry: the winner's tiles, stages, walk and stagger,
with ``hopper_dq_groups`` in {0, 1} and every consumer register count: six points on the
grid sampler, every one gated, and the best re-timed side by side (the tuner's own final
round) with the winner as it was shipped among them. Results go to the tuning database
(``FLASHTUNE_DB``), to be exported with ``export --fresh``.

    FLASHTUNE_DB=$OUT/g.db timeout 400 python3 benchmarks/experiments/retune_dq_groups.py \\
        --head-dim 64 --out $OUT/retune.json

Entries go longest first (``--head-dim 128``: 26 H200 entries in 369 s in session 36), so
a run cut short by its time limit has re-searched the costliest keys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flashtune.autotune.space import SearchSpace  # noqa: E402
from flashtune.autotune.tuner import tune  # noqa: E402
from flashtune.kernels.config import BWD_HOPPER, config_from_dict, config_to_dict  # noqa: E402
from flashtune.problem import Problem  # noqa: E402

FIXED = ("hopper_block_m", "hopper_block_n", "hopper_stages", "hopper_stagger", "hopper_walk",
         "hopper_dq_fixed", "pre_block_m")


def entries(device: str, head_dim: int | None) -> list[dict]:
    path = os.path.join(os.path.dirname(__file__), "..", "..", "flashtune", "data",
                        "shipped.json")
    with open(path) as f:
        out = []
        for e in json.load(f)["entries"]:
            if (e["direction"] == "bwd" and e["config"].get("variant") == BWD_HOPPER
                    and e["device"]["name"] == device
                    and (head_dim is None or e["problem"]["head_dim"] == head_dim)
                    # the knob stages the fixed order: entries that run it
                    and (e["problem"].get("deterministic", True)
                         or e["config"].get("hopper_dq_fixed"))):
                out.append(e)
    # Longest first: a run cut short by its time limit has searched the costliest keys.
    return sorted(out, key=lambda e: -e["example"]["seqlen_k"])


def problem_of(e: dict) -> Problem:
    x = e["example"]
    return Problem(x["batch"], x["heads_q"], x["heads_kv"], x["seqlen_q"], x["seqlen_k"],
                   x["head_dim"], x["dtype"], x["causal"], tuple(x["window"]), x["softcap"],
                   deterministic=e["problem"].get("deterministic", True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    rows = []
    for e in entries(device, args.head_dim):
        p = problem_of(e)
        cfg = config_from_dict("bwd", e["config"])
        fixed = {n: getattr(cfg, n) for n in FIXED}
        space = SearchSpace.full("bwd").restrict(variant=BWD_HOPPER, hopper_dq_groups=(0, 1),
                                                 **fixed)
        # Every field a Hopper config does not use stays at its default (one spelling).
        space = space.restrict(**{n: getattr(type(cfg)(), n) for n, _ in space.choices
                                  if n not in fixed and n not in ("variant", "hopper_regs",
                                                                  "hopper_dq_groups")})
        t0 = time.perf_counter()
        r = tune(p, "bwd", space=space, sampler="grid", shipped_seeds=False)
        row = dict(problem=str(p), shipped=e["config"], shipped_median_ms=e["median_ms"],
                   winner=config_to_dict(r.config),
                   median_ms=r.median_ms, seconds=time.perf_counter() - t0)
        rows.append(row)
        print(f"{p}: shipped {e['median_ms']:.3f} ms -> {r.median_ms:.3f} ms "
              f"groups={row['winner'].get('hopper_dq_groups')} "
              f"regs={row['winner'].get('hopper_regs')} ({row['seconds']:.0f} s)", flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
