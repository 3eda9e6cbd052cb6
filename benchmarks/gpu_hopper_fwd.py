"""Bring-up check of the Gluon Hopper forward on an sm90 GPU: correctness, then speed.

It calls the Hopper launcher directly (no dispatcher, no database), with the configs
given as plain namespaces, so it needs only torch and triton 3.6 on the GPU host. Each
correctness case is compared with the fp32 reference under the 2x rule (twice PyTorch's
own low-precision error, plus a small atol), for O and the LSE. Timings are do_bench
medians next to cuDNN in the same process.

    timeout 600 python benchmarks/gpu_hopper_fwd.py --out result.json [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def load_kernels() -> tuple[types.ModuleType, types.ModuleType]:
    sys.path.insert(0, str(ROOT))
    import flashtune.kernels.attn_fwd_hopper as hop
    import flashtune.kernels.reference as ref

    return hop, ref


HOP, REF = load_kernels()
LOG2E = 1.4426950408889634


def mask_params(causal: bool, window: tuple[int, int], sq: int, sk: int):
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    # A bound past the sequence means unbounded.
    if left >= sq + sk:
        left = -1
    if right >= sq + sk:
        right = -1
    return max(left, 0), max(right, 0), left >= 0, right >= 0


def run(q, k, v, cfg, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    d = q.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if softcap > 0:
        scales = (0.0, scale / softcap, softcap * LOG2E)
    else:
        scales = (scale * LOG2E, 0.0, 0.0)
    return HOP.attn_fwd_hopper(q, k, v, sm_scale=scale,
                               mask=mask_params(causal, window, q.shape[2], k.shape[2]),
                               scales=scales, softcap=softcap, config=cfg)


def cfg(block_m=128, block_n=128, num_stages=2, pingpong=0, tile_order=0, persistent=0,
        consumer_regs=240):
    return SimpleNamespace(block_m=block_m, block_n=block_n, num_stages=num_stages,
                           pingpong=pingpong, tile_order=tile_order, persistent=persistent,
                           consumer_regs=consumer_regs)


def check(case: dict, c, dtype=torch.bfloat16) -> dict:
    b, hq, hk, sq, sk, d = case["b"], case["hq"], case["hk"], case["sq"], case["sk"], case["d"]
    kw = dict(causal=case.get("causal", False), window=case.get("window", (-1, -1)),
              softcap=case.get("softcap", 0.0))
    layout = case.get("layout", "bhsd")
    def mk(h, s):
        if layout == "bshd":
            return torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, device="cuda", dtype=dtype)
    q, k, v = mk(hq, sq), mk(hk, sk), mk(hk, sk)
    o, lse = run(q, k, v, c, **kw)
    o2, lse2 = run(q, k, v, c, **kw)
    torch.cuda.synchronize()
    rkw = dict(causal=kw["causal"], window_size=kw["window"], softcap=kw["softcap"])
    ref_o, ref_lse = REF.attention_ref(q, k, v, **rkw)
    low_o, _ = REF.attention_ref(q, k, v, upcast=False, **rkw)
    err = (o.float() - ref_o.float()).abs().max().item()
    base = (low_o.float() - ref_o.float()).abs().max().item()
    fin = torch.isfinite(ref_lse)
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    inf_ok = bool(torch.equal(torch.isinf(lse), ~fin))
    ok = (err <= 2 * base + 1e-3 and lse_err <= 1e-3 and inf_ok and not torch.isnan(o).any().item())
    same = bool(torch.equal(o, o2) and torch.equal(lse, lse2))
    return dict(case=case, cfg=vars(c), err=err, base=base, lse_err=lse_err, inf_ok=inf_ok,
                ok=ok, bit_identical=same)


def correctness(quick: bool) -> list[dict]:
    rng = random.Random(0)
    cases = [
        dict(b=2, hq=4, hk=4, sq=256, sk=256, d=128),
        dict(b=2, hq=4, hk=4, sq=256, sk=256, d=128, causal=True),
        dict(b=1, hq=4, hk=2, sq=97, sk=1025, d=128, causal=True),
        dict(b=1, hq=4, hk=2, sq=1025, sk=97, d=64, causal=True),
        dict(b=2, hq=8, hk=1, sq=300, sk=300, d=64),
        dict(b=1, hq=2, hk=2, sq=333, sk=517, d=128, window=(100, 20)),
        dict(b=1, hq=2, hk=2, sq=200, sk=200, d=64, causal=True, window=(50, -1)),
        dict(b=1, hq=2, hk=2, sq=250, sk=250, d=128, softcap=30.0, causal=True),
        dict(b=2, hq=4, hk=2, sq=1, sk=77, d=128),
        dict(b=2, hq=4, hk=2, sq=77, sk=1, d=64, causal=True),
        dict(b=2, hq=4, hk=4, sq=300, sk=300, d=128, causal=True, layout="bshd"),
        dict(b=1, hq=2, hk=2, sq=64, sk=300, d=128, window=(0, 0)),
    ]
    cfgs = [cfg(), cfg(pingpong=1), cfg(block_m=64), cfg(block_n=64, num_stages=3),
            cfg(persistent=1, tile_order=1), cfg(persistent=1, tile_order=2, pingpong=1)]
    if quick:
        cfgs = cfgs[:3]
    rows = []
    for case, c in itertools.product(cases, cfgs):
        t = time.time()
        r = check(case, c)
        rows.append(r)
        flag = "ok " if r["ok"] else "BAD"
        print(f"{flag} {case} {vars(c)} err={r['err']:.4f} base={r['base']:.4f} "
              f"lse={r['lse_err']:.2e} det={r['bit_identical']} {time.time() - t:.1f}s",
              flush=True)
    # Random feasible configs on random shapes.
    for _ in range(0 if quick else 30):
        d = rng.choice([64, 128])
        c = cfg(block_m=rng.choice([64, 128]), block_n=rng.choice([64, 128]),
                num_stages=rng.choice([2, 3] if d == 64 else [2]),
                tile_order=rng.choice([0, 1, 2]), persistent=rng.choice([0, 1]))
        if c.block_m == 128:
            c.pingpong = rng.choice([0, 1])
        case = dict(b=rng.randint(1, 2), hq=4, hk=rng.choice([1, 2, 4]),
                    sq=rng.randint(1, 700), sk=rng.randint(1, 700), d=d,
                    causal=rng.random() < 0.5, softcap=rng.choice([0.0, 0.0, 20.0]))
        r = check(case, c)
        rows.append(r)
        print(f"{'ok ' if r['ok'] else 'BAD'} rand {case} {vars(c)} err={r['err']:.4f} "
              f"base={r['base']:.4f}", flush=True)
    return rows


def bench(quick: bool) -> list[dict]:
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shapes = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (16, 16, 1024, 128, True),
              (1, 16, 16384, 128, False), (1, 16, 16384, 128, True), (8, 32, 2048, 64, False),
              (8, 32, 2048, 64, True), (4, 32, 4096, 64, False)]
    if quick:
        shapes = shapes[:3]
    cfgs = {"base": cfg(), "pp": cfg(pingpong=1), "pp_pers1": cfg(pingpong=1, persistent=1,
                                                                   tile_order=1),
            "pp_pers2": cfg(pingpong=1, persistent=1, tile_order=2),
            "bn64s3": cfg(block_n=64, num_stages=3, pingpong=1)}
    rows = []
    for b, h, s, d, causal in shapes:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fl = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ms = triton.testing.do_bench(
                lambda q=q, k=k, v=v, causal=causal: F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal),
                return_mode="median")
        row = {"shape": f"B{b} H{h} S{s} D{d}{' causal' if causal else ''}",
               "cudnn": fl / ms / 1e9}
        for name, c in cfgs.items():
            if d == 128 and c.num_stages == 3 and c.block_n == 128:
                continue
            t = triton.testing.do_bench(lambda q=q, k=k, v=v, c=c, causal=causal: run(
                q, k, v, c, causal=causal),
                                        return_mode="median")
            row[name] = fl / t / 1e9
        rows.append(row)
        print("ROW " + " ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in row.items()), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="hopper_fwd.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    a = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    res["triton"] = triton.__version__
    res["correctness"] = correctness(a.quick)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    if not a.skip_bench:
        res["bench"] = bench(a.quick)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    bad = [r for r in res["correctness"] if not r["ok"] or not r["bit_identical"]]
    print(f"correctness: {len(res['correctness']) - len(bad)}/{len(res['correctness'])} ok")


if __name__ == "__main__":
    main()
