"""Where the Hopper backward's local-memory spills sit in its source, built for sm_90
without a GPU.

``ptxas -v`` (``bwd_spills.py``) gives spill bytes per thread, not where they are: a
spilled value set up once and reloaded once per query tile costs little, one stored and
reloaded inside a product's dependency chain a lot. This builds one config through
``bwd_steps`` with the compile-only driver of ``benchmarks/probe_ptxas.py``, disassembles
the cubin with the ``nvdisasm`` Triton ships (``-g``: with the source line of each
instruction) and counts the ``STL`` (spill store) and ``LDL`` (reload) instructions per
source line. Counts are of instructions in the code, not of executions.

    PYTHONPATH=<triton 3.6>:<tree>:<tree>/benchmarks python3 \\
        benchmarks/experiments/spill_lines.py --shape 4,16,16,4096,128,1 \\
        --config hopper_block_m=64,hopper_stages=3,hopper_regs=232 [--free]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
from probe_ptxas import BUILT_CUBIN, _install_compile_only

_install_compile_only()

import triton  # noqa: E402

import flashtune.kernels.attn_bwd_hopper as H  # noqa: E402
from flashtune.kernels.attn_bwd import bwd_steps  # noqa: E402
from flashtune.kernels.config import BWD_HOPPER, BwdConfig  # noqa: E402
from flashtune.problem import default_scale  # noqa: E402

H._sm_count = lambda index: 132


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4,16,16,4096,128,1",
                    help="batch,heads_q,heads_kv,seqlen,head_dim,causal")
    ap.add_argument("--config", default="", help="hopper_* fields, name=value,...")
    ap.add_argument("--free", action="store_true", help="the free dQ order (default: fixed)")
    args = ap.parse_args()
    b, hq, hk, s, d, causal = (int(x) for x in args.shape.split(","))
    fields = dict(kv.split("=") for kv in args.config.split(",") if kv)
    cfg = BwdConfig(variant=BWD_HOPPER, **{k: int(v) for k, v in fields.items()})
    q, do, o = (torch.empty(b, hq, s, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.empty(b, hk, s, d, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.empty(b, hq, s)
    _, steps = bwd_steps(do, q, k, v, o, lse, causal=bool(causal), sm_scale=default_scale(d),
                         window=(-1, -1), softcap=0.0, config=cfg, deterministic=not args.free)
    for _, step in steps:
        step()
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                       "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(BUILT_CUBIN["_attn_bwd_hopper_kernel"])
        f.flush()
        sass = subprocess.run([exe, "-g", "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    where: tuple[str, int] = ("?", 0)
    counts: collections.Counter = collections.Counter()
    for line in sass.split("\n"):
        loc = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if loc:
            where = (os.path.basename(loc.group(1)), int(loc.group(2)))
        op = re.search(r"\b(STL|LDL)\b", line)
        if op:
            counts[(where, op.group(1))] += 1
    print(f"{args.shape} {cfg} {'free' if args.free else 'fixed'} order")
    for (src, op), n in sorted(counts.items()):
        print(f"  {op} x{n}  {src[0]}:{src[1]}")
    print(f"  {sum(counts.values())} spill instructions")


if __name__ == "__main__":
    main()
