"""Replay the body of ``tests/kernels/test_attention.py::
test_random_feasible_configs_across_standard_matrix[bwd]`` over several seeds on a GPU,
reporting every failing case (problem, config, error) rather than stopping at the first.

The test draws a random feasible backward config per shape of the standard matrix (batch
and heads cut to keep the fp32 reference small) and checks it against the reference under
the 2x rule. Use it when the test failed and its report was lost (a call cut short), or to
put more cases through a new knob than one test run does:

    timeout 175 python3 benchmarks/experiments/replay_random_bwd.py 150 101 102 103

The first argument is a time limit in seconds (no new case starts after it), the rest are
seeds.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from kernels.helpers import check_case, random_config  # noqa: E402

from flashtune.kernels.config import BWD_HOPPER, BwdConfig  # noqa: E402
from flashtune.problem import Problem  # noqa: E402
from flashtune.timing import standard_matrix  # noqa: E402


def main() -> None:
    t0 = time.time()
    limit = float(sys.argv[1])
    cases = failed = hopper = kv_regs = 0
    matrix = standard_matrix()
    for seed in (int(x) for x in sys.argv[2:]):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        for i in range(30):
            if time.time() - t0 > limit:
                break
            m = matrix[i % len(matrix)]
            p = Problem(1, min(m.heads_q, 4), min(m.heads_kv, 4) if m.heads_kv < m.heads_q
                        else min(m.heads_q, 4), min(m.seqlen_q, 4096), min(m.seqlen_k, 4096),
                        m.head_dim, m.dtype, m.causal)
            cfg = random_config(BwdConfig, p, rng, max_block=256, max_stages=5)
            cases += 1
            hopper += cfg.variant == BWD_HOPPER
            kv_regs += cfg.hopper_kv_regs
            try:
                check_case(p, "cuda", bwd=cfg, backward=True, gen=gen)
            except Exception as e:  # every failure is reported, the replay goes on
                failed += 1
                print(f"FAIL seed={seed} i={i} {p} {cfg}\n  {type(e).__name__}: "
                      f"{str(e)[:600]}", flush=True)
    print(f"replay: {cases} cases ({hopper} Hopper, {kv_regs} with hopper_kv_regs=1), "
          f"{failed} failed, {time.time() - t0:.0f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
