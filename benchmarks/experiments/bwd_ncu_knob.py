"""One backward call with a shipped entry's config and one with some of its knobs changed,
inside a CUDA profiler range, for Nsight Compute on an sm90 GPU (the tuner's launches,
``flashtune.autotune.measure.Bench``, on the entry's example problem). Summarize the CSV
with ``ncu_rows.py``.

    FLASHTUNE_DB=/nonexistent/d/x.db ncu --profile-from-start off --clock-control none \\
        --section SpeedOfLight --section WarpStateStats --section LaunchStats \\
        --metrics sm__cycles_active.avg,sm__cycles_elapsed.avg --csv --page raw \\
        python3 benchmarks/experiments/bwd_ncu_knob.py 6 '{"hopper_dq_fixed": 1}' > e6.csv

Session 58 profiled ``hopper_pair`` (``bwd_causal_pairs.patch`` applied) this way, and the
fixed dQ order against the free one on a free entry's config (``hopper_dq_fixed``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys


def main(index: int, knobs: dict) -> None:
    import torch

    from flashtune.autotune.measure import Bench
    from flashtune.kernels.config import check, config_from_dict
    from flashtune.problem import Problem

    shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "flashtune",
                           "data", "shipped.json")
    e = json.load(open(shipped))["entries"][index]
    cfg = config_from_dict("bwd", e["config"])
    p = Problem.from_dict(e["example"])
    cand = dataclasses.replace(cfg, **knobs)
    check(cand, p)
    bench = Bench(p, "cuda")
    base, other = bench.launch("bwd", cfg), bench.launch("bwd", cand)
    for _ in range(3):  # compile and warm up outside the profiled range
        base()
        other()
    torch.cuda.synchronize()
    print(f"entry {index} {p}: the entry's config, then with {knobs}", file=sys.stderr)
    torch.cuda.profiler.start()
    base()
    other()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
