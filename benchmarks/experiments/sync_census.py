"""Where the Hopper kernels' partition barriers come from, read from their PTX (sm_90a),
built on the CPU without a GPU (compile facts, not timings).

Gluon (Triton 3.6) lowers every ``mbarrier.arrive`` to a ``bar.sync`` over the arriving
partition's warps followed by one thread's arrive, and its shared-memory analysis adds
more ``bar.sync``s of its own. Inside a consumer's key loop each one holds the
warpgroup's four warps together. This prints, per kernel source line, how many
``bar.sync`` / ``barrier.sync`` instructions the PTX attributes to it (the ``.loc`` in
force), beside the mbarrier arrives and waits and the wgmma waits of that line, so a
change to the synchronisation can be counted before a GPU is lent.

    PYTHONPATH=<triton 3.6>:<tree>:<tree>/benchmarks python3 \\
        benchmarks/experiments/sync_census.py fwd 2,32,32,8192,64,0 \\
        --config block_m=192,block_n=128,num_stages=3,consumer_regs=160,persistent=1,defer_o=1
    ... sync_census.py bwd 4,16,16,4096,128,0 --config hopper_block_m=64,hopper_dq_groups=1 \\
        [--module a/copy/of/attn_bwd_hopper.py]
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
from bwd_spills import use_module  # installs the compile-only driver
from probe_ptxas import BUILT_PTX

import flashtune.kernels.attn_bwd_hopper as BH
import flashtune.kernels.attn_fwd_hopper as FH
from flashtune.kernels.attn_bwd import bwd_steps
from flashtune.kernels.attn_fwd import attn_fwd
from flashtune.kernels.config import BWD_HOPPER, HOPPER, BwdConfig, FwdConfig
from flashtune.problem import default_scale

FH._sm_count = BH._sm_count = lambda index: 132
FH._l2_bytes = lambda index: 50 * 2**20

KINDS = {"bar.sync": re.compile(r"\b(bar|barrier)\.sync\b"),
         "arrive": re.compile(r"mbarrier\.arrive"),
         "wait": re.compile(r"mbarrier\.try_wait"),
         "wgmma.wait": re.compile(r"wgmma\.wait_group")}
LOC = re.compile(r"\.loc\s+\d+\s+(\d+)\s+\d+\s*//\s*(\S+?):(\d+)")


def census(ptx: str) -> dict[str, collections.Counter]:
    """Per source line (the innermost ``file:line`` of the ``.loc`` in force), the count
    of each kind of instruction."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    where = "?"
    for line in ptx.splitlines():
        m = LOC.search(line)
        if m:
            where = f"{m.group(2)}:{m.group(3)}"
            continue
        for kind, rx in KINDS.items():
            if rx.search(line):
                out[where][kind] += 1
    return out


def _fields(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def build(direction: str, shape: str, config: str, deterministic: bool) -> str:
    b, hq, hk, s, d, causal = (int(x) for x in shape.split(","))
    q, o, do = (torch.empty(b, hq, s, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.empty(b, hk, s, d, dtype=torch.bfloat16) for _ in range(2))
    BUILT_PTX.clear()
    if direction == "fwd":
        cfg = FwdConfig(**{"variant": HOPPER, **_fields(config)})
        attn_fwd(q, k, v, causal=bool(causal), sm_scale=default_scale(d), window=(-1, -1),
                 softcap=0.0, config=cfg)
        return BUILT_PTX["_attn_fwd_hopper_kernel"]
    cfg = BwdConfig(**{"variant": BWD_HOPPER, **_fields(config)})
    _, steps = bwd_steps(do, q, k, v, o, torch.empty(b, hq, s), causal=bool(causal),
                         sm_scale=default_scale(d), window=(-1, -1), softcap=0.0, config=cfg,
                         deterministic=deterministic)
    for _, step in steps:
        step()
    return BUILT_PTX["_attn_bwd_hopper_kernel"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("direction", choices=("fwd", "bwd"))
    ap.add_argument("shape", help="batch,heads_q,heads_kv,seqlen,head_dim,causal")
    ap.add_argument("--config", default="", help="field=value,... of FwdConfig / BwdConfig")
    ap.add_argument("--free", action="store_true", help="bwd: deterministic=False")
    ap.add_argument("--save", default=None, help="write the PTX here")
    ap.add_argument("--module", default=None,
                    help="bwd: a copy of attn_bwd_hopper.py to build instead")
    args = ap.parse_args()
    if args.module:
        use_module(args.module)
    ptx = build(args.direction, args.shape, args.config, not args.free)
    if args.save:
        with open(args.save, "w") as f:
            f.write(ptx)
    rows = census(ptx)
    print(f"{'source line':44s} " + " ".join(f"{k:>10s}" for k in KINDS))
    for where in sorted(rows, key=lambda w: (w.split(":")[0], int(w.split(":")[-1])
                                            if w != "?" else 0)):
        c = rows[where]
        if c["bar.sync"]:
            print(f"{where:44s} " + " ".join(f"{c[k]:10d}" for k in KINDS))
    total = sum(rows.values(), collections.Counter())
    print(f"{'total':44s} " + " ".join(f"{total[k]:10d}" for k in KINDS))


if __name__ == "__main__":
    main()
