"""API fuzzing: scalar arguments, forced configs and tensor shapes of ``flash_attention``.

Every case is either rejected with a TypeError/ValueError naming the argument (or the
config field), *before anything is launched*, or accepted and compared against an
fp64 reference of exactly what was asked: the raw window bounds and softcap, with no
clamping of the code under test. No silent wrong answer.

Accepted calls that mean the same problem (a window bound past the sequence is
unbounded, a huge softcap is no softcap) share one launch: the kernel output is cached
by the validated arguments, and every case is judged on its own against its own
reference. That keeps the interpreter work to a few dozen tiny launches.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Any

import pytest
import torch

from flashtune.kernels import attention
from flashtune.kernels._bound import BoundLaunch
from flashtune.kernels.attention import flash_attention
from flashtune.kernels.config import BwdConfig, FwdConfig, default_bwd, default_fwd, is_feasible
from flashtune.problem import Problem

B, HQ, HK, SQ, SK, D = 1, 2, 1, 7, 9, 16
TOL = 1e-2  # fp16 output rounding on values of order 1, with margin; the bugs were 0.05-2.6


def _inputs(seed: int = 0, sq: int = SQ, sk: int = SK) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, s, D, generator=g).to(torch.float16)
                 for h, s in ((HQ, sq), (HK, sk), (HK, sk)))


def ref64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
          softmax_scale: float | None, window: tuple[int, int], softcap: float,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented semantics in fp64, from the raw arguments (Python ints for the
    window: no overflow whatever the bound)."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    sq, sk = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) * (softmax_scale if softmax_scale is not None
                                   else 1 / math.sqrt(q.shape[-1]))
    if softcap > 0 and math.isfinite(softcap):
        s = softcap * torch.tanh(s / softcap)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    vis = torch.tensor([[(left < 0 or j >= i + sk - sq - left)
                         and (right < 0 or j <= i + sk - sq + right)
                         for j in range(sk)] for i in range(sq)])
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return p @ v, torch.where(torch.isneginf(lse), math.inf, lse)


def _close(out: torch.Tensor, lse: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor],
           ) -> str:
    ro, rl = ref
    err = (out.double() - ro).abs().max().item()
    fin = torch.isfinite(rl)
    if not torch.equal(torch.isfinite(lse), fin) or torch.isnan(lse).any():
        return f"lse non-finite where the reference is finite (or the reverse): {lse}"
    lerr = ((lse.double()[fin] - rl[fin]).abs() / rl[fin].abs().clamp(min=1)).max().item() \
        if fin.any() else 0.0
    if not err <= TOL or not lerr <= TOL:
        return f"out off by {err:.3g}, lse by {lerr:.3g} (relative)"
    return ""


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any kernel launch fail the test: a rejection must come before it."""
    def boom(*a: Any, **kw: Any) -> None:
        raise AssertionError("a kernel was launched for a call that should be rejected")

    monkeypatch.setattr(BoundLaunch, "__call__", boom)  # every kernel launch goes through it


# ----------------------------------------------------------------------------- scalars

BIG = (2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30)
WINDOW_VALUES: tuple[Any, ...] = (-1, 0, 1, 3, SQ - 2, SQ - 1, SK - 2, SK - 1, SK, *BIG,
                                  -2, -(2**63), 1.5, True, "1", None)
SOFTCAPS: tuple[Any, ...] = (0.0, 0, 1e-30, 0.5, 30.0, 1e3, 1e4, 1e6, 1e8, 1e30, 1e36, 1e38, 1e300,
                             math.inf, -0.0, -1.0, -math.inf, math.nan, True, "30", None)
SCALES: tuple[Any, ...] = (None, 1e-30, 0.25, 3.0, 1e20, 0.0, -0.25, 1e21, math.inf,
                           math.nan, True, "0.25")


def _scalar_cases() -> list[tuple[dict[str, Any], str]]:
    cases = []
    for left, right, causal in itertools.product(WINDOW_VALUES, WINDOW_VALUES, (False, True)):
        cases.append(({"window_size": (left, right), "causal": causal}, "window_size"))
    for cap, scale in itertools.product(SOFTCAPS, SCALES):
        cases.append(({"softcap": cap, "softmax_scale": scale}, "softcap|softmax_scale"))
    for causal in (1, 0, None, "yes", 1.0):
        cases.append(({"causal": causal}, "causal"))
    for window in ((1,), (1, 2, 3), 5, "ab", None, [0, 0], (0, 0.0)):
        cases.append(({"window_size": window}, "window_size"))
    return cases


SCALAR_CASES = _scalar_cases()


def test_scalar_fuzz_accepts_only_what_it_computes_right() -> None:
    q, k, v = _inputs()
    launched: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    stats = {"rejected": 0, "accepted": 0}
    failures = []
    for kw, names in SCALAR_CASES:
        causal = kw.get("causal", False)
        scale, window, cap = kw.get("softmax_scale"), kw.get("window_size", (-1, -1)), \
            kw.get("softcap", 0.0)
        try:
            norm = attention.validate(q, k, v, causal, scale, window, cap)
        except (TypeError, ValueError) as e:
            stats["rejected"] += 1
            if not any(n in str(e) for n in names.split("|")):
                failures.append(f"{kw}: message names no argument: {e}")
            continue
        stats["accepted"] += 1
        tag = (causal, *norm)
        if tag not in launched:
            launched[tag] = flash_attention(q, k, v, causal=causal, softmax_scale=scale,
                                            window_size=window, softcap=cap, return_lse=True)
        out, lse = launched[tag]
        ref = ref64(q, k, v, causal=causal, softmax_scale=scale, window=tuple(window),
                    softcap=float(cap))
        why = _close(out, lse, ref)
        if why:
            failures.append(f"{kw}: {why}")
    assert not failures, "\n".join(failures[:20])
    assert stats["accepted"] > 100 and stats["rejected"] > 100, stats
    assert len(launched) < 100, len(launched)  # the clamping folds the sentinels together


@pytest.mark.parametrize("cap", [1e8, 1e30, math.inf])
def test_huge_softcap_is_no_softcap(cap: float) -> None:
    q, k, v = _inputs(1)
    assert torch.equal(flash_attention(q, k, v, softcap=cap), flash_attention(q, k, v))


@pytest.mark.parametrize("window", [(-1, 2**63 - 1), (0, 2**31 - 1), (2**31 - 1, 0)])
def test_window_sentinels_mean_unbounded(window: tuple[int, int]) -> None:
    q, k, v = _inputs(2)
    out = flash_attention(q, k, v, window_size=window)
    left, right = window
    same = flash_attention(q, k, v, window_size=(-1 if left > SK else left,
                                                 -1 if right > SQ else right))
    assert torch.equal(out, same)
    ref = ref64(q, k, v, causal=False, softmax_scale=None, window=window, softcap=0.0)[0]
    assert (out.double() - ref).abs().max().item() < TOL


def test_backward_with_sentinel_window_matches_reference() -> None:
    q, k, v = (t.requires_grad_() for t in _inputs(3))
    flash_attention(q, k, v, window_size=(2**63 - 1, 2), softcap=1e30).float().sum().backward()
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref64(q2, k2, v2, causal=False, softmax_scale=None, window=(2**63 - 1, 2),
          softcap=1e30)[0].sum().backward()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert (got.double() - want).abs().max().item() < 2e-2


# ----------------------------------------------------------------------------- forced configs

BAD_KNOB_VALUES: tuple[Any, ...] = (-64, -1, 0, 3, 7, 48, 1000, 2**31, 64.0, 4.0, True, False,
                                    "64", None, math.nan, 1e30)


def _bad_config_cases() -> list[tuple[Any, str, Any]]:
    cases = []
    for cls, base in ((FwdConfig, FwdConfig()), (BwdConfig, BwdConfig())):
        for f in dataclasses.fields(cls):
            choices = f.metadata["choices"]
            for val in BAD_KNOB_VALUES:
                if any(type(val) is type(c) and val == c for c in choices):
                    continue
                cases.append((dataclasses.replace(base, **{f.name: val}), f.name, val))
    return cases


BAD_CONFIGS = _bad_config_cases()


@pytest.mark.usefixtures("no_launch")
def test_forced_config_with_a_bad_knob_is_rejected_naming_the_field() -> None:
    q, k, v = _inputs()
    failures = []
    for cfg, name, val in BAD_CONFIGS:
        for forced in (cfg, (FwdConfig(), cfg) if isinstance(cfg, BwdConfig) else (cfg,
                                                                                   BwdConfig())):
            try:
                flash_attention(q, k, v, config=forced)
            except ValueError as e:
                if f"{type(cfg).__name__}.{name}" not in str(e) or repr(val) not in str(e):
                    failures.append(f"{name}={val!r}: {e}")
            else:
                failures.append(f"{name}={val!r}: accepted")
    assert not failures, "\n".join(failures[:20])
    assert len(BAD_CONFIGS) > 200


def _good_configs() -> list[FwdConfig | BwdConfig]:
    p = Problem(batch=B, heads_q=HQ, heads_kv=HK, seqlen_q=SQ, seqlen_k=SK, head_dim=D,
                dtype="fp16")
    out: list[FwdConfig | BwdConfig] = []
    for base in (default_fwd(p), default_bwd(p)):
        for f in dataclasses.fields(base):
            for val in f.metadata["choices"]:
                out.append(dataclasses.replace(base, **{f.name: val}))
    return out


GOOD_CONFIGS = _good_configs()


def test_forced_valid_configs_are_feasible_or_refused_and_right_when_run() -> None:
    q, k, v = _inputs(4)
    p = Problem.from_tensors(q, k)
    ref = ref64(q, k, v, causal=True, softmax_scale=None, window=(-1, -1), softcap=0.0)
    rng = random.Random(0)
    failures, ran, refused = [], 0, 0
    for cfg in GOOD_CONFIGS:
        ok, _ = is_feasible(cfg, p)
        if not ok:
            with pytest.raises(ValueError, match=type(cfg).kind):
                flash_attention(q, k, v, causal=True, config=cfg)
            refused += 1
            continue
        if isinstance(cfg, BwdConfig) and rng.random() > 0.25:
            continue  # backward launches are the costly ones: a quarter of them
        ran += 1
        if isinstance(cfg, FwdConfig):
            out, lse = flash_attention(q, k, v, causal=True, config=cfg, return_lse=True)
            why = _close(out, lse, ref)
        else:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            flash_attention(qq, kk, vv, causal=True, config=cfg).float().sum().backward()
            q2, k2, v2 = (t.double().requires_grad_() for t in (q, k, v))
            ref64(q2, k2, v2, causal=True, softmax_scale=None, window=(-1, -1),
                  softcap=0.0)[0].sum().backward()
            err = max((a.double() - b).abs().max().item()
                      for a, b in ((qq.grad, q2.grad), (kk.grad, k2.grad), (vv.grad, v2.grad)))
            why = "" if err < 2e-2 else f"grads off by {err:.3g}"
        if why:
            failures.append(f"{cfg}: {why}")
    assert not failures, "\n".join(failures)
    assert ran >= 10 and refused >= 1, (ran, refused)


# ----------------------------------------------------------------------------- shapes


def _shape_cases() -> list[tuple[Any, str]]:
    f16 = torch.float16
    cases: list[tuple[Any, str]] = []

    def t(*shape: int, dtype: torch.dtype = f16, device: str = "cpu") -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    for d in (0, 1, 7, 8, 12, 15, 20, 100, 260, 264, 512):
        cases.append(((t(1, 2, 4, d), t(1, 1, 4, d), t(1, 1, 4, d)), "head_dim"))
    for hq, hk in ((3, 2), (2, 3), (1, 2), (5, 4), (2, 0)):
        cases.append(((t(1, hq, 4, 16), t(1, hk, 4, 16), t(1, hk, 4, 16)), "heads"))
    for b, sq, sk in ((0, 4, 4), (1, 0, 4), (1, 4, 0), (0, 0, 0)):
        cases.append(((t(b, 2, sq, 16), t(b, 1, sk, 16), t(b, 1, sk, 16)), "must be >= 1"))
    cases.append(((t(2, 2, 4, 16), t(1, 1, 4, 16), t(1, 1, 4, 16)), "batch"))
    cases.append(((t(1, 2, 4, 16), t(1, 1, 4, 16), t(1, 1, 5, 16)), "k and v"))
    cases.append(((t(1, 2, 4, 16), t(1, 1, 4, 32), t(1, 1, 4, 32)), "head_dim"))
    for rank in (0, 1, 2, 3, 5):
        shape = (1, 2, 4, 16, 1)[:rank] if rank < 5 else (1, 1, 2, 4, 16)
        cases.append(((t(*shape), t(1, 1, 4, 16), t(1, 1, 4, 16)), "4-D"))
    for dt in (torch.float32, torch.float64, torch.int8, torch.bool, torch.complex64):
        cases.append(((t(1, 2, 4, 16, dtype=dt), t(1, 1, 4, 16), t(1, 1, 4, 16)), "dtype"))
    cases.append(((t(1, 2, 4, 16), t(1, 1, 4, 16, dtype=torch.bfloat16),
                   t(1, 1, 4, 16)), "dtype"))
    cases.append(((t(1, 2, 4, 16, device="meta"), t(1, 1, 4, 16), t(1, 1, 4, 16)), "device"))
    cases.append(((t(1, 2, 4, 16, device="meta"),) * 3, "device"))
    cases.append((([[0.0]], t(1, 1, 4, 16), t(1, 1, 4, 16)), "torch.Tensor"))
    cases.append(((t(1, 2, 4, 16), None, t(1, 1, 4, 16)), "torch.Tensor"))
    return cases


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize("qkv, names", _shape_cases())
def test_bad_shapes_are_rejected_naming_the_problem(qkv: Any, names: str) -> None:
    with pytest.raises((TypeError, ValueError), match=names):
        flash_attention(*qkv)


@pytest.mark.parametrize("sq, sk, hq, hk, d, layout", [
    (1, 1, 1, 1, 16, "bhsd"), (1, 33, 3, 1, 24, "bshd"), (17, 5, 4, 2, 40, "sliced"),
    (9, 9, 2, 2, 72, "bshd")])
def test_odd_shapes_and_strides_match_reference(sq: int, sk: int, hq: int, hk: int, d: int,
                                                layout: str) -> None:
    g = torch.Generator().manual_seed(sq * 31 + sk)

    def make(h: int, s: int) -> torch.Tensor:
        if layout == "bshd":
            return torch.randn(1, s, h, d, generator=g).half().transpose(1, 2)
        if layout == "sliced":
            return torch.randn(1, h, s, d + 8, generator=g).half()[..., 3:3 + d]
        return torch.randn(1, h, s, d, generator=g).half()

    q, k, v = make(hq, sq), make(hk, sk), make(hk, sk)
    for causal in (False, True):
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        ref = ref64(q, k, v, causal=causal, softmax_scale=None, window=(-1, -1), softcap=0.0)
        assert _close(out, lse, ref) == ""


def test_fuzz_case_count() -> None:
    """The API families add up to well over the thousand cases the suite promises."""
    assert len(SCALAR_CASES) + len(BAD_CONFIGS) + len(GOOD_CONFIGS) + len(_shape_cases()) > 1000
