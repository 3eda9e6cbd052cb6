"""The house measuring protocol (DESIGN.md), shared by benchmarks, the tuner and the CLI.

- FLOPs: ``Problem.flops`` (fwd = 4·B·Hq·Sq·Sk·D, halved for causal Sq == Sk; bwd = 2.5x).
- Timing: ``triton.testing.do_bench`` quantiles on CUDA (it flushes L2 between
  repetitions); a wall-clock loop under the CPU interpreter, labelled as such.
- Three timings per implementation: training forward (inputs require grad, LSE saved),
  backward as (forward+backward) - forward, and inference forward under no_grad.
- Anchors: SDPA's cuDNN, FA2 and efficient backends and compiled FlexAttention.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashtune._env import torch_dtype
from flashtune.problem import Problem

if TYPE_CHECKING:
    from flashtune.gpu_clocks import ClockSampler

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@contextmanager
def _clocks(sampler: ClockSampler | None, log: dict[str, Any] | None, key: str,
            ) -> Iterator[None]:
    """Record in ``log[key]`` the summary of the GPU clocks sampled while the block runs
    (:mod:`flashtune.gpu_clocks`); nothing without a sampler or a log."""
    if sampler is None or log is None:
        yield
        return
    with sampler.window() as w:
        yield
    log[key] = w.summary()


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    interpreter: bool = False

    def tflops(self, flops: float) -> float:
        return flops / (self.median_ms * 1e-3) / 1e12 if self.median_ms > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_inputs(p: Problem, device: torch.device | str, *, requires_grad: bool = False,
                generator: torch.Generator | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh N(0, 1) q, k, v for ``p`` in SDPA layout (B, H, S, D); never zeros. A packed
    problem gets (total, H, D) tensors of :meth:`Problem.packed_lengths` (see
    :func:`packed_layout`)."""
    dt = torch_dtype(p.dtype)
    shapes: tuple[tuple[int, ...], ...]
    if p.packed:
        lq, lk = p.packed_lengths()
        shapes = ((sum(lq), p.heads_q, p.head_dim), (sum(lk), p.heads_kv, p.head_dim),
                  (sum(lk), p.heads_kv, p.head_dim))
    else:
        shapes = ((p.batch, p.heads_q, p.seqlen_q, p.head_dim),
                  (p.batch, p.heads_kv, p.seqlen_k, p.head_dim),
                  (p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    out = []
    for s in shapes:
        t = torch.randn(s, device=device, dtype=torch.float32, generator=generator).to(dt)
        out.append(t.requires_grad_(requires_grad))
    return out[0], out[1], out[2]


def packed_layout(p: Problem, device: torch.device | str,
                  ) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of :func:`make_inputs`'s
    packed batch (the fields of ``flashtune.kernels.attn_fwd.Packed``), or None if dense."""
    if not p.packed:
        return None

    def cu(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)

    lq, lk = p.packed_lengths()
    return cu(lq), cu(lk), max(lq), max(lk)


def time_fn(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 100,
            cpu_reps: int = 3, grad_to_none: Sequence[torch.Tensor] = ()) -> Timing:
    """Median/p20/p80 of ``fn()`` in ms: do_bench on CUDA, a host clock loop otherwise.
    ``grad_to_none``: leaves whose ``.grad`` is reset before each call, outside the timed
    region, so that a backward stores its gradients instead of adding them to the last
    call's (an elementwise pass over every input that is not attention's work)."""
    if torch.cuda.is_available():
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                                grad_to_none=list(grad_to_none) or None,
                                                quantiles=[0.5, 0.2, 0.8])
        return Timing(float(med), float(p20), float(p80))
    fn()
    times = []
    for _ in range(max(cpu_reps, 1)):
        for t in grad_to_none:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    return Timing(statistics.median(times), q[0], q[3], interpreter=True)


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80) of ``xs`` with linear interpolation, as do_bench reports them."""
    t = torch.tensor(xs, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


def median_interval(xs: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """(median, low, high): the median of ``xs`` and a distribution-free ~95% confidence
    interval for it, from the order statistics n/2 -/+ z*sqrt(n)/2."""
    ys = sorted(xs)
    n = len(ys)
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return statistics.median(ys), ys[lo], ys[hi]


def time_parts(parts: Sequence[Callable[[], Any]], *, warmup_ms: float = 25,
               rep_ms: float = 100, cpu_reps: int = 3, rel_tol: float | None = None,
               min_reps: int = 8, abandon_ms: float | None = None,
               ) -> tuple[Timing, list[float]]:
    """Time launches that run back to back as one unit: the whole, and each part in it.

    The whole follows the house protocol of :func:`time_fn` (do_bench's: a 5-run
    estimate, ``warmup_ms`` of warmup, then ``rep_ms`` of repetitions with L2 flushed
    before each); CUDA events recorded between the parts give each part's median over
    the same repetitions. Returns (Timing of the whole, [median ms of each part]).
    Under the CPU interpreter both come from the host clock and are labelled so.

    ``rel_tol`` makes the repetitions stop as soon as the noise allows (the tuner's
    trials): from ``min_reps`` on, once the median's 95% interval (:func:`median_interval`)
    is within ``rel_tol`` of it either way, or, with ``abandon_ms``, once the interval
    lies wholly above ``abandon_ms`` (a candidate plainly slower than the incumbent);
    ``rep_ms`` stays the cap. The estimate then takes 2 runs, not 5.
    """
    if not parts:
        raise ValueError("time_parts needs at least one launch")

    def whole() -> None:
        for f in parts:
            f()

    if not torch.cuda.is_available():
        whole()
        per: list[list[float]] = [[] for _ in parts]
        tot: list[float] = []
        for _ in range(max(cpu_reps, 1)):
            stamps = [time.perf_counter()]
            for f in parts:
                f()
                stamps.append(time.perf_counter())
            tot.append((stamps[-1] - stamps[0]) * 1e3)
            for i in range(len(parts)):
                per[i].append((stamps[i + 1] - stamps[i]) * 1e3)
        med, p20, p80 = _quantiles(tot)
        return Timing(med, p20, p80, interpreter=True), [_quantiles(x)[0] for x in per]

    whole()
    torch.cuda.synchronize()
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n_est = 5 if rel_tol is None else 2
    t0.record()
    for _ in range(n_est):
        flush.zero_()
        whole()
    t1.record()
    torch.cuda.synchronize()
    estimate = max(t0.elapsed_time(t1) / n_est, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        whole()
    n_max = max(1, int(rep_ms / estimate))
    tot, per = [], [[] for _ in parts]
    batch = n_max if rel_tol is None else min(n_max, max(min_reps, 1))
    while True:
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(len(parts) + 1)]
                  for _ in range(batch)]
        for ev in events:
            flush.zero_()
            ev[0].record()
            for f, e in zip(parts, ev[1:], strict=True):
                f()
                e.record()
        torch.cuda.synchronize()
        tot += [ev[0].elapsed_time(ev[-1]) for ev in events]
        for i in range(len(parts)):
            per[i] += [ev[i].elapsed_time(ev[i + 1]) for ev in events]
        left = n_max - len(tot)
        if rel_tol is None or left <= 0:
            break
        med, lo, hi = median_interval(tot)
        if max(med - lo, hi - med) <= rel_tol * med or \
                (abandon_ms is not None and lo > abandon_ms):
            break
        batch = min(left, len(tot))  # double the sample
    med, p20, p80 = _quantiles(tot)
    return Timing(med, p20, p80), [_quantiles(x)[0] for x in per]


@dataclass
class Against:
    """What :func:`time_against` measured: the candidate's own timing and the median of
    each of its parts, the reference's timing from the same loop, and ``ratio``, the
    median of the candidate's time over the reference's, launch pair by launch pair."""

    timing: Timing
    parts_ms: list[float]
    ref: Timing
    ratio: float
    pairs: int


def time_against(parts: Sequence[Callable[[], Any]], ref: Callable[[], Any], *,
                 warmup_ms: float = 10, rep_ms: float = 100, cpu_reps: int = 3,
                 rel_tol: float = 0.01, min_reps: int = 8,
                 abandon_ratio: float | None = None) -> Against:
    """Time a candidate (``parts`` run back to back as one unit, as :func:`time_parts`)
    beside a reference launch ``ref``, in pairs: L2 flushed before each launch, CUDA
    events around each, the two in turn and in alternating order (candidate first in
    even pairs, reference first in odd ones).

    Timed alone, one after the other, two configs meet different clocks: on the H200
    (session 47, BENCHMARKS.md, issue 17) a pair timed each alone, back to back in the
    house loop, read 0.985-1.029x apart from one visit to the next, and 0.97-1.16x at
    8k keys, where interleaved they read 1.028-1.040x and 0.964-0.975x. A ratio of
    adjacent launches cancels the clocks.

    Repetitions stop from ``min_reps`` pairs on once the 95% interval of the ratio's
    median (:func:`median_interval`) lies within ``rel_tol`` of it either way, or with
    ``abandon_ratio``, once it lies wholly above that (a candidate plainly slower than
    the reference); the pairs take at most about ``rep_ms``. Under the CPU interpreter,
    ``cpu_reps`` pairs on the host clock, labelled so."""
    if not parts:
        raise ValueError("time_against needs at least one launch")

    def whole() -> None:
        for f in parts:
            f()

    if not torch.cuda.is_available():
        whole()
        ref()
        tot: list[float] = []
        per: list[list[float]] = [[] for _ in parts]
        refs: list[float] = []
        for i in range(max(cpu_reps, 1)):
            for first in ((True, False) if i % 2 == 0 else (False, True)):
                start = time.perf_counter()
                if first:
                    stamps = [start]
                    for f in parts:
                        f()
                        stamps.append(time.perf_counter())
                    tot.append((stamps[-1] - start) * 1e3)
                    for j in range(len(parts)):
                        per[j].append((stamps[j + 1] - stamps[j]) * 1e3)
                else:
                    ref()
                    refs.append((time.perf_counter() - start) * 1e3)
        ratios = [a / b for a, b in zip(tot, refs, strict=True) if b > 0]
        return Against(Timing(*_quantiles(tot), interpreter=True),
                       [_quantiles(x)[0] for x in per], Timing(*_quantiles(refs),
                                                               interpreter=True),
                       statistics.median(ratios) if ratios else math.nan, len(tot))

    whole()
    ref()
    torch.cuda.synchronize()
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(2):
        flush.zero_()
        whole()
        flush.zero_()
        ref()
    t1.record()
    torch.cuda.synchronize()
    pair = max(t0.elapsed_time(t1) / 2, 1e-3)
    for i in range(max(1, int(warmup_ms / pair))):
        flush.zero_()
        (whole if i % 2 else ref)()
    n_max = max(1, int(rep_ms / pair))
    tot, refs = [], []
    per = [[] for _ in parts]
    batch = min(n_max, max(min_reps, 1))
    while True:
        cand_ev = [[torch.cuda.Event(enable_timing=True) for _ in range(len(parts) + 1)]
                   for _ in range(batch)]
        ref_ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(batch)]
        for i, (ev, (ra, rb)) in enumerate(zip(cand_ev, ref_ev, strict=True)):
            for cand_turn in ((True, False) if (len(tot) + i) % 2 == 0 else (False, True)):
                flush.zero_()
                if cand_turn:
                    ev[0].record()
                    for f, e in zip(parts, ev[1:], strict=True):
                        f()
                        e.record()
                else:
                    ra.record()
                    ref()
                    rb.record()
        torch.cuda.synchronize()
        tot += [ev[0].elapsed_time(ev[-1]) for ev in cand_ev]
        refs += [ra.elapsed_time(rb) for ra, rb in ref_ev]
        for j in range(len(parts)):
            per[j] += [ev[j].elapsed_time(ev[j + 1]) for ev in cand_ev]
        ratios = [a / b for a, b in zip(tot, refs, strict=True)]
        left = n_max - len(tot)
        if left <= 0:
            break
        med, lo, hi = median_interval(ratios)
        if max(med - lo, hi - med) <= rel_tol * med or \
                (abandon_ratio is not None and lo > abandon_ratio):
            break
        batch = min(left, len(tot))  # double the sample
    return Against(Timing(*_quantiles(tot)), [_quantiles(x)[0] for x in per],
                   Timing(*_quantiles(refs)), statistics.median(ratios), len(tot))


def _turns(n: int, k: int) -> list[int]:
    """The launch order of :func:`time_interleaved`: ``n`` cycles through ``k`` launches,
    in alternating direction (0 1 2, 2 1 0, 0 1 2, ...)."""
    fwd = list(range(k))
    return [i for c in range(n) for i in (fwd if c % 2 == 0 else fwd[::-1])]


#: The longest GPU wait put before a launch (``lead_ms="auto"``): a launch that needs more
#: host time than this is timed with its host time in part.
MAX_LEAD_MS = 20.0


@functools.cache
def _spin_cycles_per_ms(device: int) -> float:
    """SM clock cycles that ``torch.cuda._sleep`` spins for in one millisecond on
    ``device``, read once per process (at the clocks of that moment: callers leave a
    margin)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        return 20_000_000 / max(a.elapsed_time(b), 1e-3)


def gpu_wait(ms: float) -> None:
    """Queue about ``ms`` of spinning on the current stream (one thread: the GPU is
    otherwise idle), so that the host issues what follows while the GPU is still busy."""
    if ms > 0:
        torch.cuda._sleep(int(ms * _spin_cycles_per_ms(torch.cuda.current_device())))


def host_issue_ms(fns: Sequence[Callable[[], Any]], calls: int = 5) -> list[float]:
    """Each launch's host time to issue one call (median of ``calls``), read while the
    GPU is kept busy ahead of the calls, so that none waits for the GPU: the CPU time a
    launch needs, whatever its GPU time. When it is at least the launch's GPU time, a
    timing loop's events measure the host, not the kernels (a launch that synchronizes
    reads the GPU's wait here too)."""
    out = []
    for f in fns:
        gpu_wait(50.0)
        ts = []
        for _ in range(max(calls, 1)):
            start = time.perf_counter()
            f()
            ts.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        out.append(statistics.median(ts))
    return out


def lead_for(issue_ms: Sequence[float], lead_ms: float | str) -> float:
    """The GPU wait put before each timed launch: ``lead_ms`` itself, or for "auto" one
    and a half times the largest host issue time (at most :data:`MAX_LEAD_MS`)."""
    if lead_ms == "auto":
        return min(1.5 * max(issue_ms, default=0.0), MAX_LEAD_MS)
    if isinstance(lead_ms, str) or not (0 <= lead_ms <= 1000):
        raise ValueError(f"lead_ms must be 'auto' or 0 to 1000 ms, not {lead_ms!r}")
    return float(lead_ms)


def time_interleaved(fns: Sequence[Callable[[], Any]], *, warmup_ms: float = 25,
                     rep_ms: float = 100, rounds: int = 1, cpu_reps: int = 3,
                     lead_ms: float | str = 0.0, host: dict[str, Any] | None = None,
                     ) -> list[Timing]:
    """Time several launches against one another, in one loop that takes them in turn
    (0 1 2, 2 1 0, 0 1 2, ...), each with L2 flushed before it and CUDA events around it.

    Timed one after another, even in five alternating rounds, four copies of one kernel
    read up to 7% apart on an H200: its clocks sag under a sustained load (the launches
    slow by up to 10% over the first 125 ms, by kernel), then dip again at moments that
    recur with the load's age. (The sag is not the board's power limit: in session 46 the
    SM clock fell from 1,980 to 1,785-1,905 MHz at 250-300 W of 700.) Interleaved launch by launch,
    every candidate meets the same clocks. Each launch gets ``warmup_ms`` of warm-up
    and ``rounds`` x ``rep_ms`` of timed repetitions, by the estimate of a first cycle,
    as :func:`time_fn` gives one launch. Returns each one's median, p20 and p80 over its
    own launches; under the CPU interpreter, host-clock timings of ``cpu_reps`` cycles,
    labelled so.

    The events time the GPU only while the host issues launches faster than the GPU runs
    them: a launch whose host time (Python, autograd, plan lookups) is longer than its
    kernels reads its host time, and so do its neighbours in the loop (BENCHMARKS.md,
    issue 13, session 65: rows read 0.53-0.67x cuDNN on a host that took 1 ms to issue a
    0.36 ms training step). ``lead_ms`` puts a GPU wait of that many ms (or, for "auto",
    :func:`lead_for` of the host issue times) after each flush, before the launch's first
    event, so that the host has issued the launch before the GPU reaches it and the
    events time its kernels alone. 0 (the default) is the protocol as it stood. With
    ``host`` (a dict), each launch's host issue time goes to ``host["issue_ms"]`` and the
    wait used to ``host["lead_ms"]``."""
    if not fns:
        raise ValueError("time_interleaved needs at least one launch")
    lead_for([], lead_ms)  # a bad value fails before any launch
    k = len(fns)
    for f in fns:
        f()
    if not torch.cuda.is_available():
        times: list[list[float]] = [[] for _ in fns]
        for i in _turns(max(cpu_reps, 1), k):
            start = time.perf_counter()
            fns[i]()
            times[i].append((time.perf_counter() - start) * 1e3)
        return [Timing(*_quantiles(ts), interpreter=True) for ts in times]

    torch.cuda.synchronize()
    issue: list[float] = []
    if host is not None or lead_ms == "auto":
        issue = host_issue_ms(fns)
    lead = lead_for(issue, lead_ms)
    if host is not None:
        host.update(issue_ms=issue, lead_ms=lead)
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for i in _turns(2, k):
        flush.zero_()
        gpu_wait(lead)
        fns[i]()
    t1.record()
    torch.cuda.synchronize()
    # flush (and wait) included, as do_bench's flush
    per_launch = max(t0.elapsed_time(t1) / (2 * k), 1e-3)
    for i in _turns(max(1, int(warmup_ms / per_launch)), k):
        flush.zero_()
        gpu_wait(lead)
        fns[i]()
    order = _turns(max(1, int(max(rounds, 1) * rep_ms / per_launch)), k)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in order]
    for i, (a, b) in zip(order, events, strict=True):
        flush.zero_()
        gpu_wait(lead)
        a.record()
        fns[i]()
        b.record()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for i, (a, b) in zip(order, events, strict=True):
        times[i].append(a.elapsed_time(b))
    return [Timing(*_quantiles(ts)) for ts in times]


def three_timings(attn: AttnFn, p: Problem, device: torch.device | str, *,
                  warmup_ms: float = 25, rep_ms: float = 100,
                  clocks: ClockSampler | None = None, clock_log: dict[str, Any] | None = None,
                  ) -> dict[str, Timing]:
    """{'fwd': training forward, 'bwd': (fwd+bwd) - fwd, 'infer': inference forward}.
    With ``clocks`` and ``clock_log``, the GPU clocks during each of the three do_bench
    runs go to ``clock_log['fwd' | 'fwd_bwd' | 'infer']``."""
    q, k, v = make_inputs(p, device, requires_grad=True)
    do = torch.randn_like(q)

    def fwd() -> None:
        attn(q, k, v)

    def fwd_bwd() -> None:
        o = attn(q, k, v)
        torch.autograd.backward(o, do)

    with _clocks(clocks, clock_log, "fwd"):
        t_fwd = time_fn(fwd, warmup_ms=warmup_ms, rep_ms=rep_ms)
    with _clocks(clocks, clock_log, "fwd_bwd"):
        t_fb = time_fn(fwd_bwd, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=(q, k, v))
    qi, ki, vi = (t.detach() for t in (q, k, v))

    def infer() -> None:
        with torch.no_grad():
            attn(qi, ki, vi)

    with _clocks(clocks, clock_log, "infer"):
        t_inf = time_fn(infer, warmup_ms=warmup_ms, rep_ms=rep_ms)
    return {"fwd": t_fwd, "bwd": _backward(t_fwd, t_fb), "infer": t_inf}


def _backward(t_fwd: Timing, t_fb: Timing) -> Timing:
    """The backward's timing: (forward+backward) - forward, quantile by quantile."""
    return Timing(max(t_fb.median_ms - t_fwd.median_ms, 1e-6),
                  max(t_fb.p20_ms - t_fwd.p20_ms, 1e-6), max(t_fb.p80_ms - t_fwd.p80_ms, 1e-6),
                  t_fb.interpreter)


def error_text(e: BaseException, limit: int = 200) -> str:
    """``e`` in one line: its type and the start of its message (an implementation that
    cannot run a shape, in a benchmark's errors)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:limit]}"


KINDS = ("fwd", "fwd_bwd", "infer")


def _launch(kind: str, attn: AttnFn, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            do: torch.Tensor) -> Callable[[], None]:
    """A zero-argument launch of ``attn`` for one of the protocol's timing kinds, on inputs
    that require grad: "fwd" (the training forward), "fwd_bwd" (forward and backward, the
    gradients stored, never added to the last call's) or "infer" (no grad)."""
    if kind == "fwd":
        def run() -> None:
            attn(q, k, v)
    elif kind == "fwd_bwd":
        def run() -> None:
            for t in (q, k, v):  # store the gradients, never add them (as time_fn's reset)
                t.grad = None
            torch.autograd.backward(attn(q, k, v), do)
    elif kind == "infer":
        qi, ki, vi = (t.detach() for t in (q, k, v))

        def run() -> None:
            with torch.no_grad():
                attn(qi, ki, vi)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return run


def three_timings_interleaved(attns: Mapping[str, AttnFn], p: Problem,
                              device: torch.device | str, *, warmup_ms: float = 25,
                              rep_ms: float = 100, rounds: int = 1,
                              errors: dict[str, str] | None = None,
                              clocks: ClockSampler | None = None,
                              clock_log: dict[str, Any] | None = None,
                              first_calls: dict[str, float] | None = None,
                              lead_ms: float | str = 0.0,
                              host_log: dict[str, Any] | None = None,
                              ) -> dict[str, dict[str, Timing]]:
    """:func:`three_timings` of several implementations side by side: each of the three
    timings runs every implementation in one loop (:func:`time_interleaved`: in turn, L2
    flushed before each launch), so every one meets the same clocks. Timed one after
    another, the implementation that follows an idle GPU (a compile) runs in the clocks'
    fast first 100-odd ms and the ones after it in the sagged ones (BENCHMARKS.md, "Why the
    final re-timing disagreed with itself").

    Every implementation shares one set of inputs. One that fails its first call in any
    of the three is left out, with its error in ``errors`` (name: text). With ``clocks``
    and ``clock_log``, the GPU clocks during each timing's loop (after the first calls)
    go to ``clock_log['fwd' | 'fwd_bwd' | 'infer']``. ``first_calls`` gets each
    implementation's seconds for its three untimed first calls (its compiles, plan builds
    and loads from the caches: where a cold bench's time goes).

    ``lead_ms``: :func:`time_interleaved`'s GPU wait before each timed launch. With
    ``host_log``, each timing's host issue times go to ``host_log[kind]``: "issue_ms"
    (name: ms), "lead_ms", and "host_bound", the implementations whose host issue time
    was at least 0.8 of their timed median and not covered by the lead (their reading is
    mostly host time)."""
    q, k, v = make_inputs(p, device, requires_grad=True)
    do = torch.randn_like(q)
    kinds = {kind: functools.partial(_launch, kind, q=q, k=k, v=v, do=do) for kind in KINDS}
    ok: dict[str, AttnFn] = {}
    for name, attn in attns.items():
        start = time.perf_counter()
        try:  # the first call of each kind: compiles, and says what cannot run
            for make in kinds.values():
                make(attn)()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if first_calls is not None:
                first_calls[name] = time.perf_counter() - start
        except Exception as e:
            if errors is not None:
                errors[name] = error_text(e)
            continue
        finally:
            for t in (q, k, v):
                t.grad = None
        ok[name] = attn
    names = list(ok)
    if not names:
        return {}
    got: dict[str, list[Timing]] = {}
    for kind, make in kinds.items():
        host: dict[str, Any] | None = {} if host_log is not None else None
        with _clocks(clocks, clock_log, kind):
            got[kind] = time_interleaved([make(ok[n]) for n in names], warmup_ms=warmup_ms,
                                         rep_ms=rep_ms, rounds=rounds, lead_ms=lead_ms,
                                         host=host)
        if host_log is not None and host and host["issue_ms"]:
            issue = dict(zip(names, host["issue_ms"], strict=True))
            host_log[kind] = {
                "issue_ms": {n: round(ms, 4) for n, ms in issue.items()},
                "lead_ms": round(host["lead_ms"], 4),
                "host_bound": [n for n, t in zip(names, got[kind], strict=True)
                               if issue[n] >= max(0.8 * t.median_ms, host["lead_ms"])]}
    out: dict[str, dict[str, Timing]] = {}
    for i, n in enumerate(names):
        out[n] = {"fwd": got["fwd"][i], "bwd": _backward(got["fwd"][i], got["fwd_bwd"][i]),
                  "infer": got["infer"][i]}
    return out


def _sdpa(backend_name: str, p: Problem) -> AttnFn:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = getattr(SDPBackend, backend_name)
    gqa = p.heads_q != p.heads_kv

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            if gqa:
                return sdpa(q, k, v, is_causal=p.causal, enable_gqa=True)
            return sdpa(q, k, v, is_causal=p.causal)

    return run


def _flex(p: Problem) -> AttnFn:
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Each shape is a recompile; without headroom dynamo silently falls back to eager.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = None
    if p.causal:
        off = p.seqlen_k - p.seqlen_q

        def causal(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            return ki <= qi + off

        mask = create_block_mask(causal, None, None, p.seqlen_q, p.seqlen_k, device="cuda")
    gqa = p.heads_q != p.heads_kv

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, block_mask=mask, enable_gqa=gqa)  # type: ignore[no-any-return]

    return run


ANCHOR_NAMES = ("cudnn", "fa2", "efficient", "flex")


def anchors_apply(p: Problem) -> bool:
    """Whether the anchors can run ``p``: SDPA semantics (Sq == Sk for causal, no window or
    softcap, no packed batch; benchmarks/bench_varlen.py compares those)."""
    return not (p.has_window or p.softcap > 0 or (p.causal and p.seqlen_q != p.seqlen_k)
                or p.packed)


def anchors(p: Problem, names: Sequence[str] = ANCHOR_NAMES) -> dict[str, AttnFn]:
    """The protocol's anchor implementations for ``p`` (CUDA only; none where
    :func:`anchors_apply` says no), those of ``names`` only."""
    if not anchors_apply(p):
        return {}
    makers: dict[str, Callable[[], AttnFn]] = {
        "cudnn": lambda: _sdpa("CUDNN_ATTENTION", p),
        "fa2": lambda: _sdpa("FLASH_ATTENTION", p),
        "efficient": lambda: _sdpa("EFFICIENT_ATTENTION", p),
        "flex": lambda: _flex(p),
    }
    return {n: makers[n]() for n in ANCHOR_NAMES if n in names}


SDPA_ANCHORS = ("cudnn", "fa2", "efficient")


def anchor_launches(p: Problem, kind: str, names: Sequence[str] = SDPA_ANCHORS,
                    errors: dict[str, str] | None = None) -> dict[str, Callable[[], None]]:
    """Zero-argument launches of the anchors of ``names`` that run ``p``, of one timing
    kind (see :func:`_launch`), on one set of inputs of their own: company for a loop of
    flashtune's launches (the tuner's anchored timing). Each is called once here; one
    whose first call fails is left out, with its error in ``errors``. CUDA only."""
    fns = anchors(p, names)
    if not fns:
        return {}
    q, k, v = make_inputs(p, "cuda", requires_grad=True)
    do = torch.randn_like(q)
    out: dict[str, Callable[[], None]] = {}
    for name, attn in fns.items():
        run = _launch(kind, attn, q=q, k=k, v=v, do=do)
        try:
            with warnings.catch_warnings():  # SDPA's long why-not; the error says it
                warnings.simplefilter("ignore", UserWarning)
                run()
            torch.cuda.synchronize()
        except Exception as e:  # an anchor that cannot run this shape keeps no place
            if errors is not None:
                errors[name] = error_text(e)
            continue
        out[name] = run
    return out


def warm_flex(problem: dict[str, Any]) -> tuple[float, str]:
    """Compile FlexAttention's three calls of ``problem`` (training forward,
    forward+backward, inference) in this process, as the bench's first calls make them,
    so that their compiled graphs and kernels land in the on-disk caches (inductor's, and
    Triton's) that a bench process then loads instead of compiling: (seconds, "" or the
    error). For a pool of processes started before a bench (``autotune bench
    --warm-flex``)."""
    t0 = time.perf_counter()
    try:
        p = Problem.from_dict(problem)
        fns = anchors(p, ("flex",))
        if fns:
            errors: dict[str, str] = {}
            three_timings_interleaved(fns, p, "cuda", warmup_ms=1, rep_ms=1, errors=errors)
            if errors:
                return time.perf_counter() - t0, errors["flex"]
            torch.cuda.empty_cache()
    except Exception as e:  # the bench's own first call meets it again and reports it
        return time.perf_counter() - t0, error_text(e)
    return time.perf_counter() - t0, ""


def standard_matrix() -> list[Problem]:
    """DESIGN.md's standard matrix: B*S = 16384 tokens, Hq*D = 2048, bf16."""
    out = []
    for d in (64, 128):
        for causal in (False, True):
            for s in (512, 1024, 2048, 4096, 8192, 16384):
                h = 2048 // d
                out.append(Problem(batch=16384 // s, heads_q=h, heads_kv=h, seqlen_q=s,
                                   seqlen_k=s, head_dim=d, dtype="bf16", causal=causal))
    for causal in (False, True):
        out.append(Problem(batch=4, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_k=4096,
                           head_dim=128, dtype="bf16", causal=causal))
        for s in (1000, 3000):
            out.append(Problem(batch=max(16384 // s, 1), heads_q=16, heads_kv=16, seqlen_q=s,
                               seqlen_k=s, head_dim=128, dtype="bf16", causal=causal))
    return out


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
