"""The Hopper (Gluon) forward as a config axis: feasibility rules, the conditional space,
serialization, and what a machine without sm90 or without Gluon gets.

Gluon kernels do not run in the interpreter; their numerics are tested on the GPU
(tests/kernels/test_attn_fwd_hopper.py). Each rule here has a test that fails without it.
"""

from __future__ import annotations

import builtins
import dataclasses
import re

import optuna
import pytest

from flashtune.autotune.space import SearchSpace
from flashtune.exceptions import InfeasibleConfigError
from flashtune.kernels import config
from flashtune.kernels.config import (
    HOPPER,
    PORTABLE,
    FwdConfig,
    active_fields,
    check_fwd,
    config_from_dict,
    config_to_dict,
    default_fwd,
    hopper_q_buffers,
)
from flashtune.problem import Problem

P128 = Problem(batch=2, heads_q=16, heads_kv=16, seqlen_q=4096, seqlen_k=4096, head_dim=128,
               dtype="bf16", causal=True)
HOP = FwdConfig(variant=HOPPER, block_m=128, block_n=128, num_stages=2)


@pytest.fixture
def on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the target checks pass, so the other rules can be tested on the CPU."""
    monkeypatch.setattr(config, "hopper_support", lambda: "")


def test_hopper_config_passes_every_rule_on_a_hopper(on_hopper: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    check_fwd(HOP, P128)
    check_fwd(dataclasses.replace(HOP, pingpong=1, persistent=1, tile_order=2), P128)
    monkeypatch.setenv(config.UNVERIFIED_ENV, "1")
    check_fwd(dataclasses.replace(HOP, persistent=1, defer_o=1), P128)
    check_fwd(dataclasses.replace(HOP, persistent=1, pingpong=1, tile_overlap=1), P128)
    check_fwd(dataclasses.replace(HOP, block_m=64, block_n=64, num_stages=4),
              dataclasses.replace(P128, head_dim=64))
    # Three consumers (FA3's D=64 tile), at the registers the producer's share leaves.
    for regs in (152, 160):
        check_fwd(dataclasses.replace(HOP, block_m=192, num_stages=3, consumer_regs=regs),
                  dataclasses.replace(P128, head_dim=64))


@pytest.mark.parametrize("change, problem_change, words", [
    ({}, {"head_dim": 96}, "head_dim 96"),
    ({}, {"head_dim": 256}, "head_dim 256"),
    ({"block_m": 256}, {}, "block_m=256"),
    ({"block_m": 192, "consumer_regs": 160}, {}, "block_m=192 .three consumers. needs head_dim 64"),
    ({"block_m": 192, "consumer_regs": 168}, {"head_dim": 64}, "leaves the producer 8 registers"),
    ({"block_m": 192, "consumer_regs": 232}, {"head_dim": 64}, "leaves the producer"),
    ({"block_m": 192, "consumer_regs": 160, "pingpong": 1}, {"head_dim": 64},
     "pingpong needs two consumers"),
    ({"block_n": 32}, {}, "block_n=32"),
    ({"num_stages": 5}, {}, "ring of 5"),
    ({"num_stages": 4}, {}, "shared memory"),  # 4 x 2 x 128 x 128 x 2 B does not fit
    ({"block_m": 64, "pingpong": 1}, {}, "pingpong needs two consumers"),
    # The deferred O store holds its tile's Q buffer into the next tile: a second buffer
    # (persistent, and room beside the ring), and a dense batch (a packed one has no store
    # to defer).
    ({"defer_o": 1}, {}, "defer_o=1 needs a persistent grid with two Q buffers .persistent=0"),
    ({"defer_o": 1, "persistent": 1, "num_stages": 3}, {},
     "defer_o=1 needs a persistent grid with two Q buffers .persistent=1"),
    ({"defer_o": 1, "persistent": 1}, {"total_q": 8000, "total_k": 8000},
     "defer_o=1 on a packed batch"),
    # So does the overlapped consumer, which also keeps a whole open tile in registers.
    ({"tile_overlap": 1}, {}, "tile_overlap=1 needs a persistent grid with two Q buffers"),
    ({"tile_overlap": 1, "persistent": 1}, {"total_q": 8000, "total_k": 8000},
     "tile_overlap=1 on a packed batch"),
    ({"tile_overlap": 1, "persistent": 1, "block_m": 192, "consumer_regs": 160},
     {"head_dim": 64}, "tile_overlap=1 with three consumers"),
    ({"tile_overlap": 1, "defer_o": 1, "persistent": 1}, {}, "defer_o=1 beside it"),
    ({"consumer_regs": 216}, {}, "consumer_regs=216"),
    ({"num_warps": 8}, {}, "num_warps=8 has no meaning for the hopper kernel"),
    ({"use_tma": 1}, {}, "use_tma=1 has no meaning"),
    ({"maxnreg": 128}, {}, "maxnreg=128 has no meaning"),
])
def test_hopper_rules_reject_with_reason(on_hopper: None, change: dict, problem_change: dict,
                                         words: str) -> None:
    with pytest.raises(InfeasibleConfigError, match=words):
        check_fwd(dataclasses.replace(HOP, **change), dataclasses.replace(P128, **problem_change))


@pytest.mark.parametrize("knob", config.REFUSED_KNOBS)
def test_refused_knobs_are_refused_unless_asked_for(
        on_hopper: None, monkeypatch: pytest.MonkeyPatch, knob: str) -> None:
    """A knob whose kernel code has not passed its GPU checks, or measured slower, is never
    searched or served: only its GPU tests and A/B scripts, which set the variable, reach
    it, and the refusal says why."""
    cfg = dataclasses.replace(HOP, persistent=1, **{knob: 1})
    monkeypatch.delenv(config.UNVERIFIED_ENV, raising=False)
    why = re.escape(config.REFUSED_KNOBS[knob])
    with pytest.raises(InfeasibleConfigError, match=f"{knob}=1 is refused: it {why}"):
        check_fwd(cfg, P128)
    monkeypatch.setenv(config.UNVERIFIED_ENV, "1")
    check_fwd(cfg, P128)


def test_packed_batches_take_the_hopper_forward(on_hopper: None) -> None:
    """The Gluon forward reads each sequence's rows from the prefix sums: a packed batch
    is feasible, and its default is the Hopper kernel as a dense batch's is."""
    packed = dataclasses.replace(P128, total_q=8000, total_k=8000)
    check_fwd(HOP, packed)
    assert default_fwd(packed).variant == HOPPER
    # The same config, but a packed batch's O goes out with plain stores: nothing to defer.
    assert default_fwd(packed) == dataclasses.replace(default_fwd(P128), defer_o=0)
    dense = default_fwd(P128)
    assert dense.defer_o == int(hopper_q_buffers(dense, P128.head_dim) == 2)


@pytest.mark.parametrize("field, value", [("persistent", 1), ("tile_order", 2),
                                          ("pingpong", 1), ("consumer_regs", 232),
                                          ("defer_o", 1), ("tile_overlap", 1)])
def test_portable_config_rejects_hopper_knobs(field: str, value: int) -> None:
    with pytest.raises(InfeasibleConfigError, match=f"{field}={value} has no meaning for the "
                                                    "portable kernel"):
        check_fwd(dataclasses.replace(FwdConfig(), **{field: value}), P128)


def test_interpreter_makes_the_variant_infeasible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config.hopper_support.cache_clear()
    try:
        with pytest.raises(InfeasibleConfigError, match="CPU interpreter cannot run Gluon"):
            check_fwd(HOP, P128)
    finally:
        config.hopper_support.cache_clear()


def test_unverified_triton_makes_the_variant_infeasible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(config, "triton_version", lambda: (3, 99))
    config.hopper_support.cache_clear()
    try:
        assert "verified only on Triton 3.6, this is 3.99" in config.hopper_support()
    finally:
        config.hopper_support.cache_clear()


def test_verified_versions_are_listed_in_code() -> None:
    assert (3, 6) in config.GLUON_VERIFIED_TRITON
    assert all(isinstance(v, tuple) and len(v) == 2 for v in config.GLUON_VERIFIED_TRITON)


def test_triton_without_gluon_hopper_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified version number but no Gluon Hopper module: infeasible, and flashtune and
    its portable kernels still import and work."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(config, "triton_version", lambda: (3, 6))
    real_import = builtins.__import__

    def no_gluon(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("triton.experimental.gluon"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_gluon)
    config.hopper_support.cache_clear()
    try:
        assert "no Gluon Hopper API" in config.hopper_support()
        assert default_fwd(P128).variant == PORTABLE
    finally:
        config.hopper_support.cache_clear()


def test_no_cuda_device_makes_the_variant_infeasible(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(config, "triton_version", lambda: (3, 6))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config.hopper_support.cache_clear()
    try:
        assert config.hopper_support() == "no CUDA device"
    finally:
        config.hopper_support.cache_clear()


def test_cpu_default_is_the_portable_kernel() -> None:
    c = default_fwd(P128)
    assert c.variant == PORTABLE
    check_fwd(c, P128)


def test_default_on_a_hopper_is_the_gluon_kernel(on_hopper: None) -> None:
    for causal in (False, True):
        p = dataclasses.replace(P128, causal=causal)
        c = default_fwd(p)
        assert c.variant == HOPPER
        check_fwd(c, p)
    # Shapes the variant cannot take stay portable.
    assert default_fwd(dataclasses.replace(P128, head_dim=96)).variant == PORTABLE
    assert default_fwd(dataclasses.replace(P128, seqlen_q=17)).variant == PORTABLE
    # Short causal rows: a persistent grid, heaviest tiles first within chunks of heads
    # whose K/V fit in L2 (measured faster there); longer ones and unmasked rows keep
    # their own grids.
    short64 = dataclasses.replace(P128, head_dim=64, seqlen_q=1024, seqlen_k=1024)
    short128 = dataclasses.replace(short64, head_dim=128, seqlen_q=4096, seqlen_k=4096)
    for p in (short64, short128):
        assert (default_fwd(p).persistent, default_fwd(p).tile_order) == (1, 3), p
    assert default_fwd(short128).pingpong and not default_fwd(short64).pingpong
    # Where two Q buffers fit beside the ring, a tile's O store is waited for late.
    for p in (short64, short128, dataclasses.replace(short64, causal=False)):
        c = default_fwd(p)
        assert c.defer_o == int(hopper_q_buffers(c, p.head_dim) == 2), (p, c)
    for p in (dataclasses.replace(short64, seqlen_q=4096, seqlen_k=4096),
              dataclasses.replace(short128, seqlen_q=8192, seqlen_k=8192)):
        assert default_fwd(p).variant == HOPPER and not default_fwd(p).persistent
    assert default_fwd(dataclasses.replace(short64, causal=False)).tile_order == 1
    # Longer causal rows at D=64: three consumers, and so unmasked dense rows of S >= 2048,
    # on the unmasked default's persistent grid; D=128, windows, shorter unmasked rows and
    # packed batches keep two.
    long64 = dataclasses.replace(short64, seqlen_q=4096, seqlen_k=4096)
    assert default_fwd(long64).block_m == 192
    for p in (dataclasses.replace(long64, head_dim=128),
              dataclasses.replace(long64, window=(256, 0)),
              dataclasses.replace(short64, causal=False),
              dataclasses.replace(long64, causal=False, total_q=8000, total_k=8000)):
        assert default_fwd(p).block_m == 128, p
    for s in (2048, 16384):
        p = dataclasses.replace(long64, causal=False, seqlen_q=s, seqlen_k=s)
        c = default_fwd(p)
        assert (c.block_m, c.consumer_regs, c.persistent, c.tile_order) == (192, 160, 1, 1), p
        assert c.defer_o == int(hopper_q_buffers(c, p.head_dim) == 2) == 1, (p, c)
        check_fwd(c, p)


def test_persistent_grids_double_buffer_q_where_it_fits(on_hopper: None) -> None:
    """A persistent program walks several tiles: it gets a second Q buffer (the shared
    memory estimate grows by one Q tile) unless that would push a config the kernel could
    otherwise run past sm90's shared memory; a plain grid keeps one."""
    pers = dataclasses.replace(HOP, persistent=1)
    assert config.hopper_q_buffers(HOP, 128) == 1
    assert config.hopper_q_buffers(pers, 128) == 2
    assert config.smem_fwd_hopper(pers, 128) - config.smem_fwd_hopper(HOP, 128) == 2 * 128 * 128
    # 128x128 tiles with a ring of three at D=128 fill shared memory with one Q buffer:
    # persistent, they keep one and stay feasible.
    ring3 = dataclasses.replace(pers, num_stages=3)
    assert config.hopper_q_buffers(ring3, 128) == 1
    check_fwd(ring3, P128)
    assert config.hopper_q_buffers(ring3, 64) == 2
    # The estimate is what feasibility checks: on a device with less shared memory, the
    # second buffer makes the difference.
    need = config.smem_fwd_hopper(pers, 128)
    check_fwd(HOP, P128, smem_bytes=need - 1)
    with pytest.raises(InfeasibleConfigError, match="fwd hopper: estimated shared memory"):
        check_fwd(pers, P128, smem_bytes=need - 1)


def test_portable_kernel_rejects_the_three_consumer_tile() -> None:
    with pytest.raises(InfeasibleConfigError, match="block_m=192 is the Hopper kernel's"):
        check_fwd(FwdConfig(block_m=192, block_n=64), dataclasses.replace(P128, head_dim=64))


def test_serialization_round_trip_and_old_exports() -> None:
    d = config_to_dict(dataclasses.replace(HOP, pingpong=1, persistent=1))
    assert config_from_dict("fwd", d) == dataclasses.replace(HOP, pingpong=1, persistent=1)
    # An export written before the variant axis existed: the portable kernel, as it was.
    old = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "maxnreg": 0,
           "use_tma": 0}
    assert config_from_dict("fwd", old).variant == PORTABLE
    with pytest.raises(ValueError, match="'variant' = 7"):
        config_from_dict("fwd", {**d, "variant": 7})


def test_active_fields_follow_the_variant() -> None:
    hop, port = set(active_fields(FwdConfig, HOPPER)), set(active_fields(FwdConfig, PORTABLE))
    assert {"consumer_regs", "persistent", "tile_order", "pingpong", "defer_o",
            "tile_overlap"} <= hop - port
    assert {"num_warps", "maxnreg", "use_tma"} <= port - hop
    assert {"block_m", "block_n", "num_stages", "variant"} <= hop & port


def test_space_is_conditional_on_the_variant() -> None:
    space = SearchSpace.full("fwd")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        cfg = space.suggest(trial)
        seen.add(cfg.variant)
        used = set(active_fields(FwdConfig, cfg.variant))
        assert set(trial.params) == used
        # Fields the variant does not use are at their defaults: one spelling per kernel.
        for name in set(config_to_dict(cfg)) - used:
            assert getattr(cfg, name) == getattr(FwdConfig(), name)
        study.tell(trial, 1.0)
    assert seen == {PORTABLE, HOPPER}


def test_neighbours_move_only_the_variants_knobs() -> None:
    space = SearchSpace.full("fwd")
    params = {"variant": HOPPER, "block_m": 128, "block_n": 128, "num_stages": 2}
    moved = {n for p in space.neighbours(params) for n in p
             if p[n] != space.project(params)[n]}  # type: ignore[index]
    assert "num_warps" not in moved and "use_tma" not in moved
    assert {"persistent", "pingpong", "block_n"} <= moved
