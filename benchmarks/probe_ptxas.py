"""Build forward kernels for Hopper (sm_90) without a GPU and record which ones crash ptxas.

Triton compiles all the way to a cubin on any machine: the target is given, not asked of
a device, and ptxas ships inside the Triton wheel. This script swaps Triton's active
driver for one that only answers "sm_90", turns every launch into a compile-only warmup,
and walks a grid of use_tma=1 forward configs through the real host launcher. Run it
under each Triton version whose ptxas you need to know about (for example with that
version's wheel unpacked first on PYTHONPATH); the feasibility rule in
flashtune/kernels/config.py comes from these records. It never times anything.

    python benchmarks/probe_ptxas.py --out ptxas.jsonl --workers 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
from typing import Any

BLOCK_M = (16, 32, 64, 128, 256)
BLOCK_N = (16, 32, 64, 128, 256)
WARPS = (4, 8, 16)
STAGES = (1, 2, 3, 4, 5)
HEAD_DIMS = (64, 128)


class _Sm90Only:
    """Enough of a Triton driver for the JIT to pick a target and compile for it."""

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


def _install_compile_only() -> None:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import flashtune.kernels.attn_fwd as fwd

    driver.set_active(_Sm90Only())
    run = JITFunction.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        return run(self, *args, grid=grid, warmup=True, **kw)

    JITFunction.run = compile_only  # type: ignore[method-assign]
    # CPU tensors are 16-byte aligned and contiguous; let the launcher build descriptors.
    fwd.tma_ok = lambda *ts: True  # type: ignore[assignment]


def _build(job: tuple[int, int, int, int, int, bool]) -> dict[str, Any]:
    import torch

    from flashtune.kernels.attn_fwd import attn_fwd
    from flashtune.kernels.config import FwdConfig

    bm, bn, warps, stages, d, causal = job
    rec: dict[str, Any] = {"bm": bm, "bn": bn, "warps": warps, "stages": stages, "d": d,
                           "causal": causal}
    cfg = FwdConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, use_tma=1)
    q = torch.empty(1, 2, 256, d, dtype=torch.bfloat16)
    try:
        attn_fwd(q, q, q, causal=causal, sm_scale=0.1, window=(-1, -1), softcap=0.0,
                 config=cfg)
        rec["result"] = "ok"
    except Exception as e:  # noqa: BLE001 - the record is the point
        msg = str(e)
        if "error code -11" in msg:
            rec["result"] = "ptxas crash (SIGSEGV)"
        else:
            # First line only: the rest is the PTX dump and a temporary file's path.
            rec["result"] = f"{type(e).__name__}: {msg.strip().splitlines()[0][:160]}"
    return rec


def grid() -> list[tuple[int, int, int, int, int, bool]]:
    """Configs the feasibility model accepts, ignoring the ptxas rule under test."""
    from flashtune.kernels.config import FwdConfig, is_feasible
    from flashtune.problem import Problem

    jobs = []
    for d, causal in itertools.product(HEAD_DIMS, (True, False)):
        p = Problem(1, 2, 2, 256, 256, d, causal=causal)
        for bm, bn, w, st in itertools.product(BLOCK_M, BLOCK_N, WARPS, STAGES):
            # use_tma=0 stands in for the TMA config: same tile, warp, smem and register rules.
            if is_feasible(FwdConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st), p)[0]:
                jobs.append((bm, bn, w, st, d, causal))
    return jobs


def _init() -> None:
    _install_compile_only()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON lines, one record per config")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    import triton

    jobs = grid()
    print(f"triton {triton.__version__}: {len(jobs)} configs", file=sys.stderr, flush=True)
    with mp.get_context("spawn").Pool(args.workers, initializer=_init) as pool, \
            open(args.out, "w") as f:
        f.write(json.dumps({"triton": triton.__version__, "target": "sm_90"}) + "\n")
        for n, rec in enumerate(pool.imap(_build, jobs), 1):
            f.write(json.dumps(rec) + "\n")
            if n % 100 == 0:
                print(f"{n}/{len(jobs)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
