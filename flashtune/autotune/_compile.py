"""Parallel compilation: build upcoming candidates on the CPU cores while the GPU
times the current one.

Each pool process patches the kernels' ``JITFunction.run`` to ``warmup=True`` (compile
only, launch nothing), then calls the real launchers with tensors of the problem's
shapes and strides (few rows: :func:`compile_inputs` keeps every int argument in its
specialization class, so the binary is the one the worker runs). The binaries land in
Triton's on-disk cache (``TRITON_CACHE_DIR``), which the timing worker shares, so its
first launch loads instead of compiling. Calling the launchers rather than re-listing
kernel arguments keeps this file ignorant of their signatures.

Under the interpreter there is nothing to compile; the tuner runs no pool.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from concurrent.futures import Future, ProcessPoolExecutor, wait
from typing import Any

_PATCHED = False


def _compile_only() -> None:
    """Make every jit kernel of the launcher modules compile without launching."""
    global _PATCHED
    if _PATCHED:
        return
    from triton.runtime.jit import JITFunction

    import flashtune.kernels._bwd_common as common_mod
    import flashtune.kernels.attn_bwd as bwd_mod
    import flashtune.kernels.attn_bwd_hopper as hbwd_mod
    import flashtune.kernels.attn_fwd as fwd_mod
    import flashtune.kernels.attn_fwd_hopper as hfwd_mod

    # Every module that defines kernels: the Hopper (Gluon) ones too, whose JIT class is
    # a JITFunction. A kernel left out would run, on empty tensors, beside the timing.
    for mod in (fwd_mod, bwd_mod, common_mod, hfwd_mod, hbwd_mod):
        for obj in vars(mod).values():
            if isinstance(obj, JITFunction):
                run = obj.run

                def warm(*args: Any, _run: Any = run, **kwargs: Any) -> Any:
                    kwargs["warmup"] = True
                    return _run(*args, **kwargs)

                obj.run = warm  # type: ignore[method-assign]
    _PATCHED = True


def like_count(n: int) -> int:
    """The smallest count that Triton specializes as it does ``n``, alone or multiplied by
    other ints: the same residue mod 16 (divisible by 16 or not), and 1 only for 1."""
    if n <= 16:
        return n
    r = n % 16
    return 16 if r == 0 else 17 if r == 1 else r


def compile_inputs(p: Any, device: str) -> tuple[Any, Any, Any, Any]:
    """``(q, k, lse, packed)``: small tensors whose launches specialize as ``p``'s real ones.

    The kernels take grid counts (tiles, batch x heads), packed totals and lengths as int
    arguments, and Triton specializes an int by value (equal to 1; divisible by 16). A dense
    batch is cut to :func:`like_count` of it; a packed one keeps its sequence count and
    longest lengths over :func:`like_count` of its totals (the prefix sums' values are
    never read by a compile). Anything else would build a binary the worker never runs."""
    import torch

    from flashtune._env import torch_dtype
    from flashtune.kernels.attn_fwd import Packed

    dt = torch_dtype(p.dtype)
    if p.packed:
        tq, tk = like_count(p.total_q), like_count(p.total_k)
        cu_q, cu_k = (torch.zeros(p.batch + 1, dtype=torch.int32, device=device)
                      for _ in range(2))
        cu_q[-1], cu_k[-1] = tq, tk
        packed = Packed(cu_q, cu_k, p.seqlen_q, p.seqlen_k)
        q = torch.empty(tq, p.heads_q, p.head_dim, device=device, dtype=dt)
        k = torch.empty(tk, p.heads_kv, p.head_dim, device=device, dtype=dt)
        lse = torch.empty(p.heads_q, tq, device=device, dtype=torch.float32)
        return q, k, lse, packed
    b = like_count(p.batch)
    q = torch.empty(b, p.heads_q, p.seqlen_q, p.head_dim, device=device, dtype=dt)
    k = torch.empty(b, p.heads_kv, p.seqlen_k, p.head_dim, device=device, dtype=dt)
    lse = torch.empty(b, p.heads_q, p.seqlen_q, device=device, dtype=torch.float32)
    return q, k, lse, None


def precompile(problem: dict[str, Any], direction: str,
               config: dict[str, Any]) -> tuple[float, str]:
    """Compile ``config``'s kernels for ``problem``; (seconds, "" or the compile error)."""
    t0 = time.perf_counter()
    try:
        import torch

        from flashtune.kernels.attn_bwd import attn_bwd
        from flashtune.kernels.attn_fwd import attn_fwd
        from flashtune.kernels.config import config_from_dict
        from flashtune.problem import Problem, default_scale

        _compile_only()
        p = Problem.from_dict(problem)
        q, k, lse, packed = compile_inputs(p, "cuda")
        cfg: Any = config_from_dict(direction, config)
        v = torch.empty_like(k)
        kw: dict[str, Any] = dict(causal=p.causal, sm_scale=default_scale(p.head_dim),
                                  window=p.window, softcap=p.softcap, packed=packed)
        if direction == "fwd":
            attn_fwd(q, k, v, config=cfg, **kw)
        else:
            attn_bwd(torch.empty_like(q), q, k, v, torch.empty_like(q), lse, config=cfg,
                     deterministic=p.deterministic, **kw)
        del q, k, v, lse, packed
        torch.cuda.empty_cache()  # leave the timing worker the memory
    except Exception as e:  # the timing worker sees the same error and classifies it
        return time.perf_counter() - t0, f"{type(e).__name__}: {str(e)[:300]}"
    return time.perf_counter() - t0, ""


def _warm() -> float:
    """What a pool process pays once, before its first compile: the imports, the
    compile-only patch and the CUDA context. Returns its seconds."""
    t0 = time.perf_counter()
    import torch

    _compile_only()
    if torch.cuda.is_available():
        torch.cuda.init()
    return time.perf_counter() - t0


class CompilePool:
    """A spawn-context process pool of ``n`` compile workers."""

    def __init__(self, n: int):
        self.n = n
        ctx = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(max_workers=n, mp_context=ctx)
        self.busy_seconds = 0.0

    def submit(self, problem: dict[str, Any], direction: str,
               config: dict[str, Any]) -> Future[tuple[float, str]]:
        fut = self._pool.submit(precompile, problem, direction, config)

        def account(f: Future[tuple[float, str]]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.busy_seconds += f.result()[0]

        fut.add_done_callback(account)
        return fut

    def warm(self, timeout: float) -> None:
        """Start every process and let each pay its one-time setup now (best effort: a
        failure shows again, classified, at the first real compile)."""
        futs = [self._pool.submit(_warm) for _ in range(self.n)]
        wait(futs, timeout=timeout)
        for f in futs:
            if f.done():
                with contextlib.suppress(Exception):
                    self.busy_seconds += f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
