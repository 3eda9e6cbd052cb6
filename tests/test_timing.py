"""The house protocol's timing helpers: their CPU branch (on CUDA ``time_fn``'s arguments
go to ``triton.testing.do_bench``), and the interleaved re-timing, on a GPU too."""

from __future__ import annotations

import time

import pytest
import torch

from flashtune.autotune.measure import retime
from flashtune.problem import Problem
from flashtune.timing import (
    MAX_LEAD_MS,
    SDPA_ANCHORS,
    Timing,
    _launch,
    anchor_launches,
    lead_for,
    make_inputs,
    three_timings,
    three_timings_interleaved,
    time_fn,
    time_interleaved,
)


def test_time_fn_resets_the_named_grads_before_each_call() -> None:
    x = torch.randn(8, requires_grad=True)
    seen: list[bool] = []

    def step() -> None:
        seen.append(x.grad is None)
        (x * 2).sum().backward()

    time_fn(step, cpu_reps=3, grad_to_none=(x,))
    assert len(seen) == 4 and seen[1:] == [True, True, True]  # one untimed call, 3 timed
    time_fn(step, cpu_reps=2)  # without: the grads accumulate from call to call
    assert seen[4:] == [False, False, False]


def test_the_backward_timing_stores_gradients_instead_of_adding_them() -> None:
    """(forward+backward) - forward must not time an elementwise add of every input's
    gradient onto the last call's, which no real training step does per call."""
    p = Problem(1, 2, 2, 16, 16, 16, "bf16", False)
    grads_before_call: list[bool] = []

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.requires_grad:
            grads_before_call.append(q.grad is None and k.grad is None and v.grad is None)
        return q * k.mean() + v

    t = three_timings(attn, p, "cpu")
    assert set(t) == {"fwd", "bwd", "infer"} and t["bwd"].median_ms > 0
    assert grads_before_call and all(grads_before_call)


def test_time_interleaved_takes_turns_and_times_each_launch_as_its_own() -> None:
    calls: list[int] = []

    def launch(i: int, sleep_ms: float = 0.0):
        def f() -> None:
            calls.append(i)
            if sleep_ms:
                time.sleep(sleep_ms / 1e3)
        return f

    ts = time_interleaved([launch(0), launch(1, sleep_ms=3), launch(2)], cpu_reps=3)
    # one untimed call each, then three cycles in alternating direction
    assert calls == [0, 1, 2, 0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert len(ts) == 3 and all(t.interpreter for t in ts)
    assert ts[1].p20_ms >= 3.0  # the sleeping launch's own times, not its neighbours'
    assert ts[1].p20_ms <= ts[1].median_ms <= ts[1].p80_ms
    with pytest.raises(ValueError, match="at least one"):
        time_interleaved([])


def test_three_timings_interleaved_takes_the_implementations_in_turn() -> None:
    """Each of the three timings runs every implementation in one alternating loop; the
    backward's calls store fresh gradients; an implementation that cannot run is left out
    with its reason."""
    p = Problem(1, 2, 2, 16, 16, 16, "bf16", False)
    calls: list[tuple[str, str]] = []
    fresh: list[bool] = []

    def impl(name: str, sleep_ms: float = 0.0):
        def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kind = "infer" if not torch.is_grad_enabled() else "grad"
            calls.append((name, kind))
            if q.requires_grad:
                fresh.append(q.grad is None and k.grad is None and v.grad is None)
            if sleep_ms:
                time.sleep(sleep_ms / 1e3)
            return q * k.mean() + v
        return attn

    def broken(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this shape")

    errors: dict[str, str] = {}
    got = three_timings_interleaved({"a": impl("a"), "x": broken, "b": impl("b", 2.0)},
                                    p, "cpu", errors=errors)
    assert set(got) == {"a", "b"} and errors == {"x": "RuntimeError: no kernel for this shape"}
    assert all(set(t) == {"fwd", "bwd", "infer"} for t in got.values())
    assert got["b"]["fwd"].p20_ms >= 2.0 > got["a"]["fwd"].median_ms  # each its own times
    assert all(t.interpreter for ts in got.values() for t in ts.values())
    # After each one's probing calls (3 kinds), the timed loops alternate: a b, b a, ...
    timed = [n for n, _ in calls[6:]]
    assert timed[:6] == ["a", "b", "a", "b", "b", "a"]  # fwd: one untimed call each, turns
    assert [k for _, k in calls].count("infer") >= 2 * 4
    assert fresh and all(fresh)


class _Bench:
    """Records what retime asks of a measuring bench."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def launch(self, direction: str, config: str):
        return lambda: self.log.append(("launch", config))

    def time(self, direction: str, config: str, **timing: object) -> Timing:
        self.log.append(("time", config))
        return Timing(1.0, 0.9, 1.1)


def test_retime_interleaves_launches_under_the_house_protocol() -> None:
    b = _Bench()
    ts = retime(b, "fwd", ["a", "b"], rounds=3, cpu_reps=2)  # type: ignore[arg-type]
    assert len(ts) == 2
    assert b.log == [("launch", c) for c in "ab" "ab" "ba"]
    # the search's adaptive timing (a confirmation) times each config in turn
    b = _Bench()
    retime(b, "fwd", ["a", "b"], rounds=3, rel_tol=0.01)  # type: ignore[arg-type]
    assert b.log == [("time", c) for c in "ab" "ba" "ab"]


def test_retime_takes_company_in_its_loop_and_returns_its_times_last() -> None:
    b = _Bench()
    ts = retime(b, "fwd", ["a", "b"], rounds=2, cpu_reps=2,  # type: ignore[arg-type]
                company=[lambda: b.log.append(("launch", "z"))])
    assert len(ts) == 3
    assert b.log == [("launch", c) for c in "abz" "abz" "zba"]
    with pytest.raises(ValueError, match="interleaved"):  # the adaptive timing takes none
        retime(b, "fwd", ["a"], rounds=1, rel_tol=0.01,  # type: ignore[arg-type]
               company=[lambda: None])


def test_a_launch_of_each_kind_runs_what_the_kind_names() -> None:
    p = Problem(1, 2, 2, 8, 8, 16, "bf16", False)
    q, k, v = make_inputs(p, "cpu", requires_grad=True)
    do = torch.randn_like(q)
    seen: list[bool] = []

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_grad_enabled() and q.requires_grad)
        return q * k.mean() + v

    q.grad = torch.ones_like(q)  # a stale gradient: the backward kind stores a fresh one
    _launch("fwd_bwd", attn, q=q, k=k, v=v, do=do)()
    assert v.grad is not None and torch.equal(v.grad, do)
    assert q.grad is not None and not torch.equal(q.grad, torch.ones_like(q))
    _launch("fwd", attn, q=q, k=k, v=v, do=do)()
    _launch("infer", attn, q=q, k=k, v=v, do=do)()
    assert seen == [True, True, False]
    with pytest.raises(ValueError, match="kind must be one of"):
        _launch("bwd", attn, q=q, k=k, v=v, do=do)


@pytest.mark.gpu
def test_anchor_launches_run_the_sdpa_anchors_and_leave_out_what_cannot_run() -> None:
    p = Problem(2, 4, 4, 512, 512, 64, "bf16", True)
    errors: dict[str, str] = {}
    got = anchor_launches(p, "fwd_bwd", errors=errors)
    assert set(got) | set(errors) == set(SDPA_ANCHORS) and "cudnn" in got, errors
    ts = time_interleaved(list(got.values()), rep_ms=20)
    assert all(t.median_ms > 0 for t in ts)
    # SDPA's semantics only: a window has no anchor
    assert anchor_launches(Problem(2, 4, 4, 512, 512, 64, "bf16", False, (64, 0)), "fwd") == {}


def test_lead_for_takes_the_wait_given_or_one_and_a_half_host_issue_times() -> None:
    assert lead_for([0.4, 1.0, 0.2], "auto") == pytest.approx(1.5)
    assert lead_for([100.0], "auto") == MAX_LEAD_MS
    assert lead_for([], "auto") == 0.0
    assert lead_for([5.0], 0.25) == 0.25 and lead_for([5.0], 0) == 0.0
    for bad in (-1.0, 1e9, float("nan"), "soon"):
        with pytest.raises(ValueError, match="'auto' or 0 to 1000 ms"):
            lead_for([1.0], bad)


def test_time_interleaved_refuses_a_bad_lead_before_any_launch() -> None:
    calls: list[int] = []
    with pytest.raises(ValueError, match="lead_ms"):
        time_interleaved([lambda: calls.append(1)], lead_ms=-2.0)
    assert calls == []


@pytest.mark.gpu
def test_a_lead_times_the_kernels_of_a_launch_that_is_slower_on_the_host() -> None:
    """A launch that spends 2 ms on the host before a short matmul reads its host time in
    the plain loop (the GPU idles between the events); with lead_ms="auto" it reads the
    matmul's time, as a copy without the host work does. The host issue times say which
    is which."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def slow() -> None:
        time.sleep(0.002)
        a @ a

    def fast() -> None:
        a @ a

    host: dict = {}
    plain = time_interleaved([slow, fast], host=host)
    assert host["lead_ms"] == 0.0
    assert host["issue_ms"][0] >= 2.0 > 10 * host["issue_ms"][1], host
    assert plain[0].median_ms >= 1.8 and plain[0].median_ms > 3 * plain[1].median_ms, plain
    led = time_interleaved([slow, fast], lead_ms="auto", host=host)
    assert host["lead_ms"] == pytest.approx(1.5 * host["issue_ms"][0])
    assert abs(led[0].median_ms / led[1].median_ms - 1) < 0.15, led
    assert abs(led[1].median_ms / plain[1].median_ms - 1) < 0.25, (led, plain)


@pytest.mark.gpu
def test_three_timings_interleaved_names_the_host_bound_and_a_lead_times_their_kernels(
        ) -> None:
    """An implementation that spends 3 ms on the host per call is named host-bound in
    every timing, the plain SDPA call beside it in none; with a lead both read alike."""
    import torch.nn.functional as F

    p = Problem(4, 16, 16, 2048, 2048, 128, "bf16", True)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def slow(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        time.sleep(0.003)
        return sdpa(q, k, v)

    log: dict = {}
    three_timings_interleaved({"sdpa": sdpa, "slow": slow}, p, "cuda", host_log=log)
    assert sorted(log) == ["fwd", "fwd_bwd", "infer"]
    for kind, h in log.items():
        assert h["host_bound"] == ["slow"] and h["lead_ms"] == 0.0, (kind, h)
        assert h["issue_ms"]["slow"] >= 3.0 > h["issue_ms"]["sdpa"], (kind, h)
    log.clear()
    got = three_timings_interleaved({"sdpa": sdpa, "slow": slow}, p, "cuda",
                                    lead_ms="auto", host_log=log)
    for kind in ("fwd", "bwd", "infer"):
        a, b = got["sdpa"][kind].median_ms, got["slow"][kind].median_ms
        assert abs(a / b - 1) < 0.1, (kind, a, b)
    assert all(h["lead_ms"] >= 4.5 and h["host_bound"] == [] for h in log.values()), log


@pytest.mark.gpu
def test_time_interleaved_on_a_gpu_agrees_with_itself_and_scales_with_the_work() -> None:
    """Two copies of one launch read alike; a launch of twice the work reads about twice
    as long (each gets its own events, whatever its neighbours do)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    one, same, double = time_interleaved([lambda: a @ a, lambda: a @ a, lambda: b @ a])
    assert abs(same.median_ms / one.median_ms - 1) < 0.03
    assert 1.6 < double.median_ms / one.median_ms < 2.4


@pytest.mark.gpu
def test_three_timings_interleaved_on_a_gpu_reads_two_copies_alike() -> None:
    """Two copies of one implementation, timed side by side, read alike in all three
    timings (the loop gives each the same clocks)."""
    import torch.nn.functional as F

    p = Problem(4, 16, 16, 2048, 2048, 128, "bf16", True)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    got = three_timings_interleaved({"one": sdpa, "two": sdpa}, p, "cuda")
    for kind in ("fwd", "bwd", "infer"):
        a, b = got["one"][kind].median_ms, got["two"][kind].median_ms
        assert a > 0 and b > 0 and abs(a / b - 1) < 0.05, (kind, a, b)


def test_time_against_pairs_the_candidate_with_the_reference_in_alternating_order() -> None:
    from flashtune.timing import time_against

    calls: list[str] = []

    def launch(name: str, sleep_ms: float):
        def f() -> None:
            calls.append(name)
            time.sleep(sleep_ms / 1e3)
        return f

    res = time_against([launch("a", 1), launch("b", 2)], launch("ref", 1), cpu_reps=3)
    # one untimed call each, then three pairs, the candidate first in even pairs
    assert calls == ["a", "b", "ref", "a", "b", "ref", "ref", "a", "b", "a", "b", "ref"]
    assert res.pairs == 3 and res.timing.interpreter and res.ref.interpreter
    assert len(res.parts_ms) == 2 and res.parts_ms[1] >= 2.0
    # The candidate sleeps 3 ms in all, the reference 1 ms: about 3x, however loaded the
    # machine (a late wake-up lengthens both).
    assert res.timing.median_ms >= 3.0 and res.ref.median_ms >= 1.0
    assert 1.3 < res.ratio < 3.5
    with pytest.raises(ValueError, match="at least one"):
        time_against([], launch("ref", 0))


@pytest.mark.gpu
def test_time_against_on_a_gpu_reads_the_ratio_of_the_work() -> None:
    """Beside a copy of itself a launch reads 1.0x; beside half its work, about 2x; and
    a candidate far slower than the reference is abandoned in fewer pairs."""
    from flashtune.timing import time_against

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    same = time_against([lambda: a @ a], lambda: a @ a, rel_tol=0.01)
    double = time_against([lambda: b @ a], lambda: a @ a, rel_tol=0.01)
    assert abs(same.ratio - 1) < 0.03
    assert 1.6 < double.ratio < 2.4
    assert double.timing.median_ms == pytest.approx(double.ratio * double.ref.median_ms,
                                                    rel=0.1)
    full = time_against([lambda: b @ a], lambda: a @ a, rel_tol=1e-4, rep_ms=200)
    quit_ = time_against([lambda: b @ a], lambda: a @ a, rel_tol=1e-4, rep_ms=200,
                         abandon_ratio=1.1)
    assert quit_.pairs < full.pairs
