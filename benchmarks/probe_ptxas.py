"""Build forward kernels for Hopper (sm_90) without a GPU and record which ones crash ptxas.

Triton compiles all the way to a cubin on any machine: the target is given, not asked of
a device, and ptxas ships inside the Triton wheel. This script swaps Triton's active
driver for one that only answers "sm_90", turns every launch into a compile-only warmup,
and walks a grid of use_tma=1 forward configs through the real host launcher. Run it
under each Triton version whose ptxas you need to know about (for example with that
version's wheel unpacked first on PYTHONPATH); the feasibility rule in
flashtune/kernels/config.py comes from these records. It never times anything.

``--bwd`` builds the backward instead, once per variant (``BwdConfig.variant``; atomic dQ
with pointer atomics and with the descriptor reduce-add), dense and packed, and records
which atomic adds its kernels' PTX holds (``cp.reduce.async.bulk.tensor`` is the TMA
reduce-add, ``red.global`` the pointer atomics).

    python benchmarks/probe_ptxas.py --out ptxas.jsonl --workers 2
    python benchmarks/probe_ptxas.py --bwd --out bwd_sm90.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import re
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


# PTX and cubin of every kernel the compile-only launches built, by kernel name (the
# latest build).
BUILT_PTX: dict[str, str] = {}
BUILT_CUBIN: dict[str, bytes] = {}
# How a dK/dV kernel adds dQ, by the PTX instruction that does it (an instruction starts
# its line, after a predicate if any: "shared.global" is not "red.global").
DQ_ADDS = {"cp.reduce.async.bulk.tensor": r"^\s*(@\S+\s+)?cp\.reduce\.async\.bulk\.tensor",
           "red.global": r"^\s*(@\S+\s+)?red\.global"}


def _install_compile_only() -> None:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import flashtune.kernels.attn_fwd as fwd

    driver.set_active(_Sm90Only())
    run = JITFunction.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        kernel = run(self, *args, grid=grid, warmup=True, **kw)
        BUILT_PTX[self.fn.__name__] = kernel.asm.get("ptx", "")
        BUILT_CUBIN[self.fn.__name__] = kernel.asm.get("cubin", b"")
        return kernel

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


def build_bwd(variant: int, tma: int, packed: bool, d: int = 64) -> dict[str, Any]:
    """Build backward ``variant`` (compile-only, sm_90) at its default tiles for a small
    causal GQA problem; the record says which launches built and how dQ is added."""
    import dataclasses

    import torch

    from flashtune.kernels.attn_bwd import bwd_steps
    from flashtune.kernels.attn_fwd import Packed
    from flashtune.kernels.config import BWD_ATOMIC, default_bwd
    from flashtune.problem import Problem

    det = variant != BWD_ATOMIC
    p = Problem(2, 4, 2, 256, 256, d, causal=True, deterministic=det)
    cfg = dataclasses.replace(default_bwd(p, variant), **({"dkdv_atomic_tma": tma}
                                                           if tma else {}))
    rec: dict[str, Any] = {"variant": variant, "tma": tma, "packed": packed, "d": d}
    if packed:
        cu = torch.tensor([0, 100, 356], dtype=torch.int32)
        q, k = (torch.empty(356, h, d, dtype=torch.bfloat16) for h in (4, 2))
        lse, pk = torch.empty(4, 356), Packed(cu, cu, 256, 256)
    else:
        q, k = (torch.empty(2, h, 256, d, dtype=torch.bfloat16) for h in (4, 2))
        lse, pk = torch.empty(2, 4, 256), None
    BUILT_PTX.clear()
    try:
        _, steps = bwd_steps(torch.empty_like(q), q, k, torch.empty_like(k), torch.empty_like(q),
                             lse, causal=True, sm_scale=0.1, window=(-1, -1), softcap=0.0,
                             config=cfg, packed=pk, deterministic=det)
        for _, launch in steps:
            launch()
        rec["result"] = "ok"
    except Exception as e:  # noqa: BLE001 - the record is the point
        rec["result"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    rec["kernels"] = sorted(BUILT_PTX)
    ptx = "\n".join(BUILT_PTX.values())
    rec["dq_adds"] = [op for op, pat in DQ_ADDS.items() if re.search(pat, ptx, re.M)]
    return rec


def bwd_jobs() -> list[tuple[int, int, bool]]:
    from flashtune.kernels.config import BWD_ATOMIC, BWD_ONE_LAUNCH, BWD_TWO_KERNEL

    return [(v, t, pk) for v, t in ((BWD_TWO_KERNEL, 0), (BWD_ATOMIC, 0), (BWD_ATOMIC, 1),
                                    (BWD_ONE_LAUNCH, 0)) for pk in (False, True)]


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
    ap.add_argument("--bwd", action="store_true", help="build the backward variants instead")
    args = ap.parse_args()
    import triton

    if args.bwd:
        _install_compile_only()
        with open(args.out, "w") as f:
            f.write(json.dumps({"triton": triton.__version__, "target": "sm_90"}) + "\n")
            for job in bwd_jobs():
                rec = build_bwd(*job)
                print(json.dumps(rec), file=sys.stderr, flush=True)
                f.write(json.dumps(rec) + "\n")
        return

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
