"""Config dataclasses: search space as data, validation, feasibility, heuristic defaults."""

from __future__ import annotations

import json
import pathlib

import pytest

from flashtune.exceptions import InfeasibleConfigError
from flashtune.kernels import config
from flashtune.kernels.config import (
    DEFAULT_SMEM_BYTES,
    BwdConfig,
    FwdConfig,
    check_bwd,
    check_fwd,
    config_fields,
    config_from_dict,
    config_to_dict,
    default_bwd,
    default_fwd,
    is_feasible,
    smem_dkdv,
    smem_dq,
    smem_fwd,
)
from flashtune.problem import Problem

DATA = pathlib.Path(__file__).parents[2] / "benchmarks" / "data"
PROBE = DATA / "probe_h200.jsonl"


def test_every_field_declares_its_choices_and_default_is_among_them() -> None:
    for cls in (FwdConfig, BwdConfig):
        space = config_fields(cls)
        assert space, cls
        d = config_to_dict(cls())
        assert set(d) == set(space)
        for name, choices in space.items():
            assert d[name] in choices, (cls.__name__, name)


def test_config_from_dict_round_trip_and_rejections() -> None:
    c = FwdConfig(block_m=32, block_n=64, num_warps=8, num_stages=3)
    assert config_from_dict("fwd", config_to_dict(c)) == c
    with pytest.raises(ValueError, match=r"unknown fwd config field\(s\) \['bogus'\]"):
        config_from_dict("fwd", {"bogus": 1})
    with pytest.raises(ValueError, match=r"'block_m' = 48 is not one of"):
        config_from_dict("fwd", {"block_m": 48})
    with pytest.raises(ValueError, match=r"'num_warps' = True"):
        config_from_dict("fwd", {"num_warps": True})
    with pytest.raises(ValueError, match="direction must be"):
        config_from_dict("sideways", {})


@pytest.mark.parametrize("d", [16, 32, 64, 80, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("s", [1, 17, 1000, 16384])
def test_defaults_are_feasible_everywhere(d: int, s: int) -> None:
    p = Problem(2, 8, 2, s, max(s // 2, 1), d, "bf16", True)
    check_fwd(default_fwd(p), p)
    check_bwd(default_bwd(p), p)
    for variant in (config.BWD_TWO_KERNEL, config.BWD_ONE_LAUNCH):
        assert default_bwd(p, variant).variant == variant
    free = Problem(2, 8, 2, s, max(s // 2, 1), d, "bf16", True, deterministic=False)
    assert default_bwd(free, config.BWD_ATOMIC).variant == config.BWD_ATOMIC


def test_infeasible_configs_are_rejected_with_a_reason() -> None:
    p = Problem(1, 2, 2, 4096, 4096, 256)
    with pytest.raises(InfeasibleConfigError, match=r"fwd: estimated shared memory \d+ B"):
        check_fwd(FwdConfig(block_m=128, block_n=128, num_warps=8, num_stages=4), p)
    with pytest.raises(InfeasibleConfigError, match="registers/thread"):
        check_fwd(FwdConfig(block_m=256, block_n=256, num_warps=4, num_stages=1),
                  Problem(1, 2, 2, 4096, 4096, 64))
    with pytest.raises(InfeasibleConfigError, match="maxnreg=128 is below"):
        check_fwd(FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=1, maxnreg=128),
                  Problem(1, 2, 2, 512, 512, 128))
    with pytest.raises(InfeasibleConfigError, match="bwd dq: estimated shared memory"):
        check_bwd(BwdConfig(dq_block_m=128, dq_block_n=128, dq_stages=4, dq_warps=8), p)


def test_smem_model_never_underestimates_an_out_of_resources_on_the_h200() -> None:
    """Every config that Triton could not fit in shared memory on the H200 is rejected by
    the model, and the model is at least the measured allocation near the limit."""
    rows = [json.loads(line) for line in PROBE.read_text().splitlines()]
    assert len(rows) > 1000
    for r in rows:
        d = r["d"]
        if r["kernel"] == "fwd":
            est = smem_fwd(FwdConfig(block_m=r["bm"], block_n=r["bn"],
                                     num_stages=r["stages"]), d)
        elif r["kernel"] == "dkdv":
            est = smem_dkdv(BwdConfig(dkdv_block_m=r["bm"], dkdv_block_n=r["bn"],
                                      dkdv_stages=r["stages"]), d)
        else:
            est = smem_dq(BwdConfig(dq_block_m=r["bm"], dq_block_n=r["bn"],
                                    dq_stages=r["stages"]), d)
        if "error" in r:
            assert "shared memory" in r["error"]
            assert est > DEFAULT_SMEM_BYTES, r
        elif r["shared"] > DEFAULT_SMEM_BYTES // 2:
            assert est >= r["shared"], r


def test_tma_knob_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Problem(1, 2, 2, 1024, 1024, 128)
    tma = {"use_tma": 1, "block_n": 64}
    monkeypatch.setattr(config, "TRITON_VERSION", (3, 6))
    check_fwd(FwdConfig(block_m=64, num_stages=3, **tma), p)
    check_fwd(FwdConfig(block_m=32, num_stages=2, **tma), p)
    check_fwd(FwdConfig(block_m=64, num_stages=2, use_tma=0), p)
    with pytest.raises(InfeasibleConfigError, match="num_stages=2 and block_m=64 crashes ptxas"):
        check_fwd(FwdConfig(block_m=64, num_stages=2, **tma), p)
    monkeypatch.setattr(config, "TRITON_VERSION", (3, 7))
    check_fwd(FwdConfig(block_m=64, num_stages=2, **tma), p)
    with pytest.raises(InfeasibleConfigError, match="power-of-two head dim, got 80"):
        check_fwd(FwdConfig(block_m=64, block_n=64, use_tma=1), Problem(1, 2, 2, 64, 64, 80))


def test_tma_rule_matches_ptxas_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward TMA config whose build crashed Triton 3.6's ptxas (recorded without a
    GPU by benchmarks/probe_ptxas.py) is rejected under 3.6; every one that built is kept."""
    path = DATA / "ptxas_tma_triton36.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["triton"].startswith("3.6")
    recs = lines[1:]
    monkeypatch.setattr(config, "TRITON_VERSION", (3, 6))
    crashed = kept_ok = 0
    for r in recs:
        cfg = FwdConfig(block_m=r["bm"], block_n=r["bn"], num_warps=r["warps"],
                        num_stages=r["stages"], use_tma=1)
        ok, why = is_feasible(cfg, Problem(1, 2, 2, 256, 256, r["d"], causal=r["causal"]))
        if r["result"].startswith("ptxas crash"):
            assert not ok, r
            crashed += 1
        elif r["result"] == "ok":
            kept_ok += ok
    assert crashed > 50
    # Over-rejection is allowed (the rule is coarse) but must stay small.
    n_ok = sum(r["result"] == "ok" for r in recs)
    assert kept_ok >= 0.95 * n_ok, (kept_ok, n_ok)


# ----------------------------------------------------------------------------- bwd variants


def test_bwd_variants_use_their_own_knobs_and_leave_the_rest_at_defaults() -> None:
    # The Hopper variant's own knobs are tested in test_config_hopper_bwd.py.
    fields = {f for f in config_fields(BwdConfig) if not f.startswith("hopper_")}
    two, atomic, one, fused = (set(config.active_fields(BwdConfig, v)) for v in
                               (config.BWD_TWO_KERNEL, config.BWD_ATOMIC,
                                config.BWD_ONE_LAUNCH, config.BWD_FUSED))
    assert two == fields - {"dkdv_atomic_tma"}
    # Atomic dQ: no dQ kernel loop (keys, stages); the finishing kernel has rows and warps.
    assert atomic == fields - {"dq_block_n", "dq_stages"}
    # One launch: one num_warps / num_stages, the dK/dV ones.
    assert one == fields - {"dq_warps", "dq_stages", "dkdv_atomic_tma"}
    # Fused: the one launch without its preprocess.
    assert fused == one - {"pre_block_m"}
    p = Problem(1, 2, 2, 256, 256, 64, deterministic=False)
    for cfg, name in ((BwdConfig(variant=config.BWD_ATOMIC, dq_block_n=64), "dq_block_n"),
                      (BwdConfig(variant=config.BWD_ONE_LAUNCH, dq_warps=8), "dq_warps"),
                      (BwdConfig(variant=config.BWD_FUSED, pre_block_m=32), "pre_block_m"),
                      (BwdConfig(dkdv_atomic_tma=1), "dkdv_atomic_tma")):
        with pytest.raises(InfeasibleConfigError, match=f"{name}=.* has no meaning for the "):
            check_bwd(cfg, p)


def test_bwd_variant_feasibility_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    det = Problem(1, 2, 2, 256, 256, 64)
    free = Problem(1, 2, 2, 256, 256, 64, deterministic=False)
    assert det.deterministic  # the default, as flash_attention's
    atomic = BwdConfig(variant=config.BWD_ATOMIC)
    with pytest.raises(InfeasibleConfigError, match="serves only deterministic=False"):
        check_bwd(atomic, det)
    check_bwd(atomic, free)
    for p in (det, free):
        check_bwd(BwdConfig(variant=config.BWD_ONE_LAUNCH), p)
        # Under the interpreter (CI) the Gluon backward cannot run, with the reason.
        with pytest.raises(InfeasibleConfigError, match="bwd hopper: the CPU interpreter"):
            check_bwd(BwdConfig(variant=config.BWD_HOPPER), p)
    assert config.BWD_VARIANT_NAMES[config.BWD_HOPPER] == "hopper"
    # The descriptor reduce-add only where the device has it, with the reason otherwise.
    tma = BwdConfig(variant=config.BWD_ATOMIC, dkdv_atomic_tma=1)
    monkeypatch.setattr(config, "descriptor_reduce_support", lambda: "the device is sm80")
    with pytest.raises(InfeasibleConfigError, match="dkdv_atomic_tma=1: the device is sm80"):
        check_bwd(tma, free)
    monkeypatch.setattr(config, "descriptor_reduce_support", lambda: "")
    check_bwd(tma, free)
    # Staging the fp32 dQ tile for TMA costs shared memory the pointer path does not use.
    big = BwdConfig(variant=config.BWD_ATOMIC, dkdv_atomic_tma=1, dkdv_block_m=32,
                    dkdv_block_n=128, dkdv_warps=8, dkdv_stages=3)
    need = smem_dkdv(big, 64)
    ok, why = is_feasible(big, free, smem_bytes=need + 1024)
    assert not ok and "bwd dkdv: estimated shared memory" in why, why
    assert is_feasible(BwdConfig(**{**config_to_dict(big), "dkdv_atomic_tma": 0}), free,
                       smem_bytes=need + 1024)[0]


def test_bwd_one_launch_checks_both_programs_with_the_launch_knobs() -> None:
    p = Problem(1, 2, 2, 4096, 4096, 256)
    # The dQ programs run with dkdv_warps: 16 warps for a 32-row dQ tile leave warps idle.
    with pytest.raises(InfeasibleConfigError, match="bwd dq: 16 warps for a 32-row tile"):
        check_bwd(BwdConfig(variant=config.BWD_ONE_LAUNCH, dkdv_block_m=16, dkdv_block_n=128,
                            dkdv_warps=16, dq_block_m=32), p)
    # ... and with dkdv_stages: a deep dQ pipeline that the two-kernel variant would fit
    # with its own (default) dq_stages does not fit in one launch.
    c = dict(dkdv_block_m=16, dkdv_block_n=16, dkdv_stages=6, dq_block_m=64, dq_block_n=64)
    check_bwd(BwdConfig(**c), p)
    with pytest.raises(InfeasibleConfigError, match="bwd one launch: estimated shared memory"):
        check_bwd(BwdConfig(variant=config.BWD_ONE_LAUNCH, **c), p)


def test_bwd_fused_streams_o_in_its_dkdv_programs() -> None:
    """The fused variant's dK/dV programs stream O beside Q and dO: a pipeline that fits
    one launch with a preprocess may not fit without it."""
    p = Problem(1, 2, 2, 4096, 4096, 128)
    c = dict(dkdv_block_m=64, dkdv_block_n=64, dkdv_warps=4, dkdv_stages=4, dq_block_m=32,
             dq_block_n=32)
    one, fused = (BwdConfig(variant=v, **c) for v in (config.BWD_ONE_LAUNCH, config.BWD_FUSED))
    assert smem_dkdv(fused, 128) - smem_dkdv(one, 128) == 2 * 128 * 64 * 4  # an O tile a stage
    need = smem_dkdv(one, 128)
    assert is_feasible(one, p, smem_bytes=need)[0]
    ok, why = is_feasible(fused, p, smem_bytes=need)
    assert not ok and "bwd one launch: estimated shared memory" in why, why


def test_bwd_default_is_fused_where_host_time_decides() -> None:
    """A host-bound call (fewer than 2**22 scores) gets the fused backward: one launch, no
    delta buffer; a larger one keeps the two-kernel default. Either way deterministic."""
    for det in (True, False):
        small = Problem(1, 1, 1, 128, 128, 64, "bf16", True, deterministic=det)
        assert config.host_bound(small)
        cfg = default_bwd(small)
        assert cfg.variant == config.BWD_FUSED and cfg.pre_block_m == BwdConfig().pre_block_m
        check_bwd(cfg, small)
    edge = Problem(1, 1, 1, 2048, 2048, 128, "bf16", False)  # exactly 2**22 scores
    assert not config.host_bound(edge) and default_bwd(edge).variant == config.BWD_TWO_KERNEL


def test_bwd_default_is_deterministic_for_either_kind_of_problem() -> None:
    for det in (True, False):
        p = Problem(2, 8, 2, 1000, 1000, 128, "bf16", True, deterministic=det)
        cfg = default_bwd(p)
        assert cfg.variant != config.BWD_ATOMIC
        check_bwd(cfg, p)
    # The default tiles as another variant: the knobs it does not use back at defaults.
    p = Problem(2, 8, 2, 1000, 1000, 128, "bf16", True)
    one = default_bwd(p, config.BWD_ONE_LAUNCH)
    assert (one.dq_warps, one.dq_stages) == (BwdConfig().dq_warps, BwdConfig().dq_stages)
    assert one.dkdv_block_m == default_bwd(p).dkdv_block_m
    with pytest.raises(InfeasibleConfigError, match="serves only deterministic=False"):
        default_bwd(p, config.BWD_ATOMIC)
    with pytest.raises(InfeasibleConfigError, match="bwd hopper: the CPU interpreter"):
        default_bwd(p, config.BWD_HOPPER)
