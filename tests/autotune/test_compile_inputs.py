"""The compile pool builds the binaries the timing worker runs.

Triton specializes every int argument by value (equal to 1; divisible by 16), so a pool
build from inputs whose grid counts, totals or lengths fall in another class compiles a
binary the worker never loads, and the worker compiles again on the critical path. Each
launch the pool's small inputs (``compile_inputs``) prepare must take every int argument
in the class of the problem's real launch, and so must each launch of the gate's reduced
problem (``measure.gate_problem``). Nothing is compiled here: the launches are prepared on
the CPU and their arguments compared (the Gluon backward's as its BoundLaunch objects fix
them, a split call's halves included).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from flashtune.autotune._compile import compile_inputs, like_count
from flashtune.kernels.attn_bwd import bwd_steps
from flashtune.kernels.attn_fwd import FwdLaunch, Packed
from flashtune.kernels.config import (
    BWD_HOPPER,
    BWD_ONE_LAUNCH,
    HOPPER,
    BwdConfig,
    FwdConfig,
    default_bwd,
    default_portable_fwd,
)
from flashtune.problem import Problem, default_scale

LENGTHS = [100, 0, 1, 300, 598]  # 999 tokens: 7 mod 16
PROBLEMS = [
    Problem(18, 12, 12, 256, 256, 64, "bf16", True),     # 12 heads: grid counts not /16
    Problem(3, 8, 2, 200, 333, 128, "fp16", False),
    Problem(len(LENGTHS), 4, 2, max(LENGTHS), max(LENGTHS), 64, "bf16", True,
            total_q=sum(LENGTHS), total_k=sum(LENGTHS)),
]


def _class(x: Any) -> Any:
    """What Triton's specialization sees of an argument: an int's class, a tensor's dtype
    and 16-byte alignment, a host descriptor's box (its shape and strides are passed at
    launch without specialization: compile-only sm_90 builds with triton 3.6 gave one
    binary for batch 1 and batch 8)."""
    if isinstance(x, bool) or not isinstance(x, (int, torch.Tensor)) and not hasattr(x, "base"):
        return x
    if isinstance(x, int):
        return ("int", x == 1, x % 16 == 0)
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.data_ptr() % 16 == 0)
    return ("descriptor", x.base.dtype if x.base is not None else None, list(x.block_shape))


def _real_inputs(p: Problem) -> tuple[Any, Any, Any, Any]:
    dt = torch.bfloat16 if p.dtype == "bf16" else torch.float16
    if p.packed:
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.empty(p.total_q, p.heads_q, p.head_dim, dtype=dt)
        k = torch.empty(p.total_k, p.heads_kv, p.head_dim, dtype=dt)
        return q, k, torch.empty(p.heads_q, p.total_q), Packed(cu, cu, p.seqlen_q, p.seqlen_k)
    q = torch.empty(p.batch, p.heads_q, p.seqlen_q, p.head_dim, dtype=dt)
    k = torch.empty(p.batch, p.heads_kv, p.seqlen_k, p.head_dim, dtype=dt)
    return q, k, torch.empty(p.batch, p.heads_q, p.seqlen_q), None


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the arguments'
    classes instead of launching (an argument the kernel declares ``do_not_specialize``
    has none)."""

    def __init__(self, name: str, log: list[Any], kernel: Any) -> None:
        self.name, self.log = name, log
        self.free = {i for i, prm in enumerate(getattr(kernel, "params", []))
                     if getattr(prm, "do_not_specialize", False)}

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.log.append((self.name, [("free",) if i in self.free else _class(x)
                                         for i, x in enumerate(args)],
                             {k: _class(v) for k, v in kwargs.items()}))
        return launch


def _launch_classes(monkeypatch: pytest.MonkeyPatch, p: Problem, direction: str, cfg: Any,
                    inputs: tuple[Any, Any, Any, Any]) -> list[Any]:
    """The arguments' classes of every kernel launch the call makes, in order."""
    from flashtune.kernels import attn_bwd, attn_fwd

    modules = [attn_fwd, attn_bwd]
    if cfg.variant == HOPPER and direction == "fwd":
        from flashtune.kernels import attn_fwd_hopper

        modules.append(attn_fwd_hopper)
    seen: list[Any] = []
    for mod in modules:
        for name, obj in list(vars(mod).items()):
            if name.startswith("_attn") and hasattr(obj, "__getitem__"):
                monkeypatch.setattr(mod, name, _Recorder(name, seen, obj))
    if cfg.variant == BWD_HOPPER and direction == "bwd":
        # The Gluon backward launches through BoundLaunch objects made once per call
        # signature: their fixed arguments are what it specializes on (nothing runs here).
        from flashtune.kernels import attn_bwd_hopper

        def bound(kernel: Any, grid: Any, args: Any, kwargs: Any, n: int) -> Any:
            seen.append((getattr(kernel, "__name__", repr(kernel)),
                         [_class(x) for x in args[n:]], {k: _class(v) for k, v in kwargs.items()}))
            return None

        monkeypatch.setattr(attn_bwd_hopper, "BoundLaunch", bound)
        monkeypatch.setattr(attn_bwd_hopper, "_sm_count", lambda index: 132)
    q, k, lse, packed = inputs
    v = torch.empty_like(k)
    cu = () if packed is None else (packed.cu_q, packed.cu_k)
    kw: dict[str, Any] = dict(causal=p.causal, sm_scale=default_scale(p.head_dim),
                              window=p.window, softcap=p.softcap, config=cfg, packed=packed)
    if direction == "fwd":
        FwdLaunch(q, k, v, **kw)(q, k, v, *cu)
    else:
        _, steps = bwd_steps(torch.empty_like(q), q, k, v, torch.empty_like(q), lse, **kw,
                             deterministic=p.deterministic)
        if cfg.variant != BWD_HOPPER:
            for _, step in steps:
                step()
    monkeypatch.undo()
    assert seen
    if cfg.variant == BWD_HOPPER and direction == "bwd":  # not the portable fallback
        assert "_attn_bwd_hopper_kernel" in [name for name, *_ in seen]
    return seen


def _configs(p: Problem) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [
        ("fwd", default_portable_fwd(p)), ("bwd", default_bwd(p)),
        ("bwd", default_bwd(p, BWD_ONE_LAUNCH))]
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    out.append(("fwd", FwdConfig(variant=HOPPER, block_m=128, block_n=128, num_stages=2)))
    if not p.packed:
        out += [("bwd", c) for c in _hopper_bwd_configs(p)]
    return out


def _hopper_bwd_configs(p: Problem) -> list[BwdConfig]:
    """Gluon backward configs whose launches differ in what they pass: whole and in two
    halves (``hopper_split``, whose halves see half the batch or half the heads), the
    row-split dQ, a persistent grid and virtual KV heads where they apply."""
    base = BwdConfig(variant=BWD_HOPPER, hopper_block_m=128 if p.head_dim <= 64 else 64,
                     hopper_block_n=128, hopper_stages=2)
    out = [base, dataclasses.replace(base, hopper_split=2)]
    if p.head_dim <= 64:
        out.append(dataclasses.replace(base, hopper_dq_frag=1, hopper_dq_store_first=2,
                                       hopper_split=2, hopper_dq_rows=1, hopper_dkdv_tma=1))
    masked = p.causal or tuple(p.window) != (-1, -1)
    if not masked:
        out.append(dataclasses.replace(base, hopper_persist=1))
    if masked and (p.heads_q // p.heads_kv) % 2 == 0:
        out.append(dataclasses.replace(base, hopper_kv_rep=2, hopper_split=2))
    return out


@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: f"b{p.batch}h{p.heads_q}"
                         f"{'-packed' if p.packed else ''}")
def test_pool_inputs_keep_every_int_argument_in_its_class(monkeypatch: pytest.MonkeyPatch,
                                                          p: Problem) -> None:
    for direction, cfg in _configs(p):
        real = _launch_classes(monkeypatch, p, direction, cfg, _real_inputs(p))
        pool = _launch_classes(monkeypatch, p, direction, cfg, compile_inputs(p, "cpu"))
        assert pool == real, (direction, cfg)


def test_pool_inputs_are_small() -> None:
    p = PROBLEMS[2]
    q, k, lse, packed = compile_inputs(p, "cpu")
    assert q.shape[0] == like_count(p.total_q) == 7 and packed.batch == p.batch
    assert (packed.max_q, packed.max_k) == (p.seqlen_q, p.seqlen_k)
    assert compile_inputs(PROBLEMS[0], "cpu")[0].shape[0] == 2  # 18 sequences: 2 mod 16


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 18, 31, 32, 33, 48, 999, 65537])
def test_like_count_keeps_the_class_of_every_multiple(n: int) -> None:
    m = like_count(n)
    assert 1 <= m <= min(n, 17) or (n == 1 and m == 1)
    for factor in (1, 2, 3, 8, 12):
        assert _class(m * factor) == _class(n * factor)


def test_the_gate_runs_the_binaries_that_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The correctness gate launches a reduced problem (``measure.gate_problem``): on every
    dense preset problem its launches keep every argument's class, so the gate checks the
    binary that is then timed (and needs no compile of its own)."""
    from flashtune.autotune.measure import gate_problem
    from flashtune.autotune.presets import preset

    names = ("standard", "llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b", "gpt2")
    problems = {p for name in names for p in preset(name) if not p.packed}
    checked = 0
    for p in sorted(problems, key=repr):
        g = gate_problem(p)
        if g == p:
            continue
        for direction, cfg in _configs(p):
            real = _launch_classes(monkeypatch, p, direction, cfg, compile_inputs(p, "cpu"))
            gate = _launch_classes(monkeypatch, g, direction, cfg, compile_inputs(g, "cpu"))
            assert gate == real, (p, g, direction, cfg)
        checked += 1
    assert checked >= 20


def test_pool_inputs_build_the_gluon_backward_of_every_preset_problem(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile pool's small inputs (the batch cut to :func:`like_count` of it) prepare
    every Gluon backward launch of each dense preset problem, split halves included, with
    the arguments the real call's launches take: a half of one class for the pool and
    another for the worker would compile again inside the timing."""
    from flashtune.autotune.presets import preset

    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    names = ("standard", "llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b", "gpt2")
    problems = sorted({p for name in names for p in preset(name) if not p.packed}, key=repr)
    cut = 0
    for p in problems:
        cut += like_count(p.batch) != p.batch
        for cfg in _hopper_bwd_configs(p):
            real = _launch_classes(monkeypatch, p, "bwd", cfg, _real_inputs(p))
            pool = _launch_classes(monkeypatch, p, "bwd", cfg, compile_inputs(p, "cpu"))
            assert pool == real, (p, cfg)
    assert cut >= 5  # the pool's batch is cut on several of them
