"""Host time per call at a tiny shape, flashtune beside SDPA in the same process, and where
flashtune's remaining microseconds go.

    PYTHONPATH=. python3 benchmarks/bench_overhead.py --out overhead.json [--n 2000]

Shape: B=1, H=1, S=128, D=64, bf16, causal and not. A kernel there runs for a few
microseconds, so a loop of calls is bound by the host. For each case (forward under
no_grad; forward + backward through ``torch.autograd.grad``) and implementation
(flashtune through the dispatcher; SDPA's default backend; SDPA's FLASH_ATTENTION
backend), after a warm-up:

- **idle**: wall time per call over a loop of ``--n`` calls, ``torch.cuda.synchronize``
  at both ends (the issue's measure);
- **busy**: host time per call over ``--n-busy`` calls queued behind a chain of large
  matmuls on the same stream, so the GPU never waits for the host and the host never for
  the GPU (the loop stays below the launch queue's depth): the pure host cost.

Both are measured in ``--rounds`` rounds that alternate the implementations, and each
figure is the median of its rounds. ``--profile FILE`` adds torch.profiler's host table
of fwd+bwd steps (ours and SDPA's), where the autograd engine's thread shows too.

The breakdown times each layer of flashtune's no-grad forward and of its backward in a
loop of its own: the signature cache, what a first sight adds (validation, the problem
key, the dispatcher's lookup), the output allocations, one bound launch against one
``kernel[grid]`` launch, the autograd Function, the Function's backward body, and a whole
``torch.autograd.grad`` step of ours, of SDPA and of one elementwise op (what the autograd
engine costs around any op). The C++ backward node (``FLASHTUNE_NATIVE``) is built or
loaded first, and the JSON's ``native`` says whether it ran; ``FLASHTUNE_NATIVE=0``
measures the Python node. flashtune runs with an empty tuning
database (heuristic configs) unless ``FLASHTUNE_DB`` is set. Needs CUDA; runs on torch and
triton alone (no install: the project on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

SHAPE = (1, 1, 128, 64)  # B, H, S, D
SCALE = SHAPE[-1] ** -0.5


def _setup_db() -> str:
    """An empty tuning database unless FLASHTUNE_DB names one (heuristic configs). Returns
    what the results record: the database named, or that it was a temporary one (its
    path is of no use off this host)."""
    if os.environ.get("FLASHTUNE_DB"):
        return os.environ["FLASHTUNE_DB"]
    path = os.path.join(tempfile.mkdtemp(prefix="flashtune-bench-"), "tuning.db")
    os.environ["FLASHTUNE_DB"] = path
    try:
        from flashtune.db import open_storage

        open_storage(path).close()
    except Exception as e:  # no database stack here: the dispatcher warns once, goes on
        print(f"(no tuning database: {type(e).__name__}: {e})")
    return "an empty temporary database (heuristic configs)"


def _inputs(grad: bool) -> tuple[torch.Tensor, ...]:
    q, k, v, do = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return (*(t.requires_grad_(grad) for t in (q, k, v)), do)


def _fwd(fn: Callable[..., torch.Tensor], causal: bool) -> Callable[[], Any]:
    q, k, v, _ = _inputs(False)

    def call() -> None:
        with torch.no_grad():
            fn(q, k, v, causal)

    return call


def _fwd_bwd(fn: Callable[..., torch.Tensor], causal: bool) -> Callable[[], Any]:
    q, k, v, do = _inputs(True)
    return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)


def _idle(call: Callable[[], Any], n: int) -> float:
    for _ in range(max(50, n // 20)):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _busy(call: Callable[[], Any], n: int, cover_s: float) -> float:
    """Host time per call of ``n`` calls queued behind ``cover_s`` seconds of matmuls."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    a @ a
    torch.cuda.synchronize()
    per = time.perf_counter() - t0
    for _ in range(max(1, int(cover_s / per) + 1)):
        a @ a
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / n * 1e6


def _per_call(fn: Callable[[], Any], n: int, runs: int = 5) -> float:
    """Median over ``runs`` of the host time per call of ``n`` calls (no synchronize)."""
    for _ in range(20):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def implementations() -> dict[str, Callable[..., torch.Tensor]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtune

    def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return {
        "flashtune": lambda q, k, v, c: flashtune.flash_attention(q, k, v, causal=c),
        "sdpa": lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c),
        "sdpa_flash": sdpa_flash,
    }


def bench_cases(n: int, n_busy: int, rounds: int) -> list[dict[str, Any]]:
    """Each case's implementations measured in alternation, ``rounds`` times (``n`` calls
    in all per implementation for idle, ``n_busy`` per round for busy), each figure the
    median of its rounds: the host's speed drifts within a run (SDPA's own fwd+bwd moved
    144 -> 252 us between two cases of one run), and measuring one implementation after
    the other folds that drift into their ratio."""
    rows = []
    for causal in (False, True):
        for case, make in (("fwd", _fwd), ("fwd+bwd", _fwd_bwd)):
            row: dict[str, Any] = {"case": case, "causal": causal}
            calls = {name: make(fn, causal) for name, fn in implementations().items()}
            idle: dict[str, list[float]] = {name: [] for name in calls}
            busy: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(rounds):
                for name, call in calls.items():
                    idle[name].append(_idle(call, max(1, n // rounds)))
                for name, call in calls.items():
                    cover = 3 * idle[name][-1] * n_busy / 1e6 + 0.05  # s of matmuls ahead
                    busy[name].append(_busy(call, n_busy, cover))
            for name in calls:
                row[name] = {"idle_us": statistics.median(idle[name]),
                             "busy_us": statistics.median(busy[name]),
                             "idle_rounds_us": idle[name], "busy_rounds_us": busy[name]}
            for mode in ("idle_us", "busy_us"):
                row[f"ratio_{mode[:-3]}"] = row["flashtune"][mode] / row["sdpa"][mode]
                # The same ratio taken within each round (the two measured seconds apart,
                # so the host's drift between rounds cancels), then the median.
                mine, theirs = (row[name][f"{mode[:-3]}_rounds_us"] for name in
                                ("flashtune", "sdpa"))
                row[f"ratio_{mode[:-3]}_per_round"] = statistics.median(
                    a / b for a, b in zip(mine, theirs, strict=True))
            rows.append(row)
    return rows


def profile(path: str, causal: bool = False, steps: int = 200) -> None:
    """torch.profiler's host-side table (self CPU time per op and autograd node, both
    threads) over ``steps`` fwd+bwd steps of flashtune and of SDPA, written to ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with open(path, "w") as fh:
        for name, fn in implementations().items():
            if name == "sdpa_flash":
                continue
            call = _fwd_bwd(fn, causal)
            for _ in range(50):
                call()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    call()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            fh.write(f"== {name}, fwd+bwd, causal {causal}, {steps} steps\n{table}\n")


class _Identity(torch.autograd.Function):
    """The least a Python ``torch.autograd.Function`` costs in an autograd step."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def breakdown(causal: bool, n: int) -> dict[str, float]:
    """Host microseconds per call of each layer of flashtune's path (see the module doc)."""
    from flashtune import dispatch
    from flashtune.kernels import _autograd, attention
    from flashtune.kernels._bound import descriptor_like
    from flashtune.kernels.attention import call_plan, flash_attention
    from flashtune.problem import Problem

    q, k, v, do = _inputs(False)
    qg, kg, vg, _ = _inputs(True)
    window = (-1, -1)
    with torch.no_grad():
        flash_attention(q, k, v, causal=causal)
    plan = call_plan(q, k, v, causal, None, window, 0.0, True, None)
    o, lse = plan.forward(q, k, v)
    plan.backward(do, q, k, v, o, lse)
    fwd = plan.fwd
    assert fwd is not None
    launch = fwd.hopper.launch if fwd.hopper is not None else fwd.launch
    if fwd.hopper is not None:
        tq, tk, tv = fwd.hopper.templates
        values: tuple[Any, ...] = (descriptor_like(tq, q), descriptor_like(tk, k),
                                   descriptor_like(tv, v), o, lse, lse, lse)
    elif fwd.descriptors is not None:
        td, tv = fwd.descriptors
        values = (q, k, v, o, lse, descriptor_like(td, k), descriptor_like(tv, v), q, q)
    else:
        values = (q, k, v, o, lse, k, v, q, q)
    jit_args = list(values) + launch.args[launch.n_dynamic:]
    bwd = next(iter(plan.bwd.values()))

    def jit() -> None:
        launch.kernel[launch.grid](*jit_args, **launch.kwargs)

    def apply_fwd() -> None:
        _autograd.Attention.apply(plan, qg, kg, vg)

    parts: dict[str, Callable[[], Any]] = {
        "is_compiling + needs_grad": lambda: (torch.compiler.is_compiling(),
                                              attention.needs_grad(q, k, v)),
        "signature key + plan lookup (hit)": lambda: call_plan(q, k, v, causal, None, window,
                                                               0.0, True, None),
        "first sight only: validate": lambda: attention.validate(q, k, v, causal, None,
                                                                 window, 0.0),
        "first sight only: problem key": lambda: Problem.from_tensors(
            q, k, causal=causal).key("fwd"),
        "first sight only: dispatch.resolve (hit)": lambda: dispatch.resolve(
            "fwd", q, k, causal, window, 0.0),
        "alloc O + LSE": lambda: (torch.empty_like(q),
                                  torch.empty(fwd.lse_shape if fwd.hopper is None
                                              else fwd.hopper.lse_shape,
                                              device=q.device, dtype=torch.float32)),
        "fwd launch, bound": lambda: launch(*values),
        "fwd launch, kernel[grid]": jit,
        "plan.forward (alloc + launch)": lambda: plan.forward(q, k, v),
        "plan.forward, LSE dropped (O alloc + launch)": lambda: plan.forward(q, k, v, lse=False),
        "flash_attention, no grad": lambda: flash_attention(q, k, v, causal=causal),
        "Attention.apply forward (grad)": apply_fwd,
        f"bwd: {len(bwd.launches)} bound launch(es) + alloc": lambda: bwd(do, q, k, v, o, lse),
        "plan.backward (the Function's backward body)": lambda: plan.backward(do, q, k, v,
                                                                             o, lse),
        # The whole fwd+bwd step on the host, and what autograd itself costs around any
        # op: the gap between these and the layers above is the autograd engine's.
        "autograd.grad of Attention.apply (fwd+bwd)": lambda: torch.autograd.grad(
            _autograd.Attention.apply(plan, qg, kg, vg)[0], (qg, kg, vg), do),
        "autograd.grad of flash_attention (fwd+bwd, the eager wiring)": lambda: (
            torch.autograd.grad(flash_attention(qg, kg, vg, causal=causal), (qg, kg, vg), do)),
        "flash_attention forward with grad (the eager wiring)": lambda: flash_attention(
            qg, kg, vg, causal=causal),
        "autograd.grad of SDPA (fwd+bwd)": lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal), (qg, kg, vg), do),
        "autograd.grad of an elementwise op (engine floor)": lambda: torch.autograd.grad(
            qg * 2.0, (qg,), do),
        "autograd.grad of a Python Function (identity)": lambda: torch.autograd.grad(
            _Identity.apply(qg), (qg,), do),
        # The engine runs a CUDA graph's backward on a device thread of its own; these
        # run it on the calling thread instead, and time our backward body from inside.
        "autograd.grad of Attention.apply, calling thread": lambda: _on_calling_thread(
            lambda: torch.autograd.grad(_autograd.Attention.apply(plan, qg, kg, vg)[0],
                                        (qg, kg, vg), do)),
        "autograd.grad of SDPA, calling thread": lambda: _on_calling_thread(
            lambda: torch.autograd.grad(F.scaled_dot_product_attention(
                qg, kg, vg, is_causal=causal), (qg, kg, vg), do)),
        "Attention's backward body, timed inside the engine": lambda: _TimedAttention.step(
            plan, qg, kg, vg, do),
    }
    out = {}
    with torch.no_grad():
        for name, fn in parts.items():
            if name.startswith(("Attention", "autograd", "flash_attention forward with grad")):
                _TimedAttention.inner.clear()
                with torch.enable_grad():
                    out[name] = _per_call(fn, n)
                if _TimedAttention.inner:  # what the body took, not the whole step
                    out[name] = statistics.median(_TimedAttention.inner) * 1e6
            else:
                out[name] = _per_call(fn, n)
    return out


def _on_calling_thread(step: Callable[[], Any]) -> Any:
    with torch.autograd.set_multithreading_enabled(False):
        return step()


class _TimedAttention(torch.autograd.Function):
    """flashtune's eager Function, its backward body timed where the engine runs it."""

    inner: list[float] = []

    @staticmethod
    def forward(ctx: Any, plan: Any, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from flashtune.kernels import _autograd

        return _autograd.Attention.forward(ctx, plan, q, k, v)

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, dlse: Any) -> tuple[Any, ...]:
        from flashtune.kernels import _autograd

        t0 = time.perf_counter()
        out = _autograd.Attention.backward(ctx, do, dlse)
        _TimedAttention.inner.append(time.perf_counter() - t0)
        return out

    @staticmethod
    def step(plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             do: torch.Tensor) -> Any:
        return torch.autograd.grad(_TimedAttention.apply(plan, q, k, v)[0], (q, k, v), do)


def served() -> dict[str, dict[str, Any]]:
    """What the dispatcher serves the benchmarked calls (``flashtune.explain``)."""
    import flashtune

    q, k, v, _ = _inputs(False)
    out = {}
    for causal in (False, True):
        ex = flashtune.explain(q, k, v, causal=causal)
        out[str(causal)] = {"fwd": repr(ex.fwd_config), "bwd": repr(ex.bwd_config),
                            "fwd_source": f"{ex.fwd.source} {ex.fwd.layer or ''}".strip(),
                            "bwd_source": f"{ex.bwd.source} {ex.bwd.layer or ''}".strip()}
    return out


def _versions() -> dict[str, Any]:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "commit": commit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--n", type=int, default=2000, help="calls per idle loop (default 2000)")
    ap.add_argument("--n-busy", type=int, default=150,
                    help="calls per busy loop, under the launch queue's depth (default 150)")
    ap.add_argument("--rounds", type=int, default=7,
                    help="alternating rounds per case; each figure is their median")
    ap.add_argument("--profile", metavar="FILE",
                    help="also write torch.profiler's host table of fwd+bwd steps here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_overhead needs a CUDA GPU (host overhead is a GPU-host measure)")
    db = _setup_db()
    from flashtune.kernels import _native

    t0 = time.perf_counter()
    _native.module(wait=True)  # the C++ backward node, unless FLASHTUNE_NATIVE=0
    native = {**_native.status(), "load_s": round(time.perf_counter() - t0, 2)}
    native.pop("library")  # a path of this host
    print(f"C++ backward node: {native}")
    out: dict[str, Any] = {**_versions(), "shape": {"B": 1, "H": 1, "S": 128, "D": 64,
                                                    "dtype": "bf16"},
                           "n": args.n, "n_busy": args.n_busy, "database": db,
                           "native": native}
    print(f"{out['device']}, torch {out['torch']}, triton {out['triton']}, "
          f"commit {out['commit']}, {out['date']}")
    out["served"] = served()
    for c, e in out["served"].items():
        print(f"causal {c}: fwd {e['fwd']} ({e['fwd_source']}), bwd {e['bwd']} "
              f"({e['bwd_source']})")
    out["rounds"] = args.rounds
    out["cases"] = bench_cases(args.n, args.n_busy, args.rounds)
    print("\n| case | causal | flashtune idle | SDPA idle | ratio (per round) | "
          "flashtune busy | SDPA busy | ratio (per round) | SDPA-FA2 idle |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["cases"]:
        f, s = r["flashtune"], r["sdpa"]
        print(f"| {r['case']} | {r['causal']} | {f['idle_us']:.1f} us | {s['idle_us']:.1f} us | "
              f"{r['ratio_idle']:.2f}x ({r['ratio_idle_per_round']:.2f}x) | "
              f"{f['busy_us']:.1f} us | {s['busy_us']:.1f} us | "
              f"{r['ratio_busy']:.2f}x ({r['ratio_busy_per_round']:.2f}x) | "
              f"{r['sdpa_flash']['idle_us']:.1f} us |")
    out["breakdown"] = {str(c): breakdown(c, args.n) for c in (False, True)}
    print("\nwhere flashtune's host time goes (us per call; causal False / True):")
    names = list(out["breakdown"]["False"])
    for name in names:
        a, b = out["breakdown"]["False"][name], out["breakdown"]["True"][name]
        print(f"  {name:42s} {a:7.2f} {b:7.2f}")
    if args.profile:
        profile(args.profile)
        print(f"wrote {args.profile}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=2)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
