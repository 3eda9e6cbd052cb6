"""Measuring one candidate: the correctness gate, then the house timing protocol.

These functions run inside the tuner's worker subprocess (``_worker.py``) but import
nothing of it, so each piece can be tested alone:

- :func:`gate` checks the candidate against the fp32 reference under the 2x rule
  (``flashtune.kernels.reference.compare``) on fresh random inputs drawn from the
  trial's seed: O and the LSE for a forward config, dq, dk and dv for a backward one.
- :class:`Bench` times a config with ``flashtune.timing.time_fn`` (do_bench median
  with an L2 flush after warmup on CUDA; a host-clock loop under the interpreter,
  labelled as such). A backward config is timed as the backward launcher alone, on a
  forward output made once with the heuristic default, with
  ``flashtune.timing.time_parts``: the same protocol for the whole, plus the median
  of each of its three launches (preprocess, dK/dV, dQ), which the tuner recombines.
  Beside a reference config (the search's incumbent), :meth:`Bench.time_against` times
  the two in pairs (``flashtune.timing.time_against``) and gives their ratio.
- :func:`classify` sorts an exception into "prune" (the candidate cannot compile or
  does not fit: out of resources) or "error"; :func:`poisons_context` says whether the
  CUDA context is unusable afterwards (illegal address and friends), in which case
  the worker must be replaced.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from flashtune.kernels.config import BwdConfig, FwdConfig, default_fwd
from flashtune.problem import Problem, default_scale
from flashtune.timing import (
    Against,
    Timing,
    make_inputs,
    packed_layout,
    time_against,
    time_fn,
    time_interleaved,
    time_parts,
)

# The gate materialises fp32 scores of size B*Hq*Sq*Sk (in slices, once per problem and
# direction). Above this many score elements it runs on a problem with fewer batches and
# heads: a tile config's correctness does not depend on how many (batch, head) programs
# there are. The reference draws its inputs on the host, so the query rows count too.
GATE_MAX_SCORES = 1 << 26
GATE_MAX_ROWS = 1 << 16


def _same_multiples(a: int, b: int) -> bool:
    """Whether Triton specializes an int argument alike (equal to 1; divisible by 16) for
    ``a`` and ``b`` and for every pair of multiples ``r * a``, ``r * b``: a head count a
    launch passes, alone or times a factor (virtual KV heads pass ``hopper_kv_rep`` x the
    KV heads), keeps its class for every factor exactly when both share their largest
    power-of-two divisor up to 16. A head count outside the class of the timed problem's
    would make the gate compile every candidate again, on the critical path."""
    return (a == 1) == (b == 1) and math.gcd(a, 16) == math.gcd(b, 16)


def _split_heads(batch: int, hq: int, hk: int) -> list[tuple[int, int]]:
    """(query heads, KV heads) of each part the Gluon backward runs a call of ``batch``
    sequences in with ``hopper_split=2`` (``attn_bwd_hopper.split_plan``: halves of the
    batch, else of the KV heads): the head counts its launches pass. Without Gluon there
    is no such kernel, and the call is one part."""
    try:
        from flashtune.kernels.attn_bwd_hopper import split_plan
    except ImportError:  # pragma: no cover - a Triton without Gluon
        return [(hq, hk)]
    return [(len(range(hq)[sq]), len(range(hk)[sk]))
            for _, sq, sk in split_plan(batch, hq, hk, 2)]


def launches_alike(p: Problem, batch: int, hq: int, hk: int) -> bool:
    """Whether ``p`` reduced to ``batch`` sequences of ``hq`` query and ``hk`` KV heads
    passes its launches head counts of the classes ``p``'s do (:func:`_same_multiples`),
    whole and in each part of a split Gluon backward (:func:`_split_heads`)."""
    mine, theirs = _split_heads(batch, hq, hk), _split_heads(p.batch, p.heads_q, p.heads_kv)
    return (_same_multiples(hq, p.heads_q) and _same_multiples(hk, p.heads_kv)
            and len(mine) == len(theirs)
            and all(_same_multiples(a, c) and _same_multiples(x, y)
                    for (a, x), (c, y) in zip(mine, theirs, strict=True)))


def gate_problem(p: Problem) -> Problem:
    """``p``, or ``p`` with batch and then heads reduced so the reference stays small
    (every tile config still sees the full sequence lengths, masks and GQA ratio). A
    packed problem keeps its sequences (the reference checks one at a time) and loses
    heads only. Each reduction is made only while the head counts that the launches pass
    keep the specialization classes of ``p``'s (:func:`launches_alike`), so the gate runs
    the binaries the compile pool built (``flashtune.autotune._compile.compile_inputs``)
    and that are then timed: on every dense preset problem its launches keep their
    arguments' classes (tests/autotune/test_compile_inputs.py). Halving the heads of
    8x32x2048x64 left each half 8 heads to the timed halves' 32, and every split
    candidate compiled again inside the gate (2.5-2.8 s a trial, H200, session 64). Past
    that the reference runs in slices."""
    per_bh = p.seqlen_q * p.seqlen_k
    batch, hq, hk = p.batch, p.heads_q, p.heads_kv

    def big() -> bool:
        if p.packed:
            return hq * per_bh > GATE_MAX_SCORES or hq * p.total_q > GATE_MAX_ROWS
        return (batch * hq * per_bh > GATE_MAX_SCORES
                or batch * hq * p.seqlen_q > GATE_MAX_ROWS)

    while batch > 1 and big() and not p.packed and launches_alike(p, batch // 2, hq, hk):
        batch //= 2
    while hk > 1 and hk % 2 == 0 and big() and launches_alike(p, batch, hq // 2, hk // 2):
        hk //= 2
        hq //= 2
    return replace(p, batch=batch, heads_q=hq, heads_kv=hk)


def gate_case(problem: Problem, direction: str, *, device: str, seed: int) -> Any:
    """A :class:`~flashtune.kernels.reference.GateCase` of ``problem`` (reduced by
    :func:`gate_problem`): fresh inputs drawn from ``seed`` and their fp32 reference."""
    from flashtune.kernels import reference

    gen = torch.Generator(device="cpu").manual_seed(seed)
    return reference.GateCase(gate_problem(problem), direction, device=device, generator=gen)


def gate(problem: Problem, direction: str, config: FwdConfig | BwdConfig, *,
         device: str, seed: int) -> Any:
    """The correctness gate (2x rule against fp32) on fresh inputs seeded by ``seed``."""
    return gate_case(problem, direction, device=device, seed=seed).check(config)


Status = Literal["ok", "gate", "prune", "error"]
"""A measurement's outcome; the worker's process adds "died" and "timeout" (ReplyStatus)."""
ReplyStatus = Literal["ok", "gate", "prune", "error", "died", "timeout"]


def classify(exc: BaseException) -> Literal["prune", "error"]:
    """"prune" for compile errors, out-of-resources and a config the launcher finds it
    cannot run (InfeasibleConfigError), "error" for anything else."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & {"CompilationError", "OutOfResources", "CompileTimeAssertionFailure",
                "InfeasibleConfigError"}:
        return "prune"
    text = str(exc)
    if "out of resource" in text.lower() or "PTXAS error" in text or "ptxas" in text.lower():
        return "prune"
    return "error"


def poisons_context(exc: BaseException) -> bool:
    """True if ``exc`` leaves the CUDA context unusable (the worker must be replaced)."""
    if not torch.cuda.is_available():
        return False
    text = str(exc)
    return any(s in text for s in ("illegal memory access", "illegal instruction",
                                   "unspecified launch failure", "misaligned address",
                                   "CUDA error", "device-side assert"))


class Bench:
    """Timing inputs for one problem, made once, and launchers per config."""

    def __init__(self, problem: Problem, device: str, seed: int = 0):

        self.problem = p = problem
        self.device = device
        # Drawn on the device: on the CPU the inputs of a large problem took about 1 s
        # of the first trial's wait (their values do not change a kernel's time).
        gen = torch.Generator(device=device).manual_seed(seed)
        self.q, self.k, self.v = q, k, v = make_inputs(p, device, generator=gen)
        self.kw: dict[str, Any] = dict(causal=p.causal, sm_scale=default_scale(p.head_dim),
                                       window=p.window, softcap=p.softcap)
        layout = packed_layout(p, device)
        if layout is not None:  # a packed problem: its representative packed batch
            from flashtune.kernels.attn_fwd import Packed

            self.kw["packed"] = Packed(*layout)
        self._fwd_out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._do = torch.randn(q.shape, generator=gen, dtype=torch.float32,
                               device=device).to(q.dtype)
        self._cases: dict[str, Any] = {}

    def case(self, direction: str, seed: int) -> tuple[Any, float]:
        """The gate case of ``direction`` (made on first use from ``seed``, then kept: the
        reference is computed once per problem and direction), and the seconds spent
        making it now (0 when it was already made)."""
        c = self._cases.get(direction)
        if c is not None:
            return c, 0.0
        t0 = time.perf_counter()
        c = self._cases[direction] = gate_case(self.problem, direction, device=self.device,
                                               seed=seed)
        _sync()
        return c, time.perf_counter() - t0

    def prepare(self, direction: str, seed: int) -> dict[str, float]:
        """What the first measurement of the problem would do besides the candidate:
        the gate case and its fp32 reference, and for the backward the forward (default
        config) whose output and log-sum-exp it reads, compiled on first use. The search
        asks for it while the compile pool builds the first candidate, so the two
        overlap. Returns the seconds of each: ``forward_s`` (0 for the forward),
        ``case_s`` and their sum ``seconds``."""
        t0 = time.perf_counter()
        if direction == "bwd":
            self._bwd_args()
            _sync()
        t1 = time.perf_counter()
        self.case(direction, seed)
        _sync()
        t2 = time.perf_counter()
        return {"seconds": t2 - t0, "forward_s": t1 - t0, "case_s": t2 - t1}

    def _bwd_args(self) -> tuple[torch.Tensor, ...]:
        import flashtune.kernels.attn_fwd as fwd_mod

        if self._fwd_out is None:
            self._fwd_out = fwd_mod.attn_fwd(self.q, self.k, self.v,
                                             config=default_fwd(self.problem), **self.kw)
        o, lse = self._fwd_out
        return self._do, self.q, self.k, self.v, o, lse

    def fn(self, direction: str, config: FwdConfig | BwdConfig) -> Callable[[], Any]:
        """A zero-argument launch of ``config`` (the forward, or the backward launcher).

        The forward's launch is prepared once (a :class:`FwdLaunch`, as the hot path keeps
        one per call signature), so a call costs the host what a user's call does. Built
        per call (``attn_fwd``: plan, descriptors, binding), its host time can exceed what
        the GPU spends on a short forward and the L2 flush before it; the stream then runs
        dry and the CUDA events around the kernel time the host's wait too. That is the
        suspected cause, not yet confirmed on a GPU, of final re-timings that read short
        forwards 1.4-1.9x slower than their own trials (BENCHMARKS.md, issue 17, session
        23)."""
        import flashtune.kernels.attn_bwd as bwd_mod
        import flashtune.kernels.attn_fwd as fwd_mod

        q, k, v, kw = self.q, self.k, self.v, self.kw
        cfg: Any = config
        if direction == "fwd":
            launch = fwd_mod.FwdLaunch(q, k, v, config=cfg, **kw)
            packed = kw.get("packed")
            if packed is None:
                return lambda: launch(q, k, v)
            return lambda: launch(q, k, v, packed.cu_q, packed.cu_k)
        args = self._bwd_args()
        det = self.problem.deterministic
        return lambda: bwd_mod.attn_bwd(*args, config=cfg, deterministic=det, **kw)

    def launch(self, direction: str, config: FwdConfig | BwdConfig) -> Callable[[], None]:
        """A zero-argument launch of exactly what :meth:`time_with_parts` times: the
        forward, or the backward's launches back to back (buffers made once)."""
        if direction == "fwd":
            return self.fn(direction, config)
        from flashtune.kernels.attn_bwd import bwd_steps

        cfg: Any = config
        _, steps = bwd_steps(*self._bwd_args(), config=cfg,
                             deterministic=self.problem.deterministic, **self.kw)

        def whole() -> None:
            for _, f in steps:
                f()

        return whole

    def time(self, direction: str, config: FwdConfig | BwdConfig, **timing: Any) -> Timing:
        """The timing of ``config`` (keywords of :meth:`time_with_parts`)."""
        return self.time_with_parts(direction, config, **timing)[0]

    def time_with_parts(self, direction: str, config: FwdConfig | BwdConfig, *,
                        warmup_ms: float = 25, rep_ms: float = 100, cpu_reps: int = 3,
                        rel_tol: float | None = None, min_reps: int = 8,
                        abandon_ms: float | None = None) -> tuple[Timing, dict[str, float]]:
        """The timing, and for the backward the median ms of each launch by part name.

        ``rel_tol``/``min_reps``/``abandon_ms``: stop as soon as the noise allows (see
        :func:`flashtune.timing.time_parts`); without them, the house protocol."""
        adaptive: dict[str, Any] = dict(rel_tol=rel_tol, min_reps=min_reps,
                                        abandon_ms=abandon_ms)
        if direction == "fwd":
            if rel_tol is None:
                return time_fn(self.fn(direction, config), warmup_ms=warmup_ms, rep_ms=rep_ms,
                               cpu_reps=cpu_reps), {}
            return time_parts([self.fn(direction, config)], warmup_ms=warmup_ms,
                              rep_ms=rep_ms, cpu_reps=cpu_reps, **adaptive)[0], {}
        from flashtune.kernels.attn_bwd import bwd_steps

        cfg: Any = config
        _, steps = bwd_steps(*self._bwd_args(), config=cfg,
                             deterministic=self.problem.deterministic, **self.kw)
        tm, per = time_parts([f for _, f in steps], warmup_ms=warmup_ms, rep_ms=rep_ms,
                             cpu_reps=cpu_reps, **adaptive)
        return tm, {name: ms for (name, _), ms in zip(steps, per, strict=True)}

    def time_against(self, direction: str, config: FwdConfig | BwdConfig,
                     against: FwdConfig | BwdConfig, *, warmup_ms: float = 10,
                     rep_ms: float = 100, cpu_reps: int = 3, rel_tol: float = 0.01,
                     min_reps: int = 8, abandon_ratio: float | None = None,
                     ) -> tuple[Against, dict[str, float]]:
        """``config`` timed in pairs with ``against`` (:func:`flashtune.timing.
        time_against`), and for the backward the median ms of each of its launches by part
        name."""
        kw: dict[str, Any] = dict(warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_reps=cpu_reps,
                                  rel_tol=rel_tol, min_reps=min_reps,
                                  abandon_ratio=abandon_ratio)
        ref = self.launch(direction, against)
        if direction == "fwd":
            return time_against([self.fn(direction, config)], ref, **kw), {}
        from flashtune.kernels.attn_bwd import bwd_steps

        cfg: Any = config
        _, steps = bwd_steps(*self._bwd_args(), config=cfg,
                             deterministic=self.problem.deterministic, **self.kw)
        res = time_against([f for _, f in steps], ref, **kw)
        return res, {name: ms for (name, _), ms in zip(steps, res.parts_ms, strict=True)}


@dataclass
class Measurement:
    """What one trial measured. ``status``: "ok", "gate" (wrong result), "prune" (cannot
    compile / out of resources) or "error" (raised at run time)."""

    status: Status
    median_ms: float = math.nan
    p20_ms: float = math.nan
    p80_ms: float = math.nan
    max_error: float = math.nan
    ratio: float = math.nan
    detail: str = ""
    compile_s: float = 0.0
    gate_s: float = 0.0
    reference_s: float = 0.0
    time_s: float = 0.0
    interpreter: bool = False
    poisoned: bool = False
    parts_ms: dict[str, float] = field(default_factory=dict)
    # Timed against a reference config (``measure(..., against=...)``): the median of
    # this config's time over the reference's, pair by pair, and the reference's median.
    against_ratio: float = math.nan
    against_ms: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "parts_ms": dict(self.parts_ms)}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(bench: Bench, direction: str, config: FwdConfig | BwdConfig, *, seed: int,
            warmup_ms: float = 25, rep_ms: float = 100, cpu_reps: int = 3,
            rel_tol: float | None = None, min_reps: int = 8,
            abandon_ms: float | None = None, against: FwdConfig | BwdConfig | None = None,
            abandon_ratio: float | None = None) -> Measurement:
    """First launch (compile, or load from Triton's cache), the gate, then the timing.

    The gate runs on the bench's gate case for ``direction`` (made from ``seed`` by the
    first measurement of the problem, then reused: ``reference_s`` is its cost, inside
    ``gate_s``). The timing keywords go to :meth:`Bench.time_with_parts`; with
    ``against`` and an adaptive timing (``rel_tol``), to :meth:`Bench.time_against`
    instead (``abandon_ratio`` in place of ``abandon_ms``), and the measurement carries
    the ratio; where that pair raises (and leaves the CUDA context usable), the candidate
    is timed alone, so that a failure of the reference is never the candidate's."""
    interp = bench.device == "cpu"
    t0 = time.perf_counter()
    ref_s = 0.0
    try:
        bench.fn(direction, config)()
        _sync()
        t1 = time.perf_counter()
        case, ref_s = bench.case(direction, seed)
        cmp = case.check(config)
        t2 = time.perf_counter()
        if not cmp.ok:
            return Measurement("gate", max_error=cmp.max_error, ratio=cmp.ratio,
                               detail=f"correctness gate failed: {cmp.detail}",
                               compile_s=t1 - t0, gate_s=t2 - t1, reference_s=ref_s,
                               interpreter=interp)
        ratio = ref_ms = math.nan
        paired = against is not None and rel_tol is not None
        if against is not None and rel_tol is not None:
            try:
                res, parts = bench.time_against(
                    direction, config, against, warmup_ms=warmup_ms, rep_ms=rep_ms,
                    cpu_reps=cpu_reps, rel_tol=rel_tol, min_reps=min_reps,
                    abandon_ratio=abandon_ratio)
                tm, ratio, ref_ms = res.timing, res.ratio, res.ref.median_ms
            except Exception as e:
                # The pair failed: the candidate, or the reference beside it (its buffers
                # too, say). The candidate alone decides which; the pair's error is lost.
                if poisons_context(e):
                    raise
                paired = False
        if not paired:
            tm, parts = bench.time_with_parts(direction, config, warmup_ms=warmup_ms,
                                              rep_ms=rep_ms, cpu_reps=cpu_reps,
                                              rel_tol=rel_tol, min_reps=min_reps,
                                              abandon_ms=abandon_ms)
    except Exception as e:  # every failure of a candidate is data, never fatal
        kind = classify(e)
        return Measurement(kind, detail=f"{type(e).__name__}: {str(e)[:500]}",
                           compile_s=time.perf_counter() - t0, reference_s=ref_s,
                           interpreter=interp, poisoned=poisons_context(e))
    t3 = time.perf_counter()
    if not all(math.isfinite(x) and x > 0 for x in (tm.median_ms, tm.p20_ms, tm.p80_ms)):
        return Measurement("error", detail=f"non-finite timing {tm}", interpreter=interp)
    return Measurement("ok", tm.median_ms, tm.p20_ms, tm.p80_ms, cmp.max_error, cmp.ratio,
                       cmp.detail, compile_s=t1 - t0, gate_s=t2 - t1, reference_s=ref_s,
                       time_s=t3 - t2, interpreter=tm.interpreter, parts_ms=parts,
                       against_ratio=ratio, against_ms=ref_ms)


def retime(bench: Bench, direction: str, configs: list[FwdConfig | BwdConfig], *,
           rounds: int = 5, company: Sequence[Callable[[], Any]] = (),
           **timing: Any) -> list[Timing]:
    """Time the configs against one another. With the house protocol (no ``rel_tol``),
    their launches are interleaved in one loop (:func:`flashtune.timing.time_interleaved`,
    ``rounds`` x ``rep_ms`` of repetitions each), so that the GPU's clocks, which drift
    and dip under a sustained load, meet every candidate alike; ``company``: other
    launches (the anchors') taken in the same loop, after the configs, their timings
    returned after the configs'. With the search's adaptive timing (a new incumbent's
    confirmation), each is timed in turn, ``rounds`` times in alternating order, and
    keeps the median. ``timing``: keywords of :meth:`Bench.time_with_parts`."""
    if timing.get("rel_tol") is None:
        kw = {k: timing[k] for k in ("warmup_ms", "rep_ms", "cpu_reps") if k in timing}
        return time_interleaved([*(bench.launch(direction, c) for c in configs), *company],
                                rounds=rounds, **kw)
    if company:
        raise ValueError("company is timed only in the house protocol's interleaved loop "
                         "(rel_tol=None)")
    per: list[list[Timing]] = [[] for _ in configs]
    for r in range(max(rounds, 1)):
        order = list(enumerate(configs))
        for i, c in (order if r % 2 == 0 else order[::-1]):
            per[i].append(bench.time(direction, c, **timing))
    out = []
    for ts in per:
        meds = sorted(t.median_ms for t in ts)
        mid = len(meds) // 2
        med = meds[mid] if len(meds) % 2 else 0.5 * (meds[mid - 1] + meds[mid])
        p20 = sorted(t.p20_ms for t in ts)[mid]
        p80 = sorted(t.p80_ms for t in ts)[mid]
        out.append(Timing(med, min(p20, med), max(p80, med), ts[0].interpreter))
    return out
