"""Registers and spills of the Hopper backward, built for sm_90 without a GPU.

Session 34's ncu profile of the fixed-order backward at 4x32/8x4096x128 (GQA 4) found about
25 local-memory loads and stores per query tile in consumer 0, and none at 4x32x4096x128:
consumer 1 then waited on it (7% of all samples) and the kernel ran 15% slower than its
free order. This builds the kernel through ``bwd_steps`` with the compile-only driver of
``benchmarks/probe_ptxas.py`` and runs the PTX through the ptxas that Triton ships, with
``-v``, so a change's effect on spills can be seen on the CPU before a GPU is lent.

    PYTHONPATH=<triton 3.6>:<tree>:<tree>/benchmarks python3 \\
        benchmarks/experiments/bwd_spills.py [--module path/to/attn_bwd_hopper.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import torch
from probe_ptxas import BUILT_PTX, _install_compile_only

_install_compile_only()

import flashtune.kernels as kpkg  # noqa: E402
import flashtune.kernels.attn_bwd_hopper as H  # noqa: E402
from flashtune.kernels.attn_bwd import bwd_steps  # noqa: E402
from flashtune.kernels.config import BWD_HOPPER, BwdConfig  # noqa: E402
from flashtune.problem import default_scale  # noqa: E402

H._sm_count = lambda index: 132

# (batch, heads_q, heads_kv, seqlen, head_dim, causal, block_m, stages, stagger)
CASES = [(4, 32, 8, 4096, 128, False, 64, 2, 0), (4, 32, 8, 4096, 128, True, 64, 2, 1),
         (4, 32, 8, 4096, 128, False, 64, 3, 0), (4, 32, 8, 4096, 64, False, 64, 2, 1),
         (4, 32, 8, 4096, 64, True, 64, 2, 1), (4, 32, 8, 4096, 64, False, 128, 2, 1),
         (4, 32, 8, 4096, 64, True, 128, 2, 1), (4, 32, 32, 4096, 64, False, 128, 2, 1),
         (4, 32, 32, 4096, 128, False, 64, 2, 1), (4, 16, 16, 4096, 128, True, 64, 1, 1)]


def use_module(path: str) -> None:
    """Build the Hopper backward from ``path``, a copy of ``attn_bwd_hopper.py``, from now on."""
    spec = importlib.util.spec_from_file_location("_bwd_variant", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    mod._sm_count = lambda index: 132
    sys.modules["flashtune.kernels.attn_bwd_hopper"] = mod
    kpkg.attn_bwd_hopper = mod


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_spills(sass: str) -> list[tuple[int, int, int]]:
    """(wgmma instructions, spill stores, spill loads) of each innermost loop of ``sass``
    (cuobjdump's listing) that issues 8 or more wgmma: the consumers' query-tile loops,
    where a spill costs every tile; the rest of a kernel's spills run once per head.
    Loops are backward branches, less the mbarrier waits' retry stubs that ptxas puts
    past the main code (tiny self-loops after the last wgmma, each branching back)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines())
           if m]
    last_mma = max(a for a, t in ins if "HGMMA" in t)
    back = [(int(m.group(1), 16), a) for a, t in ins
            if (m := re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", t)) and int(m.group(1), 16) < a]
    stubs = min([a for lo, a in back if a > last_mma and a - lo <= 0x40] or [ins[-1][0] + 1])

    def count(lo: int, hi: int, pattern: str) -> int:
        return sum(1 for a, t in ins if lo <= a <= hi and re.search(pattern, t))

    mma = {(lo, hi) for lo, hi in back if hi < stubs and count(lo, hi, "HGMMA") >= 8}
    inner = sorted(x for x in mma if not any(o != x and x[0] <= o[0] and o[1] <= x[1]
                                             for o in mma))
    return [(count(lo, hi, "HGMMA"), count(lo, hi, r"\bSTL"), count(lo, hi, r"\bLDL"))
            for lo, hi in inner]


def ptxas_report(ptx: str, loops: bool = False) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        cubin = os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([_tool("ptxas"), "-v", "--gpu-name", "sm_90a", src, "-o", cubin],
                           capture_output=True, text=True)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout if loops else ""
    text = r.stdout + r.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    out = f"regs {','.join(regs)} spill st/ld {spills}"
    if loops:
        out += " | in the query-tile loops (wgmma, STL, LDL instructions): " + ", ".join(
            f"{n}/{st}/{ld}" for n, st, ld in loop_spills(sass))
    return out


def shipped_report(loops: bool = False) -> None:
    """Registers and spills of every shipped Hopper backward entry, in its own order."""
    import json

    import flashtune
    from flashtune.kernels.config import config_from_dict
    path = os.path.join(os.path.dirname(flashtune.__file__), "data", "shipped.json")
    with open(path) as f:
        entries = json.load(f)["entries"]
    for e in entries:
        if e["direction"] != "bwd" or e["config"].get("variant") != BWD_HOPPER:
            continue
        x, cfg = e["example"], config_from_dict("bwd", e["config"])
        q, do, o = (torch.empty(x["batch"], x["heads_q"], x["seqlen_q"], x["head_dim"],
                                dtype=torch.bfloat16) for _ in range(3))
        k, v = (torch.empty(x["batch"], x["heads_kv"], x["seqlen_k"], x["head_dim"],
                            dtype=torch.bfloat16) for _ in range(2))
        BUILT_PTX.clear()
        _, steps = bwd_steps(do, q, k, v, o, torch.empty(q.shape[:3]), causal=x["causal"],
                             sm_scale=default_scale(x["head_dim"]), window=tuple(x["window"]),
                             softcap=x["softcap"], config=cfg,
                             deterministic=e["problem"].get("deterministic", True))
        for _, step in steps:
            step()
        print(f"{e['device']['name'][:11]:11s} {x['batch']}x{x['heads_q']}/{x['heads_kv']}x"
              f"{x['seqlen_q']}x{x['head_dim']}{' causal' if x['causal'] else ''}"
              f"{' win' if x['window'] != [-1, -1] else ''} m{cfg.hopper_block_m} "
              f"n{cfg.hopper_block_n} s{cfg.hopper_stages} r{cfg.hopper_regs} "
              f"w{cfg.hopper_walk}{' tma' if cfg.hopper_dkdv_tma else ''}"
              f"{f' kv_rep={cfg.hopper_kv_rep}' if cfg.hopper_kv_rep > 1 else ''}"
              f"{'' if e['problem'].get('deterministic', True) else ' free'}: "
              f"{ptxas_report(BUILT_PTX['_attn_bwd_hopper_kernel'], loops)}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--module", default=None, help="a copy of attn_bwd_hopper.py to build")
    ap.add_argument("--free", action="store_true", help="also the free order")
    ap.add_argument("--groups", action="store_true",
                    help="CASES with hopper_dq_groups=1 (the fixed order's column groups)")
    ap.add_argument("--frag", action="store_true",
                    help="CASES with hopper_dq_frag=1 (dQ staged in register order)")
    ap.add_argument("--store-first", type=int, default=0,
                    help="hopper_dq_store_first for CASES (with --frag)")
    ap.add_argument("--cases", default=None, help="indices into CASES, comma-separated")
    ap.add_argument("--persist", action="store_true",
                    help="CASES with hopper_persist=1 (unmasked cases only)")
    ap.add_argument("--kv-rep", type=int, default=1, choices=(1, 2, 4),
                    help="CASES with hopper_kv_rep (GQA cases whose group it divides)")
    ap.add_argument("--dkdv-tma", action="store_true",
                    help="CASES with hopper_dkdv_tma=1 (dK and dV stored with TMA)")
    ap.add_argument("--loops", action="store_true",
                    help="also count the spill instructions inside the consumers' query-tile "
                    "loops (from the SASS; the totals include per-head prologues and epilogues)")
    ap.add_argument("--save", default=None, help="a folder to write each case's PTX to")
    ap.add_argument("--shipped", action="store_true",
                    help="the shipped layer's Hopper backward entries instead of CASES")
    args = ap.parse_args()
    if args.module:
        use_module(args.module)
    if args.shipped:
        shipped_report(args.loops)
        return
    picked = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    for b, hq, hk, s, d, causal, m, st, stagger in picked:
        for det in (True, False) if args.free else (True,):
            q, do, o = (torch.empty(b, hq, s, d, dtype=torch.bfloat16) for _ in range(3))
            k, v = (torch.empty(b, hk, s, d, dtype=torch.bfloat16) for _ in range(2))
            lse = torch.empty(b, hq, s)
            cfg = BwdConfig(variant=BWD_HOPPER, hopper_block_m=m, hopper_block_n=128,
                            hopper_stages=st, hopper_regs=240, hopper_stagger=stagger,
                            hopper_dq_groups=int(args.groups and det),
                            hopper_dq_frag=int(args.frag),
                            hopper_dq_store_first=args.store_first if det else 0,
                            hopper_persist=int(args.persist and not causal),
                            hopper_dkdv_tma=int(args.dkdv_tma),
                            hopper_kv_rep=args.kv_rep if (hq // hk) % args.kv_rep == 0 else 1)
            BUILT_PTX.clear()
            _, steps = bwd_steps(do, q, k, v, o, lse, causal=causal, sm_scale=default_scale(d),
                                 window=(-1, -1), softcap=0.0, config=cfg, deterministic=det)
            for _, step in steps:
                step()
            ptx = BUILT_PTX.get("_attn_bwd_hopper_kernel", "")
            if args.save:
                os.makedirs(args.save, exist_ok=True)
                name = f"{b}x{hq}x{hk}x{s}x{d}{'c' if causal else ''}_{'det' if det else 'free'}"
                with open(os.path.join(args.save, name + ".ptx"), "w") as f:
                    f.write(ptx)
            print(f"{b}x{hq}/{hk}x{s}x{d}{' causal' if causal else ''} m{m} s{st} o{stagger} "
                  f"{'det' if det else 'free'}{' groups' if args.groups and det else ''}"
                  f"{' frag' if args.frag else ''}"
                  f"{f' store_first={args.store_first}' if args.store_first and det else ''}"
                  f"{' dkdv_tma' if args.dkdv_tma else ''}"
                  f"{f' kv_rep={cfg.hopper_kv_rep}' if cfg.hopper_kv_rep > 1 else ''}: "
                  f"{ptxas_report(ptx, args.loops)}", flush=True)


if __name__ == "__main__":
    main()
