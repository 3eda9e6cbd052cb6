"""The dispatcher's cost: a cache-hit lookup on the CPU, and flashtune's host overhead at
a tiny shape beside SDPA's on a GPU.

    python benchmarks/bench_dispatch.py [--out result.json]

Lookup: ``flashtune.dispatch.resolve`` on a shape already seen (the per-call cost of
dispatching), the best of 7 runs of 20k calls. Under ``TRITON_INTERPRET=1`` only this runs.

Host overhead (CUDA): at B=1, H=4, S=128, D=64, bf16, causal, a kernel takes a few
microseconds, so a loop of calls is bound by the host. For each implementation,
``enqueue`` is the host time per call of 2000 calls without synchronizing (what the
training loop's thread pays) and ``wall`` the time per call including the final
synchronize. Inference forward under no_grad, and training forward+backward. SDPA's
default choice and its FLASH_ATTENTION backend are the anchors; flashtune runs through
the dispatcher (a cache hit after warm-up) and with a forced config (no dispatcher).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import flashtune
from flashtune import dispatch
from flashtune.kernels import attention
from flashtune.kernels.config import default_bwd, default_fwd
from flashtune.problem import Problem


def bench_lookup(device: str) -> dict[str, float]:
    q = torch.randn(2, 16, 1024, 128, dtype=torch.bfloat16, device=device)
    k = torch.randn(2, 4, 1024, 128, dtype=torch.bfloat16, device=device)
    dispatch.resolve("fwd", q, k, True, (-1, -1), 0.0)  # first sight
    n, runs = 20000, []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            dispatch.resolve("fwd", q, k, True, (-1, -1), 0.0)
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return {"best_us": min(runs), "median_us": statistics.median(runs)}


def _loop(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def bench_host_overhead(n: int = 2000) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = Problem(batch=1, heads_q=4, heads_kv=4, seqlen_q=128, seqlen_k=128, head_dim=64,
                dtype="bf16", causal=True)
    shape = (p.batch, p.heads_q, p.seqlen_q, p.head_dim)
    mk = lambda g: torch.randn(shape, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                               requires_grad=g)
    forced = (default_fwd(p), default_bwd(p))
    impls: dict[str, tuple[Callable[..., torch.Tensor], Any]] = {
        "sdpa (default backend)": (lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True), contextlib.nullcontext),
        "sdpa FLASH_ATTENTION": (lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True), lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
        "flashtune (dispatcher)": (lambda q, k, v: flashtune.flash_attention(
            q, k, v, causal=True), contextlib.nullcontext),
        "flashtune (forced config)": (lambda q, k, v: attention.flash_attention(
            q, k, v, causal=True, config=forced), contextlib.nullcontext),
    }
    rows = []
    for name, (fn, ctx) in impls.items():
        with ctx():
            rows.append({"impl": name, **_measure(fn, mk, n)})
    return rows


def _measure(fn: Callable[..., torch.Tensor], mk: Callable[[bool], torch.Tensor],
             n: int) -> dict[str, float]:
    q, k, v = mk(False), mk(False), mk(False)
    with torch.no_grad():
        inf = _loop(lambda: fn(q, k, v), n)
    qg, kg, vg = mk(True), mk(True), mk(True)
    do = torch.randn_like(qg)
    trn = _loop(lambda: fn(qg, kg, vg).backward(do), n // 2)
    return {"inference_enqueue_us": inf[0], "inference_wall_us": inf[1],
            "train_enqueue_us": trn[0], "train_wall_us": trn[1]}


def bench_breakdown(n: int = 2000) -> dict[str, float]:
    """Host microseconds per call of each layer under flashtune.flash_attention at the
    tiny shape: validation, the dispatcher's lookup, and the raw launchers."""
    from flashtune.kernels.attn_bwd import attn_bwd
    from flashtune.kernels.attn_fwd import attn_fwd

    p = Problem(batch=1, heads_q=4, heads_kv=4, seqlen_q=128, seqlen_k=128, head_dim=64,
                dtype="bf16", causal=True)
    shape = (p.batch, p.heads_q, p.seqlen_q, p.head_dim)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    fc, bc = default_fwd(p), default_bwd(p)
    kw = dict(causal=True, sm_scale=0.125, window=(-1, -1), softcap=0.0)
    o, lse = attn_fwd(q, k, v, config=fc, **kw)
    parts: dict[str, Callable[[], Any]] = {
        "validate": lambda: attention.validate(q, k, v, True, None, (-1, -1), 0.0),
        "dispatch.resolve (hit)": lambda: dispatch.resolve("fwd", q, k, True, (-1, -1), 0.0),
        "attn_fwd launcher": lambda: attn_fwd(q, k, v, config=fc, **kw),
        "attn_bwd launcher": lambda: attn_bwd(do, q, k, v, o, lse, config=bc, **kw),
    }
    return {name: _loop(fn, n)[0] for name, fn in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not attention._INTERPRET
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()})",
        "torch": torch.__version__, "python": platform.python_version(),
        "lookup": bench_lookup("cuda" if cuda else "cpu"),
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"{out['device']}, torch {out['torch']}, triton {out.get('triton')}")
    lk = out["lookup"]
    print(f"cache-hit lookup: best {lk['best_us']:.3f} us, median {lk['median_us']:.3f} us")
    if cuda:
        out["host_overhead"] = bench_host_overhead()
        print("| impl | inference enqueue us | inference wall us | train enqueue us "
              "| train wall us |")
        print("|---|---|---|---|---|")
        for r in out["host_overhead"]:
            print(f"| {r['impl']} | {r['inference_enqueue_us']:.1f} | "
                  f"{r['inference_wall_us']:.1f} | {r['train_enqueue_us']:.1f} | "
                  f"{r['train_wall_us']:.1f} |")
        out["breakdown"] = bench_breakdown()
        for name, us in out["breakdown"].items():
            print(f"host {name}: {us:.2f} us/call")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
