"""The backward timed launch by launch: the parts the tuner recombines."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashtune.autotune.measure import Bench
from flashtune.kernels.attn_bwd import BWD_PARTS, ONE_LAUNCH_PART, attn_bwd, bwd_steps
from flashtune.kernels.config import (
    BWD_ATOMIC,
    BWD_FUSED,
    BWD_ONE_LAUNCH,
    BWD_TWO_KERNEL,
    BwdConfig,
    default_fwd,
)
from flashtune.problem import Problem
from flashtune.timing import time_parts

P = Problem(batch=1, heads_q=2, heads_kv=1, seqlen_q=40, seqlen_k=56, head_dim=32,
            dtype="bf16", causal=True)


@pytest.mark.parametrize("variant, names", [
    (BWD_TWO_KERNEL, list(BWD_PARTS)),
    (BWD_ATOMIC, list(BWD_PARTS)),  # "dq" scales and casts the atomically summed dQ
    (BWD_ONE_LAUNCH, ["pre", ONE_LAUNCH_PART]),
    (BWD_FUSED, [ONE_LAUNCH_PART]),  # no preprocess: delta is computed in the programs
])
def test_steps_in_order_are_the_backward(variant: int, names: list[str], device: str,
                                         seed: int) -> None:
    det = variant != BWD_ATOMIC
    bench = Bench(dataclasses.replace(P, deterministic=det), device, seed=seed)
    args = bench._bwd_args()
    cfg = BwdConfig(dkdv_block_m=16, dkdv_block_n=32, dq_block_m=32,
                    dq_block_n=32 if variant == BWD_ATOMIC else 16, variant=variant)
    whole = attn_bwd(*args, config=cfg, deterministic=det, **bench.kw)
    grads, steps = bwd_steps(*args, config=cfg, deterministic=det, **bench.kw)
    assert [name for name, _ in steps] == names
    for _, launch in steps:
        launch()
    for a, b in zip(whole, grads, strict=True):
        if det or device == "cpu":  # the interpreter runs the atomics in program order
            assert torch.equal(a, b)  # deterministic: same launches, same bits
        else:
            torch.testing.assert_close(a, b)
    _, parts = bench.time_with_parts("bwd", cfg, warmup_ms=1, rep_ms=2, cpu_reps=1)
    assert list(parts) == names


def test_backward_timing_reports_each_launch(device: str, seed: int) -> None:
    bench = Bench(P, device, seed=seed)
    tm, parts = bench.time_with_parts("bwd", BwdConfig(dkdv_block_n=32, dq_block_m=32),
                                      warmup_ms=1, rep_ms=5, cpu_reps=1)
    assert list(parts) == list(BWD_PARTS)
    assert all(ms > 0 for ms in parts.values())
    assert tm.interpreter == (device == "cpu")
    # One repetition: the whole is exactly its parts back to back (host clock); on a GPU
    # the medians of the parts add up to the whole's within the gaps between launches.
    rel = 1e-9 if device == "cpu" else 0.15
    assert sum(parts.values()) == pytest.approx(tm.median_ms, rel=rel)
    fwd_tm, fwd_parts = bench.time_with_parts("fwd", default_fwd(P), warmup_ms=1, rep_ms=5,
                                              cpu_reps=1)
    assert fwd_parts == {} and fwd_tm.median_ms > 0


def test_a_packed_problem_is_gated_and_timed_on_packed_inputs(device: str, seed: int) -> None:
    from flashtune.autotune.measure import measure
    from flashtune.kernels.config import default_bwd

    p = Problem(batch=4, heads_q=2, heads_kv=1, seqlen_q=40, seqlen_k=40, head_dim=32,
                dtype="bf16", causal=True, total_q=90, total_k=90)
    bench = Bench(p, device, seed=seed)
    assert bench.q.shape == (90, 2, 32) and bench.kw["packed"].max_q == 40
    for direction, cfg in (("fwd", default_fwd(p)), ("bwd", default_bwd(p))):
        m = measure(bench, direction, cfg, seed=seed, cpu_reps=1)
        assert m.status == "ok", m.detail


def test_time_parts_needs_a_launch() -> None:
    with pytest.raises(ValueError, match="at least one"):
        time_parts([])


@pytest.mark.gpu
def test_time_parts_on_gpu_separates_unequal_launches() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    small, big = (lambda: a[:512] @ a[:, :512]), (lambda: a @ a)
    tm, (t_small, t_big) = time_parts([small, big], warmup_ms=5, rep_ms=50)
    assert t_big > 4 * t_small > 0
    assert t_small + t_big == pytest.approx(tm.median_ms, rel=0.1)
    assert not tm.interpreter


@pytest.mark.gpu
def test_adaptive_timing_stops_when_the_median_is_known_and_abandons_slow_candidates() -> None:
    """With rel_tol, a steady kernel is timed in far fewer repetitions than the cap; with
    abandon_ms below its time, fewer still; the medians agree with the full protocol."""
    import time

    a = torch.randn(4096, 4096, device="cuda")

    def mm() -> None:
        a @ a

    def timed(**kw: float | None) -> tuple[float, float]:
        t0 = time.perf_counter()
        tm, _ = time_parts([mm], warmup_ms=5, rep_ms=400, **kw)  # type: ignore[arg-type]
        return tm.median_ms, time.perf_counter() - t0

    full_ms, full_s = timed()
    fast_ms, fast_s = timed(rel_tol=0.02)
    slow_ms, slow_s = timed(rel_tol=0.001, abandon_ms=full_ms / 2)
    assert fast_ms == pytest.approx(full_ms, rel=0.05)
    assert slow_ms == pytest.approx(full_ms, rel=0.1)
    assert fast_s < 0.5 * full_s and slow_s < 0.5 * full_s


def test_median_interval_covers_the_true_median_about_95_percent(seed: int) -> None:
    """Over many samples of a distribution whose median is known (0), the interval holds
    it about 95% of the time (93% at n=31), and it narrows as the sample grows."""
    from flashtune.timing import median_interval

    gen = torch.Generator().manual_seed(seed)
    covered, widths = 0, {31: [], 301: []}
    for n in (31, 301):
        for _ in range(400):
            xs = torch.randn(n, generator=gen).tolist()
            med, lo, hi = median_interval(xs)
            assert lo <= med <= hi
            covered += n == 31 and lo <= 0.0 <= hi
            widths[n].append(hi - lo)
    assert 0.85 <= covered / 400 <= 0.99  # ~93% at n=31 (the ranks are whole numbers)
    assert sum(widths[301]) < 0.5 * sum(widths[31])
    assert median_interval([3.0]) == (3.0, 3.0, 3.0)


def test_gate_reference_is_made_once_per_direction_and_reused(device: str, seed: int) -> None:
    """The first measurement of a problem pays for the reference; later ones check other
    configs against it, and still catch a wrong one."""
    from flashtune.autotune import _faults
    from flashtune.autotune.measure import measure
    from flashtune.kernels.config import FwdConfig

    bench = Bench(P, device, seed=seed)
    first = measure(bench, "fwd", default_fwd(P), seed=seed, cpu_reps=1)
    second = measure(bench, "fwd", FwdConfig(block_m=16, block_n=16, num_warps=2), seed=seed,
                     cpu_reps=1)
    assert first.status == second.status == "ok", (first.detail, second.detail)
    assert first.reference_s > 0 and second.reference_s == 0
    with _faults.kernel_fault("corrupt", "fwd"):
        wrong = measure(bench, "fwd", default_fwd(P), seed=seed, cpu_reps=1)
    assert wrong.status == "gate" and wrong.reference_s == 0
    bwd = measure(bench, "bwd", BwdConfig(dkdv_block_n=32, dq_block_m=32), seed=seed,
                  cpu_reps=1)
    assert bwd.status == "ok" and bwd.reference_s > 0


def test_a_candidate_that_leaves_its_output_unwritten_fails_on_a_reused_case(
        monkeypatch: pytest.MonkeyPatch, device: str, seed: int) -> None:
    """Candidates share one gate case; a kernel that writes nothing, returning memory that
    held the previous candidate's correct answer, must still fail: the case fills each
    candidate's outputs with NaN once it has judged them."""
    import flashtune.kernels.attn_fwd as fwd_mod
    from flashtune.kernels.reference import GateCase

    case = GateCase(P, "fwd", device=device, generator=torch.Generator().manual_seed(seed))
    real = fwd_mod.attn_fwd
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def lazy(*a: object, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not kept:  # computes once, then hands back the same memory unwritten
            kept.append(real(*a, **kw))  # type: ignore[arg-type]
        return kept[0]

    monkeypatch.setattr(fwd_mod, "attn_fwd", lazy)
    assert case.check(default_fwd(P)).ok
    assert bool(torch.isnan(kept[0][0]).all())
    again = case.check(default_fwd(P))
    assert not again.ok and again.max_error == float("inf")


def test_gate_problem_keeps_the_compiled_specialization_and_shrinks_where_it_can() -> None:
    """The gate's problem keeps sequence lengths, masks and the GQA ratio; its head counts
    stay in the timed problem's specialization classes, whole and in each half of a split
    Gluon backward (so the pool's binaries serve it); and it is within the caps unless one
    more halving would leave those classes."""
    from flashtune.autotune import measure as m
    from flashtune.autotune.presets import preset

    probs = [p for name in ("standard", "llama3-8b", "gpt2", "llama3-8b-packed")
             for p in preset(name)]
    for p in probs:
        g = m.gate_problem(p)
        assert (g.seqlen_q, g.seqlen_k, g.causal, g.window, g.total_q, g.head_dim) == \
            (p.seqlen_q, p.seqlen_k, p.causal, p.window, p.total_q, p.head_dim)
        assert g.heads_q * p.heads_kv == p.heads_q * g.heads_kv
        assert m.launches_alike(p, g.batch, g.heads_q, g.heads_kv)
        rows = g.heads_q * (g.total_q if g.packed else g.batch * g.seqlen_q)
        within = rows <= m.GATE_MAX_ROWS and (g.packed or g.batch * g.heads_q * g.seqlen_q
                                              * g.seqlen_k <= m.GATE_MAX_SCORES)
        stuck = (g.batch == 1 or g.packed
                 or not m.launches_alike(p, g.batch // 2, g.heads_q, g.heads_kv)) and not (
            g.heads_kv % 2 == 0
            and m.launches_alike(p, g.batch, g.heads_q // 2, g.heads_kv // 2))
        assert within or stuck, (p, g)
    assert m._same_multiples(32, 16) and not m._same_multiples(16, 8)
    assert not m._same_multiples(2, 1) and not m._same_multiples(8, 4)
    assert m._same_multiples(12, 4) and not m._same_multiples(14, 28)
    # 8x32x2048x64 split in halves of the batch: one sequence would split by heads instead
    # (16 each, the same class); 16 heads would leave each half 8.
    p = Problem(8, 32, 32, 2048, 2048, 64)
    assert m.launches_alike(p, 1, 32, 32) and not m.launches_alike(p, 1, 16, 16)
    assert m.gate_problem(p) == dataclasses.replace(p, batch=1)
    # Virtual KV heads pass r x the KV heads: 8 KV heads (r = 2: 16) cannot become 4 (8).
    g = Problem(16, 64, 8, 1024, 1024, 128, causal=True)
    assert not m.launches_alike(g, 1, 32, 4) and m.gate_problem(g).heads_kv == 8


@pytest.mark.parametrize("packed", [False, True])
def test_the_forward_launch_is_prepared_once(device: str, seed: int, packed: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed forward is a prepared launch (what a user's repeated call runs), built once
    per config: each call gives attn_fwd's output for fresh buffers, and builds nothing."""
    import flashtune.kernels.attn_fwd as fwd_mod

    p = dataclasses.replace(P, total_q=70, total_k=90, batch=2) if packed else P
    bench = Bench(p, device, seed=seed)
    built = []
    real = fwd_mod.FwdLaunch.__init__

    def counting(self, *a, **kw):  # type: ignore[no-untyped-def]
        built.append(1)
        real(self, *a, **kw)

    monkeypatch.setattr(fwd_mod.FwdLaunch, "__init__", counting)
    cfg = default_fwd(p)
    f = bench.fn("fwd", cfg)
    o1, l1 = f()
    o2, l2 = f()
    assert len(built) == 1
    assert o1.data_ptr() != o2.data_ptr()  # fresh outputs per call, as the gate needs
    want_o, want_l = fwd_mod.attn_fwd(bench.q, bench.k, bench.v, config=cfg, **bench.kw)
    assert torch.equal(o2, want_o) and torch.equal(l2, want_l)
    assert len(built) == 2  # attn_fwd builds one per call


def test_a_config_the_launcher_refuses_is_pruned_not_failed() -> None:
    """A launcher's InfeasibleConfigError (the Hopper backward's shared-memory plan, say)
    says the candidate cannot run, like a compile error: the trial is pruned."""
    from flashtune.autotune.measure import classify
    from flashtune.exceptions import InfeasibleConfigError

    assert classify(InfeasibleConfigError("bwd hopper: no room")) == "prune"
    assert classify(RuntimeError("bwd hopper: no room")) == "error"


def test_a_backward_measured_against_another_keeps_its_parts_and_the_ratio(
        device: str, seed: int) -> None:
    """``measure(..., against=...)`` with an adaptive timing times the candidate's launches
    in pairs with the reference config's: each launch's median by name, the whole's,
    and the median ratio of the pairs."""
    from flashtune.autotune.measure import measure

    bench = Bench(P, device, seed=seed)
    cfg = BwdConfig(dkdv_block_n=32, dq_block_m=32)
    ref = BwdConfig(dkdv_block_m=16, dkdv_block_n=16, dq_block_m=16, dq_block_n=16)
    m = measure(bench, "bwd", cfg, seed=seed, cpu_reps=1, warmup_ms=1, rep_ms=20,
                rel_tol=0.5, min_reps=2, against=ref)
    assert m.status == "ok", m.detail
    assert list(m.parts_ms) == list(BWD_PARTS)
    assert m.against_ratio > 0 and m.against_ms > 0
    plain = measure(bench, "bwd", cfg, seed=seed, cpu_reps=1, warmup_ms=1, rep_ms=20)
    assert plain.status == "ok" and plain.against_ratio != plain.against_ratio  # NaN: alone


def test_a_reference_that_cannot_run_leaves_the_candidate_timed_alone(device: str,
                                                                      seed: int) -> None:
    """Where the pair raises because of the reference (here a config this problem refuses),
    the candidate is not blamed: it is timed alone, without a ratio."""
    from flashtune.autotune.measure import measure

    bench = Bench(P, device, seed=seed)
    cfg = BwdConfig(dkdv_block_n=32, dq_block_m=32)
    bad = BwdConfig(dkdv_block_m=7)  # not a tile the kernels take
    with pytest.raises(Exception):  # noqa: B017 - whatever the kernels raise for it
        bench.launch("bwd", bad)()
    m = measure(bench, "bwd", cfg, seed=seed, cpu_reps=1, warmup_ms=1, rep_ms=20,
                rel_tol=0.5, min_reps=2, against=bad)
    assert m.status == "ok", m.detail
    assert list(m.parts_ms) == list(BWD_PARTS) and m.median_ms > 0
    assert m.against_ratio != m.against_ratio  # NaN: timed alone
