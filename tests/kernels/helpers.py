"""Shared helpers for the kernel tests: run a case and judge it by the 2x rule."""

from __future__ import annotations

import dataclasses
import importlib
import math
import multiprocessing as mp
import random
import traceback
from collections.abc import Callable
from typing import Any

import torch

from flashtune.kernels.attention import flash_attention
from flashtune.kernels.config import (
    BwdConfig,
    FwdConfig,
    active_fields,
    config_fields,
    default_bwd,
    default_fwd,
    variant_unavailable,
)
from flashtune.kernels.reference import Reference, flash_errors, reference, within_rule
from flashtune.problem import Problem

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def make_qkv(p: Problem, device: str, layout: str = "bhsd", gen: torch.Generator | None = None,
             ) -> tuple[torch.Tensor, ...]:
    """q, k, v, do for ``p``. layout "bshd" builds flash-attn style (B, S, H, D) storage and
    passes transposed views (non-contiguous); "dpad" pads the last dim so rows are strided."""
    dt = DTYPES[p.dtype]

    def one(h: int, s: int) -> torch.Tensor:
        if layout == "bshd":
            x = torch.randn(p.batch, s, h, p.head_dim, generator=gen).to(device, dt)
            return x.transpose(1, 2)
        if layout == "dpad":
            x = torch.randn(p.batch, h, s, p.head_dim + 8, generator=gen).to(device, dt)
            return x[..., 4:4 + p.head_dim]
        return torch.randn(p.batch, h, s, p.head_dim, generator=gen).to(device, dt)

    return (one(p.heads_q, p.seqlen_q), one(p.heads_kv, p.seqlen_k),
            one(p.heads_kv, p.seqlen_k), one(p.heads_q, p.seqlen_q))


def rounding_floored(ref: Reference, dtype: torch.dtype,
                     flash: dict[str, float] | None = None) -> dict[str, float]:
    """``ref.torch_errors`` with each low-precision tensor's error raised to at least half
    an ulp of ``dtype`` at that tensor's largest reference magnitude and, given ``flash``
    (:func:`~flashtune.kernels.reference.flash_errors` of the candidate's output), each
    gradient's to what the FlashAttention backward's own roundings put into it.

    Any result stored in ``dtype`` may be off by that much from rounding alone. On a large
    tensor PyTorch's own maximum error always reaches it; on a tiny one (a few dozen rows)
    it can fall short by luck, and the 2x rule would then fail a kernel whose only error is
    one correctly rounded value on the other side of a midpoint. The LSE is fp32 and keeps
    its error."""
    eps = torch.finfo(dtype).eps  # one ulp at magnitude 1
    tensors = {"out": ref.out}
    if ref.grads is not None:
        tensors.update(zip(("dq", "dk", "dv"), ref.grads, strict=True))
    out = dict(ref.torch_errors)
    for name, e in (flash or {}).items():
        out[name] = max(out[name], e)
    for name, t in tensors.items():
        finite = t[torch.isfinite(t)]
        top = finite.abs().max().item() if finite.numel() else 0.0
        if top > 0:
            out[name] = max(out[name], 0.5 * eps * 2.0 ** math.floor(math.log2(top)))
    return out


def random_config(cls: type, p: Problem, rng: random.Random, max_block: int = 64,
                  max_stages: int = 3, variant: int | None = None) -> FwdConfig | BwdConfig:
    """A random *feasible* config of ``cls`` for ``p`` (blocks capped to keep the interpreter
    quick; on the GPU pass larger caps): feasible as the search judges it, by the rules and,
    for the Hopper backward, its launch's shared-memory plan (a config the plan refuses
    fails before any launch, as a forced config should, so it is no kernel case)."""
    from flashtune.autotune.space import SearchSpace

    search = SearchSpace.full(cls.kind)  # type: ignore[attr-defined]
    space = config_fields(cls)
    direction = cls.kind  # type: ignore[attr-defined]
    # Only the variants that can serve p here (the Hopper ones cannot in the interpreter).
    variants = [v for v in space.get("variant", ()) if not variant_unavailable(direction, v, p)]
    for _ in range(1000):
        kw = {}
        if "variant" in space:  # the space is conditional: the variant decides the knobs
            kw["variant"] = rng.choice(variants if variant is None else (variant,))
        for name in active_fields(cls, kw.get("variant")):
            allowed = [c for c in space[name]
                       if not (("block" in name and c > max_block)
                               or ("stages" in name and c > max_stages))]
            # A variant whose every tile is above the cap keeps its smallest.
            kw.setdefault(name, rng.choice(allowed or [min(space[name])]))
        cfg = cls(**kw)
        if search.feasible(cfg, p)[0]:
            return cfg
    raise AssertionError(f"no feasible {cls.__name__} found for {p}")


def check_case(p: Problem, device: str, *, fwd: FwdConfig | None = None,
               bwd: BwdConfig | None = None, layout: str = "bhsd", backward: bool = True,
               gen: torch.Generator | None = None, deterministic: bool = True,
               ) -> dict[str, float]:
    """Run flash_attention (+ backward) and assert the 2x rule on out, lse, dq, dk, dv, with
    PyTorch's errors floored as :func:`rounding_floored` says (these problems are small)."""
    fwd = fwd or default_fwd(p)
    bwd = bwd or default_bwd(p)
    q, k, v, do = make_qkv(p, device, layout, gen)
    if layout == "bshd":
        assert not k.is_contiguous() or min(k.shape[1], k.shape[2]) == 1
        q_ptr = q.data_ptr()
    qg, kg, vg = (t.detach().requires_grad_(backward) for t in (q, k, v))
    if layout == "bshd":
        assert qg.data_ptr() == q_ptr  # the view itself reaches the kernel, uncopied
    out, lse = flash_attention(qg, kg, vg, causal=p.causal, window_size=p.window,
                               softcap=p.softcap, return_lse=True, config=(fwd, bwd),
                               deterministic=deterministic)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (p.batch, p.heads_q, p.seqlen_q) and lse.dtype == torch.float32
    grads = None
    if backward:
        grads = torch.autograd.grad(out, (qg, kg, vg), do)
        for g, t in zip(grads, (q, k, v), strict=True):
            assert g.shape == t.shape and g.dtype == t.dtype
    kw = dict(causal=p.causal, softmax_scale=None, window_size=p.window, softcap=p.softcap)
    ref = reference(q, k, v, do if backward else None, **kw)
    errs = ref.errors(out, lse, grads)
    flash = flash_errors(q, k, v, do, out, **kw) if backward else None
    ok, ratio, detail = within_rule(errs, rounding_floored(ref, q.dtype, flash))
    assert ok, f"{p} fwd={fwd} bwd={bwd} layout={layout}: {detail} (all: {errs})"
    assert all(math.isfinite(e) for e in errs.values())
    return errs


def check_graph_replay(step: Callable[[], tuple[torch.Tensor, ...]],
                       inputs: tuple[torch.Tensor, ...], gen: torch.Generator) -> None:
    """Capture ``step`` in a CUDA graph, copy fresh values into ``inputs`` and replay: the
    replay must equal an eager step on the new values, and differ from the first outputs."""
    # Everything before capture runs on a side stream, as CUDA-graph capture requires (the
    # leaves' gradient-accumulator nodes are bound to the stream of their first use).
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ref = [t.clone() for t in step()]
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    # New inputs, copied into the captured buffers: replay must track them.
    for t in inputs:
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=gen).to(t))
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    for a, b in zip(static, fresh, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(static[0], ref[0])


def case_id(c: tuple) -> str:
    """pytest id for a (B, Hq, Hkv, Sq, Sk, D, dtype, causal, window, softcap, layout) case."""
    b, hq, hk, sq, sk, d, dt, causal, win, cap, layout = c
    return (f"b{b}h{hq}k{hk}-sq{sq}sk{sk}-d{d}-{dt}-{'c' if causal else 'n'}"
            f"-w{win[0]}_{win[1]}-cap{cap:g}-{layout}")


def case_problem(c: tuple) -> Problem:
    b, hq, hk, sq, sk, d, dt, causal, win, cap, _layout = c
    return Problem(b, hq, hk, sq, sk, d, dt, causal, win, cap)


def distinct_configs(first: FwdConfig | BwdConfig | None, p: Problem, rng: random.Random,
                     n: int, variant: int, max_stages: int,
                     accept: Callable[[Any], bool] | None = None,
                     ) -> list[FwdConfig | BwdConfig]:
    """Up to ``n`` distinct feasible configs of ``variant`` for ``p`` (GPU-sized tiles):
    ``first`` (a default, when it is of that variant), then random ones (those ``accept``
    takes, where given)."""
    cls = BwdConfig if isinstance(first, BwdConfig) else FwdConfig
    out = [first] if first is not None and first.variant == variant else []
    seen = set(out)
    for _ in range(200 * n):
        if len(out) >= n:
            break
        try:
            c = random_config(cls, p, rng, max_block=192, max_stages=max_stages,
                              variant=variant)
        except AssertionError:  # feasible configs are rare here (the GPU's shared memory
            break               # rules out most of the Hopper space): test those found
        if c not in seen and (accept is None or accept(c)):
            out.append(c)
            seen.add(c)
    assert out and all(c.variant == variant for c in out), p
    return out


def random_problem(rng: random.Random, deterministic: bool = True) -> Problem:
    """An odd-shaped problem for the Hopper kernels' random-config runs: D 64 or 128, any
    lengths below 900, GQA, causal, window and softcap at random."""
    hk = rng.choice([1, 2, 4])
    return Problem(rng.randint(1, 2), hk * rng.choice([1, 2]), hk, rng.randint(1, 900),
                   rng.randint(1, 900), rng.choice([64, 128]), rng.choice(["fp16", "bf16"]),
                   rng.random() < 0.5, rng.choice([(-1, -1), (-1, -1), (64, 16)]),
                   rng.choice([0.0, 0.0, 20.0]), deterministic=deterministic)


def replace(cfg, **kw):  # type: ignore[no-untyped-def]
    return dataclasses.replace(cfg, **kw)


# ----------------------------------------------------------------------------- GPU watchdog


def _watched_child(module: str, name: str, seed: int, conn: Any) -> None:
    try:
        conn.send(("ok", getattr(importlib.import_module(module), name)(seed)))
    except BaseException:  # report anything, the parent decides
        conn.send(("error", traceback.format_exc()))


def run_watched(module: str, name: str, seed: int, timeout_s: float) -> list[str]:
    """Run ``module.name(seed)`` in a child process and return its list of failures; fail
    the test if it does not finish in ``timeout_s`` (a barrier mistake in a Gluon kernel
    hangs the GPU: the watchdog turns that into a failed test instead of a hung run)."""
    import pytest

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_watched_child, args=(module, name, seed, child), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(timeout_s):
        proc.kill()
        proc.join()
        pytest.fail(f"watchdog: {name} did not finish in {timeout_s:.0f} s (a hung barrier?)")
    status, payload = parent.recv()
    proc.join()
    assert status == "ok", payload
    return payload  # type: ignore[no-any-return]
