"""Bring-up check of the Gluon Hopper backward on an sm90 GPU: correctness, determinism,
then speed next to cuDNN and the portable backward in the same process.

It calls the launchers directly (no dispatcher, no database), so it needs only torch and
triton 3.6 on the GPU host. Every correctness case runs the portable forward for O and the
LSE, then the Hopper backward, and compares dQ, dK and dV with the fp32 reference under the
2x rule. Deterministic cases also run twice and must match bit for bit.

    timeout 600 python benchmarks/gpu_hopper_bwd.py --out result.json [--quick] [--no-bench]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashtune.kernels.attn_bwd import attn_bwd  # noqa: E402
from flashtune.kernels.attn_fwd import attn_fwd  # noqa: E402
from flashtune.kernels.config import BWD_HOPPER, BwdConfig, default_bwd, default_fwd  # noqa: E402
from flashtune.kernels.reference import reference_errors, within_rule  # noqa: E402
from flashtune.problem import Problem, effective_window  # noqa: E402


def problem_of(q, k, causal, window, softcap) -> Problem:
    b, hq, sq, d = q.shape
    return Problem(batch=b, heads_q=hq, heads_kv=k.shape[1], seqlen_q=sq, seqlen_k=k.shape[2],
                   head_dim=d, dtype="bf16" if q.dtype == torch.bfloat16 else "fp16",
                   causal=causal, window=window, softcap=softcap)


def hopper_bwd(do, q, k, v, o, lse, cfg, causal, window, softcap, scale, deterministic):
    config = BwdConfig(variant=BWD_HOPPER, hopper_block_m=cfg["block_m"],
                       hopper_block_n=cfg["block_n"], hopper_stages=cfg["stages"],
                       hopper_regs=cfg["regs"], hopper_stagger=cfg.get("stagger", 1))
    window = effective_window(window, q.shape[2], k.shape[2])
    return attn_bwd(do, q, k, v, o, lse, causal=causal, sm_scale=scale, window=window,
                    softcap=softcap, config=config, deterministic=deterministic)


def forward(q, k, v, causal, window, softcap, scale):
    p = problem_of(q, k, causal, window, softcap)
    cfg = default_fwd(p)
    window = effective_window(window, q.shape[2], k.shape[2])
    return attn_fwd(q, k, v, causal=causal, sm_scale=scale, window=window, softcap=softcap,
                    config=cfg)


CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, causal, window, softcap)
    (2, 4, 4, 300, 300, 128, False, (-1, -1), 0.0),
    (2, 4, 4, 300, 300, 128, True, (-1, -1), 0.0),
    (1, 6, 2, 257, 511, 128, True, (-1, -1), 0.0),
    (1, 6, 2, 511, 257, 128, True, (-1, -1), 0.0),
    (2, 4, 1, 333, 333, 64, False, (64, 17), 0.0),
    (1, 4, 4, 190, 390, 64, True, (-1, -1), 30.0),
    (1, 2, 2, 1000, 1000, 128, False, (100, 0), 20.0),
    (3, 2, 2, 65, 1, 64, False, (-1, -1), 0.0),
    (1, 2, 2, 1, 77, 128, True, (-1, -1), 0.0),
    (1, 8, 8, 2048, 2048, 128, True, (-1, -1), 0.0),
]
CONFIGS = {
    128: [dict(block_m=64, block_n=128, stages=2, regs=240),
          dict(block_m=64, block_n=64, stages=2, regs=240)],
    64: [dict(block_m=64, block_n=128, stages=2, regs=240),
         dict(block_m=128, block_n=128, stages=2, regs=240)],
}


def case_inputs(case: tuple) -> tuple:
    """Fresh bf16 (q, k, v, do) for one of CASES, the portable forward's O and LSE on them,
    and the softmax scale."""
    b, hq, hk, sq, sk, d, causal, window, softcap = case
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    o, lse = forward(q, k, v, causal, window, softcap, scale)
    return q, k, v, do, o, lse, scale


def check(out: dict, quick: bool) -> None:
    torch.manual_seed(0)
    rows = []
    for case in CASES[:4] if quick else CASES:
        _, _, _, _, _, d, causal, window, softcap = case
        q, k, v, do, o, lse, scale = case_inputs(case)
        for cfg in CONFIGS[d]:
            for det in (False, True):
                g = hopper_bwd(do, q, k, v, o, lse, cfg, causal, window, softcap, scale, det)
                torch.cuda.synchronize()
                errs, terrs = reference_errors(q, k, v, do, o, lse, g, causal=causal,
                                               softmax_scale=scale, window_size=window,
                                               softcap=softcap)
                ok, ratio, detail = within_rule(errs, terrs)
                same = None
                if det:
                    g2 = hopper_bwd(do, q, k, v, o, lse, cfg, causal, window, softcap, scale, det)
                    same = all(torch.equal(a, c) for a, c in zip(g, g2, strict=True))
                    ok = ok and same
                rows.append(dict(case=list(map(str, case)), cfg=cfg, det=det, ok=ok,
                                 ratio=ratio, detail=detail, bitwise=same))
                print(f"{'OK ' if ok else 'BAD'} {case} {cfg} det={det} ratio={ratio:.3f} "
                      f"bitwise={same} {detail}", flush=True)
    out["correctness"] = rows


def bench_ms(fn, reps=30) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        z = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(z))
    ts.sort()
    return ts[len(ts) // 2]


SHAPES = [(b, 2048 // d, s, d, c) for d in (64, 128) for c in (False, True)
          for s, b in ((1024, 16), (4096, 4), (16384, 1))]


def bench_one(b: int, h: int, s: int, d: int, causal: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    flops = 4 * 2.5 * b * h * s * s * d * (0.5 if causal else 1.0)
    r: dict = dict(shape=[b, h, s, d, causal])
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oc = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    r["cudnn"] = bench_ms(lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        of = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    r["fa2"] = bench_ms(lambda: torch.autograd.grad(of, (q, k, v), do, retain_graph=True))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse = forward(qd, kd, vd, causal, (-1, -1), 0.0, scale)
    pc = default_bwd(problem_of(qd, kd, causal, (-1, -1), 0.0))
    r["portable"] = bench_ms(lambda: attn_bwd(do, qd, kd, vd, o, lse, causal=causal,
                                              sm_scale=scale, window=(-1, -1), softcap=0.0,
                                              config=pc))
    base = CONFIGS[d][0]
    for cfg, det in ((base, False), (dict(base, stagger=0), False), (base, True),
                     (dict(base, stages=3), True)):
        name = (f"hop{cfg['block_m']}x{cfg['block_n']}s{cfg['stages']}"
                f"{'' if cfg.get('stagger', 1) else 'ns'}{'_det' if det else ''}")
        r[name] = bench_ms(lambda cfg=cfg, det=det: hopper_bwd(
            do, qd, kd, vd, o, lse, cfg, causal, (-1, -1), 0.0, scale, det))
    r["tflops"] = {n: flops / (t * 1e-3) / 1e12 for n, t in r.items() if isinstance(t, float)}
    return r


def bench(out: dict, quick: bool) -> None:
    rows = []
    for b, h, s, d, causal in [x for x in SHAPES if x[2] == 4096] if quick else SHAPES:
        r = bench_one(b, h, s, d, causal)
        rows.append(r)
        best = min((t, n) for n, t in r.items() if n.startswith("hop") and "det" not in n)
        bestd = min((t, n) for n, t in r.items() if n.startswith("hop") and "det" in n)
        print(f"{b}x{h}x{s}x{d} {'causal' if causal else 'full  '} cudnn {r['cudnn']:.3f} "
              f"fa2 {r['fa2']:.3f} portable {r['portable']:.3f} | best {best[1]} "
              f"{best[0]:.3f} ({r['cudnn'] / best[0]:.2f}x cudnn) det {bestd[1]} "
              f"{bestd[0]:.3f} ({r['cudnn'] / bestd[0]:.2f}x)", flush=True)
    out["bench"] = rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    out: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                     date=time.strftime("%Y-%m-%d"))
    try:
        check(out, args.quick)
        if not args.no_bench:
            bench(out, args.quick)
    finally:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
