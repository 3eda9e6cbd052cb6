"""The house protocol's timing helpers (the CPU branch; on CUDA the same arguments go to
``triton.testing.do_bench``)."""

from __future__ import annotations

import torch

from flashtune.problem import Problem
from flashtune.timing import three_timings, time_fn


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
