"""Does rebuilding the forward's launch on every timed call inflate a short forward's time?

For each shape, times one forward config (default: the shipped config for this GPU, else the
heuristic default) with the tuner's final re-timing (``flashtune.autotune.measure.retime``,
the house protocol, interleaved, five rounds) in two ways:
- ``prepared``: the search's launch since 76dd0a8 (a FwdLaunch built once per config);
- ``per_call``: the earlier one (``attn_fwd``, which builds the launch on every call);
each on an idle host and with ``--burn`` processes spinning on the CPU (the compile pool's
load, roughly), beside a plain ``time_fn`` of the prepared launch. Prints a table and
writes JSON.

    python benchmarks/experiments/retime_probe.py --out $OUT/retime_probe.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import environment  # noqa: E402

from flashtune.autotune.measure import Bench, retime  # noqa: E402
from flashtune.kernels import attn_fwd as fwd_mod  # noqa: E402
from flashtune.kernels.config import default_fwd  # noqa: E402
from flashtune.problem import Problem  # noqa: E402
from flashtune.timing import time_fn  # noqa: E402

SHAPES = {  # the three entries whose re-timing read 1.5-1.9x their trials (session 23)
    "32x16x512x128c": Problem(32, 16, 16, 512, 512, 128, "bf16", True),
    "32x16x512x128": Problem(32, 16, 16, 512, 512, 128, "bf16", False),
    "32x12x512x64c": Problem(32, 12, 12, 512, 512, 64, "bf16", True),
    "1x16x16384x128c": Problem(1, 16, 16, 16384, 16384, 128, "bf16", True),  # a long control
    "tiny": Problem(1, 2, 2, 40, 40, 32, "bf16", True),  # for --device cpu
}


class PerCall(Bench):
    """The search's forward launch before 76dd0a8: attn_fwd, rebuilt on every call."""

    def launch(self, direction: str, config: Any) -> Any:
        q, k, v, kw = self.q, self.k, self.v, self.kw
        return lambda: fwd_mod.attn_fwd(q, k, v, config=config, **kw)


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def config_for(p: Problem, device: str) -> Any:
    if device == "cpu":
        return default_fwd(p)
    import torch

    from hopper_fwd_consumers import shipped_config

    return shipped_config(p, torch.cuda.get_device_name()) or default_fwd(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--burn", type=int, default=14, help="CPU-spinning processes (0: none)")
    ap.add_argument("--shapes", default=",".join(k for k in SHAPES if k != "tiny"),
                    help="comma-separated labels")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under the interpreter")
    args = ap.parse_args()
    rows = []
    for label in args.shapes.split(","):
        p = SHAPES[label]
        cfg = config_for(p, args.device)
        row: dict[str, Any] = {"shape": label, "config": repr(cfg), "ms": {}}
        for busy in (False, True):
            stop = mp.Event()
            burners = [mp.Process(target=_spin, args=(stop,), daemon=True)
                       for _ in range(args.burn if busy else 0)]
            for b in burners:
                b.start()
            time.sleep(0.2 if burners else 0)
            try:
                for name, cls in (("prepared", Bench), ("per_call", PerCall)):
                    bench = cls(p, args.device)
                    (tm,) = retime(bench, "fwd", [cfg])
                    row["ms"][f"{name}{'_busy' if busy else ''}"] = tm.median_ms
                row["ms"]["time_fn" + ("_busy" if busy else "")] = \
                    time_fn(Bench(p, args.device).launch("fwd", cfg)).median_ms
            finally:
                stop.set()
                for b in burners:
                    b.join()
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "command": " ".join(sys.argv), "rows": rows}, f,
                  indent=1)
    cols = ["time_fn", "prepared", "per_call", "time_fn_busy", "prepared_busy", "per_call_busy"]
    print(f"{'shape':18}" + "".join(f"{c:>15}" for c in cols))
    for r in rows:
        print(f"{r['shape']:18}" + "".join(f"{r['ms'].get(c, float('nan')):15.4f}" for c in cols))


if __name__ == "__main__":
    main()
