"""Where does ``tile_overlap`` leave the serial consumer? A ladder of shapes (issue 12,
session 39), each in a child process of its own, so that an illegal address in one shape
does not take the CUDA context of the next.

For each case ``[B, H, S, D, causal]`` (optionally a sixth element, a dict of config
fields over the base below: the shipped H200 config of the standard matrix's d64 S=512
row), the Hopper forward runs with ``tile_overlap=0`` and ``=1`` on the same N(0, 1)
inputs (SDPA layout, bf16, Sq = Sk), and the child prints how many (batch, head, row)
rows of O and of the LSE differ, the first one, the rows' positions within their
128-row query tile, and how many tiles hold one. Few programs' worth of tiles (B*H*S/128
<= 132 on the H200) exercise only the closing path; more walk the open-tile path too.

    timeout -k 10 170 python3 benchmarks/experiments/fwd_overlap_probe.py 60 \\
        '[[1,1,512,64,0],[32,32,512,64,0],[32,32,512,64,0,{"pingpong":1}]]'

A single case in this process, for ``compute-sanitizer``:

    compute-sanitizer --tool memcheck python3 benchmarks/experiments/fwd_overlap_probe.py \\
        one 32 32 512 64 0 '{}'
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

from flashtune.kernels.config import UNVERIFIED_ENV

os.environ[UNVERIFIED_ENV] = "1"  # tile_overlap is refused otherwise (config.REFUSED_KNOBS)

BASE = {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 3, "maxnreg": 0,
        "use_tma": 0, "variant": 1, "consumer_regs": 240, "persistent": 1, "tile_order": 0,
        "pingpong": 0, "defer_o": 0, "tile_overlap": 0}
BLOCK_M = 128


def one(b: int, h: int, s: int, d: int, causal: bool, fields: dict[str, int]) -> None:
    import torch

    from flashtune.kernels.attention import flash_attention
    from flashtune.kernels.config import config_from_dict

    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    base = config_from_dict("fwd", {**BASE, **fields})
    outs = []
    for overlap in (0, 1):
        cfg = dataclasses.replace(base, tile_overlap=overlap)
        outs.append(flash_attention(q, k, v, causal=causal, return_lse=True, config=cfg))
        torch.cuda.synchronize()  # an illegal address is this variant's
    (o0, l0), (o1, l1) = outs
    o_bad = (o0 != o1).any(-1)  # (B, H, S)
    l_bad = l0 != l1  # +inf (rows that see no key) equals +inf
    idx = (o_bad | l_bad).nonzero()
    r: dict[str, Any] = {"o_rows": int(o_bad.sum()), "lse_rows": int(l_bad.sum()),
                         "rows": o_bad.numel()}
    if len(idx):
        tiles = {(x, y, z // BLOCK_M) for x, y, z in idx.tolist()}
        r.update(first=idx[0].tolist(),
                 within_tile=sorted(set((idx[:, 2] % BLOCK_M).tolist()))[:8],
                 tiles_bad=len(tiles), tiles=b * h * -(-s // BLOCK_M),
                 o_max=float((o0.float() - o1.float()).abs().max()))
    print("RESULT", json.dumps(r), flush=True)


def main() -> None:
    if sys.argv[1] == "one":
        b, h, s, d, causal = map(int, sys.argv[2:7])
        one(b, h, s, d, bool(causal), json.loads(sys.argv[7]) if len(sys.argv) > 7 else {})
        return
    timeout = int(sys.argv[1])
    for case in json.loads(sys.argv[2]):
        cmd = [sys.executable, __file__, "one", *map(str, case[:5]),
               json.dumps(case[5] if len(case) > 5 else {})]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(case, "TIMEOUT (a hung barrier?)", flush=True)
            continue
        got = [ln[len("RESULT "):] for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
        last = (p.stderr.strip().splitlines() or ["?"])[-1][:160]
        print(case, got[0] if got else f"rc={p.returncode} {last}", flush=True)


if __name__ == "__main__":
    main()
