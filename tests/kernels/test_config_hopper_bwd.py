"""The Hopper (Gluon) backward as a config axis (``BwdConfig.variant == BWD_HOPPER``):
feasibility rules with reasons, the deterministic split, the heuristic default, and the
conditional space. Numerics run on the GPU (tests/kernels/test_attn_bwd_hopper.py)."""

from __future__ import annotations

import dataclasses

import optuna
import pytest

from flashtune.autotune.space import SearchSpace
from flashtune.exceptions import InfeasibleConfigError
from flashtune.kernels import config
from flashtune.kernels.config import (
    BWD_FUSED,
    BWD_HOPPER,
    BWD_TWO_KERNEL,
    DEFAULT_SMEM_BYTES,
    HOPPER_BWD_FREE_MIN_KEYS,
    HOPPER_BWD_MIN_SEQLEN,
    BwdConfig,
    active_fields,
    check_bwd,
    config_from_dict,
    config_to_dict,
    default_bwd,
    hopper_bwd_fixed_order,
    host_bound,
    smem_bwd_hopper,
    variant_unavailable,
)
from flashtune.problem import Problem

P = Problem(batch=2, heads_q=16, heads_kv=16, seqlen_q=4096, seqlen_k=4096, head_dim=128,
            dtype="bf16", causal=True, deterministic=False)
HOP = BwdConfig(variant=BWD_HOPPER)


@pytest.fixture
def on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the target checks pass, so the other rules can be tested on the CPU."""
    monkeypatch.setattr(config, "hopper_support", lambda: "")


def test_default_hopper_config_passes_every_rule(on_hopper: None) -> None:
    check_bwd(HOP, P)
    check_bwd(HOP, dataclasses.replace(P, deterministic=True))
    check_bwd(dataclasses.replace(HOP, hopper_block_m=128, hopper_block_n=64, hopper_stages=3),
              dataclasses.replace(P, head_dim=64))


@pytest.mark.parametrize("change, problem_change, words", [
    ({}, {"head_dim": 96}, "head_dim 96"),
    ({}, {"total_q": 8000, "total_k": 8000}, "packed"),
    ({"hopper_block_m": 128}, {}, "hopper_block_m=128 needs head_dim <= 64"),
    ({"dkdv_warps": 8}, {}, "dkdv_warps=8 has no meaning for the hopper kernel"),
    ({"maxnreg": 128}, {}, "maxnreg=128 has no meaning"),
])
def test_hopper_rules_reject_with_reason(on_hopper: None, change: dict, problem_change: dict,
                                         words: str) -> None:
    with pytest.raises(InfeasibleConfigError, match=words):
        check_bwd(dataclasses.replace(HOP, **change), dataclasses.replace(P, **problem_change))


def test_deterministic_runs_need_no_dq_staging(on_hopper: None) -> None:
    """The fixed dQ order stages 32-column chunks instead of whole fp32 dQ tiles, which the
    feasibility formula leaves to the launcher's ring (next test): four stages then fit."""
    four = dataclasses.replace(HOP, hopper_stages=4)
    assert smem_bwd_hopper(four, 128, True) < smem_bwd_hopper(four, 128, False)
    check_bwd(four, dataclasses.replace(P, deterministic=True))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_launch_buffers_fit_beside_every_feasible_config(on_hopper: None, head_dim: int) -> None:
    """What the launch adds to the buffers the feasibility formula counts fits in shared
    memory for every feasible config, in both orders: the staged LSE and Δ rows, the fixed
    order's staging ring (one query tile's chunks at least, two at most) and, where the
    deferred dQ takes it, the second dS slot. The rows are staged for the configs the
    tuner picks (two stages) and given up where they do not fit. Where one tile's chunks
    cannot fit, the plan refuses the config, and so does the search space."""
    from flashtune.kernels.attn_bwd_hopper import DQ_CHUNK, _smem_plan
    from flashtune.kernels.config import DEFAULT_SMEM_BYTES, is_feasible

    space = SearchSpace.full("bwd")
    depths, slots, staged_rows, refused = set(), set(), set(), set()
    for call_det in (True, False):
        p = dataclasses.replace(P, head_dim=head_dim, deterministic=call_det)
        for m in (64, 128):
            for n in (64, 128):
                for stages in (1, 2, 3, 4):
                    c = dataclasses.replace(HOP, hopper_block_m=m, hopper_block_n=n,
                                            hopper_stages=stages)
                    if not is_feasible(c, p)[0]:
                        continue
                    # The order the launch runs (a free-order call whose staging does not
                    # fit runs the fixed order).
                    det = hopper_bwd_fixed_order(c, head_dim, call_det)
                    consumers = n // 64
                    chunks = head_dim // consumers // DQ_CHUNK
                    try:
                        _smem_plan(c, head_dim, det)
                    except InfeasibleConfigError as e:
                        assert det, c  # the free order stages whole tiles, in the formula
                        refused.add((m, n, stages))
                        ok, why = space.feasible(c, p)
                        assert not ok and why == str(e)
                        assert "staging buffers" in why and f"{stages} Q/dO stages" in why
                        continue
                    assert space.feasible(c, p) == (True, "")
                    for masked in (False, True):
                        plan = _smem_plan(c, head_dim, det, masked)
                        rows = 2 * stages * m * 4 if plan.stage_lse else 0
                        if not det:
                            assert (plan.dq_ring, plan.ds_bufs) == (1, 1)
                            assert smem_bwd_hopper(c, head_dim, False) + rows \
                                <= DEFAULT_SMEM_BYTES, c
                            if stages == 2:
                                assert plan.stage_lse, c
                            staged_rows.add((det, plan.stage_lse))
                            continue
                        # Fewer than one tile's chunks hang the dQ writer (see _smem_plan).
                        assert chunks <= plan.dq_ring <= 2 * chunks, (c, plan)
                        staged = consumers * plan.dq_ring * m * DQ_CHUNK * 4
                        second_ds = (plan.ds_bufs - 1) * 2 * n * m
                        assert (smem_bwd_hopper(c, head_dim, True) + rows + staged + second_ds
                                <= DEFAULT_SMEM_BYTES), (c, plan)
                        # Two slots only for two consumers, not for 64-row tiles under a mask.
                        assert plan.ds_bufs in (1, 2)
                        if consumers == 1 or (masked and m == 64):
                            assert plan.ds_bufs == 1, (c, masked)
                        if stages == 2:
                            assert plan.stage_lse, c
                        depths.add((plan.dq_ring, chunks))
                        slots.add(plan.ds_bufs)
                        staged_rows.add((det, plan.stage_lse))
    # Some rings are cut below two tiles' chunks where shared memory runs short.
    assert any(ring < 2 * chunks for ring, chunks in depths)
    assert any(ring == 2 * chunks for ring, chunks in depths)
    assert slots == {1, 2}
    # At head dim 128, four stages of 64 x 128 tiles leave room for one 16 KiB chunk of the
    # two a tile needs (it hung in an H100 search); at 64 every feasible config plans.
    assert refused == ({(64, 128, 4)} if head_dim == 128 else set())
    # At head dim 64 the configs at the shared-memory limit (128-row tiles, three and four
    # stages) give the rows up, in both orders; at 128 every feasible config stages them.
    assert staged_rows == ({(True, True), (True, False), (False, True), (False, False)}
                           if head_dim == 64 else {(True, True), (False, True)})


def test_portable_config_rejects_hopper_knobs() -> None:
    with pytest.raises(InfeasibleConfigError, match="hopper_stages=3 has no meaning"):
        check_bwd(BwdConfig(hopper_stages=3), P)


def test_interpreter_makes_the_variant_unavailable() -> None:
    # The CI runs under TRITON_INTERPRET=1: no Gluon, so the variant is never sampled.
    reason = variant_unavailable("bwd", BWD_HOPPER, P)
    assert "bwd hopper" in reason
    with pytest.raises(InfeasibleConfigError, match="bwd hopper"):
        default_bwd(P, BWD_HOPPER)
    assert default_bwd(P).variant == BWD_TWO_KERNEL


def test_default_on_a_hopper_takes_it_from_1k_queries_and_keys(on_hopper: None) -> None:
    """Session 42's A/B (H200): the default Hopper config beat the portable default on
    every measured shape from S = 1k, in the fixed dQ order too; so a call whose query and
    key sequences are both that long takes it, with either determinism. Below, the free
    order keeps session 24's rule (from 8k keys, any number of queries)."""
    assert P.seqlen_q == P.seqlen_k == 4096
    for det in (False, True):
        p = dataclasses.replace(P, deterministic=det)
        assert default_bwd(p).variant == BWD_HOPPER
        at_1k = dataclasses.replace(p, seqlen_q=HOPPER_BWD_MIN_SEQLEN,
                                    seqlen_k=HOPPER_BWD_MIN_SEQLEN)
        assert default_bwd(at_1k).variant == BWD_HOPPER
        short_q = dataclasses.replace(p, seqlen_q=HOPPER_BWD_MIN_SEQLEN - 1)
        assert default_bwd(short_q).variant == BWD_TWO_KERNEL
        check_bwd(default_bwd(p), p)
    # Few queries, many keys: the Hopper kernel for the free order only.
    decode = dataclasses.replace(P, seqlen_q=300, seqlen_k=HOPPER_BWD_FREE_MIN_KEYS)
    assert default_bwd(decode).variant == BWD_HOPPER
    assert default_bwd(dataclasses.replace(decode, deterministic=True)).variant \
        == BWD_TWO_KERNEL
    assert default_bwd(dataclasses.replace(decode, seqlen_k=HOPPER_BWD_FREE_MIN_KEYS - 1)
                       ).variant == BWD_TWO_KERNEL
    # Head dims and packed batches it cannot take stay portable; host-bound calls fused.
    assert default_bwd(dataclasses.replace(P, head_dim=96)).variant == BWD_TWO_KERNEL
    packed = dataclasses.replace(P, total_q=9000, total_k=9000)
    assert default_bwd(packed).variant == BWD_TWO_KERNEL
    tiny = dataclasses.replace(P, batch=1, heads_q=1, heads_kv=1, seqlen_q=1024, seqlen_k=1024)
    assert host_bound(tiny) and default_bwd(tiny).variant == BWD_FUSED
    for p in (P, dataclasses.replace(P, head_dim=64, causal=False)):
        check_bwd(default_bwd(p), p)


def test_active_fields_and_round_trip() -> None:
    fields = set(active_fields(BwdConfig, BWD_HOPPER))
    assert {"hopper_block_m", "hopper_block_n", "hopper_stages", "hopper_regs",
            "hopper_stagger", "hopper_walk", "hopper_dq_fixed", "hopper_dq_groups",
            "hopper_kv_regs", "hopper_dq_frag", "hopper_dq_store_first", "hopper_split",
            "hopper_persist", "hopper_dkdv_tma", "hopper_kv_rep", "hopper_dq_rows",
            "hopper_dq_unordered", "pre_block_m",
            "variant"} == fields
    assert not fields & set(active_fields(BwdConfig, BWD_TWO_KERNEL)) - {"pre_block_m",
                                                                         "variant"}
    cfg = dataclasses.replace(HOP, hopper_block_n=64, hopper_regs=232)
    assert config_from_dict("bwd", config_to_dict(cfg)) == cfg


def test_dq_fixed_keeps_a_free_order_call_in_the_fixed_order(on_hopper: None) -> None:
    """``hopper_dq_fixed`` (session 35): 1 runs a ``deterministic=False`` call in the fixed
    dQ order even where the free order fits; configs written before it read as 0; a
    deterministic problem refuses 1 (it always takes the fixed order: one kernel, one
    spelling), and :func:`for_nondeterministic_call` sets it on Hopper configs only."""
    from flashtune.kernels.config import for_nondeterministic_call

    old = config_to_dict(HOP)
    del old["hopper_dq_fixed"]
    assert config_from_dict("bwd", old).hopper_dq_fixed == 0
    pinned = dataclasses.replace(HOP, hopper_dq_fixed=1)
    assert config_from_dict("bwd", config_to_dict(pinned)) == pinned
    assert not hopper_bwd_fixed_order(HOP, 128, False)
    assert hopper_bwd_fixed_order(pinned, 128, False) and hopper_bwd_fixed_order(HOP, 128, True)
    free = dataclasses.replace(P, deterministic=False)
    det = dataclasses.replace(P, deterministic=True)
    check_bwd(pinned, free)
    check_bwd(HOP, det)
    with pytest.raises(InfeasibleConfigError, match="hopper_dq_fixed=1 is for "
                                                    "deterministic=False"):
        check_bwd(pinned, det)
    assert for_nondeterministic_call(HOP) == pinned
    portable = default_bwd(dataclasses.replace(P, head_dim=96))
    assert for_nondeterministic_call(portable) is portable


def test_dq_unordered_drops_the_turns_of_a_free_call_in_the_fixed_staging(
        on_hopper: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hopper_dq_unordered`` (session 67): 1 runs a ``deterministic=False`` call in the
    fixed order's dQ staging without its turns. Configs written before it read as 0. The
    rules allow it only there: a deterministic call (it needs the turns), a free call whose
    free staging fits (it has no turns) and a first turn stored (there is none) refuse it;
    a search of a deterministic problem never proposes it. The launch takes no semaphores,
    zeroes the whole accumulator, and under a mask launches each head's heaviest key tile
    first (ORDER 0), where the turns launch the lightest first (ORDER 1)."""
    import torch

    from flashtune.kernels import attn_bwd_hopper
    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch

    monkeypatch.setattr(attn_bwd_hopper, "_sm_count", lambda index: 132)  # (an H100/H200)
    old = config_to_dict(HOP)
    del old["hopper_dq_unordered"]
    assert config_from_dict("bwd", old).hopper_dq_unordered == 0
    fixed = dataclasses.replace(HOP, hopper_dq_fixed=1, hopper_dq_frag=1)
    loose = dataclasses.replace(fixed, hopper_dq_unordered=1)
    assert config_from_dict("bwd", config_to_dict(loose)) == loose
    free = dataclasses.replace(P, deterministic=False)
    det = dataclasses.replace(P, deterministic=True)
    check_bwd(loose, free)
    # Three 64 x 128 stages leave the free staging no room: the fixed staging, unpinned.
    deep = dataclasses.replace(HOP, hopper_stages=3, hopper_dq_unordered=1)
    assert hopper_bwd_fixed_order(deep, 128, False)
    check_bwd(deep, free)
    with pytest.raises(InfeasibleConfigError, match="a deterministic call needs the turns"):
        check_bwd(dataclasses.replace(HOP, hopper_dq_unordered=1), det)
    with pytest.raises(InfeasibleConfigError, match="free order fits and takes no turns"):
        check_bwd(dataclasses.replace(HOP, hopper_dq_unordered=1), free)
    with pytest.raises(InfeasibleConfigError, match="takes no turns .nothing comes first"):
        check_bwd(dataclasses.replace(loose, hopper_dq_store_first=2), free)
    full = SearchSpace.full("bwd")
    assert full.for_problem(det).fields["hopper_dq_unordered"] == (0,)
    assert full.for_problem(free).fields["hopper_dq_unordered"] == (0, 1)

    b, h, s, d = 2, 4, 1000, 128
    q, do, o, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(5))
    for mask, turned, loosened in (((-1, 0, False, True), 1, 0), ((-1, -1, False, False), 2, 2)):
        plans = {}
        for name, cfg, det_call in (("det", dataclasses.replace(fixed, hopper_dq_fixed=0,
                                                                hopper_dq_store_first=2), True),
                                    ("turns", fixed, False), ("loose", loose, False)):
            plans[name] = HopperBwdLaunch(do, q, k, v, o, sm_scale=0.125, mask=mask,
                                          scales=(0.18, 0.0, 0.0), softcap=0.0, config=cfg,
                                          deterministic=det_call)
        for name in ("det", "turns"):
            kw = plans[name].main.kwargs
            assert plans[name].turns and kw["TURNS"] and kw["DETERMINISTIC"]
            assert kw["ORDER"] == turned
        assert plans["det"].zero_blocks is not None and plans["det"].main.kwargs["STORE_FIRST"]
        kw = plans["loose"].main.kwargs
        # The fixed order's staging (DETERMINISTIC), no turns, nothing stored first.
        assert kw["DETERMINISTIC"] and not kw["TURNS"] and kw["STORE_FIRST"] == 0
        assert kw["ORDER"] == loosened and not plans["loose"].turns
        assert plans["loose"].zero_blocks is None
        acc, sem = plans["loose"].scratch(torch.device("cpu"))
        assert sem is acc  # no semaphores
        acc, sem = plans["turns"].scratch(torch.device("cpu"))
        assert sem.dtype == torch.int32 and tuple(sem.shape) == plans["turns"].sem_shape


def test_dq_groups_is_a_fixed_order_knob(on_hopper: None) -> None:
    """``hopper_dq_groups`` (session 36): 1 stages the fixed order's dQ chunks in column
    groups of eight, 64 columns a chunk where a consumer's share of D allows. Configs
    written before it read as 0; a call that runs the free order refuses 1 (its staging is
    the whole tile: one kernel, one spelling), a pinned free-order call takes it."""
    from flashtune.kernels.attn_bwd_hopper import (
        DQ_CHUNK,
        DQ_GROUPED_CHUNK,
        _smem_plan,
        dq_chunk,
    )

    old = config_to_dict(HOP)
    del old["hopper_dq_groups"]
    assert config_from_dict("bwd", old).hopper_dq_groups == 0
    grouped = dataclasses.replace(HOP, hopper_dq_groups=1)
    assert config_from_dict("bwd", config_to_dict(grouped)) == grouped
    det = dataclasses.replace(P, deterministic=True)
    free = dataclasses.replace(P, deterministic=False)
    check_bwd(grouped, det)
    with pytest.raises(InfeasibleConfigError, match="hopper_dq_groups=1 stages the fixed dQ "
                                                    "order's chunks"):
        check_bwd(grouped, free)
    check_bwd(dataclasses.replace(grouped, hopper_dq_fixed=1), free)
    # Chunk widths: two consumers at D=128 take one 64-column chunk each, at D=64 their
    # 32 columns; one consumer (64 keys) at D=128 two chunks of 64; rows of 32 without the
    # knob, the whole tile in the free order.
    one = dataclasses.replace(grouped, hopper_block_n=64)
    assert dq_chunk(grouped, 128, True) == DQ_GROUPED_CHUNK == 64
    assert dq_chunk(grouped, 64, True) == 32
    assert dq_chunk(one, 128, True) == 64
    assert dq_chunk(HOP, 128, True) == DQ_CHUNK == 32
    assert dq_chunk(HOP, 128, False) == 128
    # The staging ring holds at least a query tile's chunks, in bytes as without the knob:
    # at D=128 one 64-column chunk per tile (32 KiB for two consumers), not two of 32.
    plain, wide = _smem_plan(HOP, 128, True), _smem_plan(grouped, 128, True)
    assert plain.dq_ring >= 128 // 2 // 32 and wide.dq_ring >= 1
    assert plain.dq_ring * 32 == wide.dq_ring * 64


def test_a_deterministic_search_never_proposes_dq_fixed(on_hopper: None) -> None:
    """``SearchSpace.for_problem`` (which every search applies first) fixes
    ``hopper_dq_fixed`` at 0 for a deterministic backward: no sampler pick or polishing move
    is spent on a value the rules refuse there. A free-order problem keeps both."""
    full = SearchSpace.full("bwd")
    det = dataclasses.replace(P, deterministic=True)
    free = dataclasses.replace(P, deterministic=False)
    assert full.for_problem(det).fields["hopper_dq_fixed"] == (0,)
    assert full.for_problem(free).fields["hopper_dq_fixed"] == (0, 1)
    assert SearchSpace.full("fwd").for_problem(det) == SearchSpace.full("fwd")
    narrowed = full.for_problem(det)
    hopper = config_to_dict(HOP)
    assert all(n["hopper_dq_fixed"] == 0 for n in narrowed.neighbours(hopper, 1))
    assert any(n["hopper_dq_fixed"] == 1 for n in full.for_problem(free).neighbours(hopper, 1))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(40):
        trial = study.ask()
        cfg = narrowed.suggest(trial, det)
        assert cfg.hopper_dq_fixed == 0
        study.tell(trial, 1.0)


def test_gqa_walk_is_a_knob_and_configs_written_before_it_read_as_the_flat_walk() -> None:
    """``hopper_walk`` (session 34): 1, the default, walks a GQA group's query heads in one
    flat loop, 0 in a loop per head (the code before the knob, which the shipped H100
    entry it was not re-searched for keeps). Older configs, without the field, read as the
    default; the launch passes the knob to the kernel as its WALK constexpr."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch

    old = config_to_dict(HOP)
    del old["hopper_walk"]
    assert config_from_dict("bwd", old).hopper_walk == 1
    nested = dataclasses.replace(HOP, hopper_walk=0)
    assert config_to_dict(nested)["hopper_walk"] == 0
    assert config_from_dict("bwd", config_to_dict(nested)) == nested
    with pytest.raises(ValueError, match="hopper_walk"):
        config_from_dict("bwd", {**old, "hopper_walk": 2})
    b, hq, hk, s, d = 1, 8, 2, 256, 64
    q, do, o = (torch.randn(b, hq, s, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.randn(b, hk, s, d, dtype=torch.bfloat16) for _ in range(2))
    for walk in (0, 1):
        launch = HopperBwdLaunch(do, q, k, v, o, sm_scale=0.125, mask=(-1, 0, False, True),
                                 scales=(0.18, 0.0, 0.0), softcap=0.0,
                                 config=dataclasses.replace(HOP, hopper_walk=walk),
                                 deterministic=True)
        assert launch.main.kwargs["WALK"] == walk and launch.main.kwargs["GQA"] == 4


def test_space_samples_hopper_knobs_only_for_the_hopper(on_hopper: None) -> None:
    space = SearchSpace.full("bwd")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        cfg = space.suggest(trial, P)
        assert set(trial.params) == set(active_fields(BwdConfig, cfg.variant))
        study.tell(trial, 1.0)
        seen.add(cfg.variant)
        default = BwdConfig()
        for f in dataclasses.fields(cfg):
            if f.name not in active_fields(BwdConfig, cfg.variant):
                assert getattr(cfg, f.name) == getattr(default, f.name), (cfg, f.name)
    assert BWD_HOPPER in seen
    # Deterministic problems still sample it (its fixed-order mode), never the atomic one.
    det = dataclasses.replace(P, deterministic=True)
    assert BWD_HOPPER in space.variants(det) and 1 not in space.variants(det)


def test_host_bound_calls_keep_the_portable_kernels(on_hopper: None) -> None:
    """Tiny calls are bound by host time, where the Hopper launches (TMA descriptors built
    per call) cost more than they save: both defaults stay portable there (the backward
    in one launch, its preprocess fused in)."""
    from flashtune.kernels.config import HOPPER, default_fwd

    tiny = Problem(batch=1, heads_q=1, heads_kv=1, seqlen_q=128, seqlen_k=128, head_dim=64,
                   deterministic=False)
    assert default_fwd(tiny).variant != HOPPER
    assert default_bwd(tiny).variant == BWD_FUSED
    big = dataclasses.replace(tiny, batch=8, heads_q=16, heads_kv=16, seqlen_q=8192,
                              seqlen_k=8192)
    assert default_fwd(big).variant == HOPPER
    assert default_bwd(big).variant == BWD_HOPPER


def test_prepared_backward_fixes_the_call_signature() -> None:
    """``HopperBwdLaunch`` (the backward prepared once per call signature, its launches
    bound) on CPU tensors: nothing launches, but what it fixes can be read.

    - The LSE and Δ rows are staged through TMA only where Sq % 4 == 0 (16-byte rows).
    - dK, dV and dQ get empty_like's strides, which for a non-dense K (one half of a
      packed K/V) are contiguous ones, not K's.
    - Per call, a misaligned LSE is copied to an aligned one where the rows are staged
      (TMA needs it), and passed on as it is where they are not."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch

    b, h, d = 2, 4, 64
    cfg = dataclasses.replace(HOP, hopper_block_m=64, hopper_block_n=128, hopper_stages=2)

    def prepared(sq: int, k: torch.Tensor, det: bool = True) -> HopperBwdLaunch:
        q, do, o = (torch.randn(b, h, sq, d, dtype=torch.bfloat16) for _ in range(3))
        v = torch.randn_like(k)
        return HopperBwdLaunch(do, q, k, v, o, sm_scale=0.125, mask=(-1, 0, False, True),
                               scales=(0.18, 0.0, 0.0), softcap=0.0, config=cfg,
                               deterministic=det)

    kv = torch.randn(b, h, 512, 2 * d, dtype=torch.bfloat16)
    k = kv[..., :d]  # row stride 2 * d: TMA can describe it, empty_like does not keep it
    staged = prepared(512, k)
    assert staged.stage_lse and staged.rows is not None
    assert staged.rows.shape == [b * h, 512] and staged.rows.block_shape == [1, 64]
    dense = (h * 512 * d, 512 * d, d)
    assert tuple(staged.main.args[10:13]) == dense and k.stride()[:3] != dense
    assert tuple(staged.main.args[13:16]) == dense  # dV, as V = randn_like(K) is dense
    assert staged.sem_shape == (b * h, 512 // 64, 2)

    lse = torch.randn(b * h * 512 + 1)[1:].view(b, h, 512)  # 4 bytes past an aligned base
    assert lse.data_ptr() % 16
    dq, dk, dv, lse_in, delta, dq_acc, sem = staged.buffers(*(torch.empty(b, h, 512, d),) * 3,
                                                            lse)
    assert lse_in.data_ptr() % 16 == 0 and torch.equal(lse_in, lse)
    assert dq_acc.shape == (b, h, 512, d) and dq_acc.dtype == torch.float32
    assert sem.shape == (b * h, 8, 2) and sem.dtype == torch.int32

    odd = prepared(1001, torch.randn(b, h, 1001, d, dtype=torch.bfloat16), det=False)
    assert not odd.stage_lse and odd.rows is None
    lse_odd = torch.randn(b * h * 1001 + 1)[1:].view(b, h, 1001)
    bufs = odd.buffers(*(torch.empty(b, h, 1001, d),) * 3, lse_odd)
    assert bufs[3] is lse_odd  # read with masked loads: no alignment needed, no copy
    assert bufs[6] is bufs[5]  # the free order has no semaphores


def test_a_split_backward_runs_two_halves_of_whole_heads() -> None:
    """``hopper_split=2`` (on CPU tensors: nothing launches, what is fixed can be read):
    the batch is halved where it has two sequences, else the KV heads with their groups'
    query heads; one sequence of one KV head, or ``hopper_split=1``, is not split. Each
    half is prepared over views of the call's tensors and bakes in the strides of the
    whole call's gradients (a head slice of the flash-attn layout is a strided view, whose
    empty_like would be contiguous), and gets its own accumulator and semaphores."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import (
        HopperBwdLaunch,
        SplitHopperBwdLaunch,
        prepare_hopper_bwd,
        split_plan,
    )

    all_ = slice(0, None)
    assert split_plan(3, 8, 2, 2) == [(slice(0, 1), all_, all_), (slice(1, 3), all_, all_)]
    assert split_plan(1, 12, 3, 2) == [(all_, slice(0, 4), slice(0, 1)),
                                       (all_, slice(4, 12), slice(1, 3))]
    assert split_plan(1, 4, 1, 2) == split_plan(5, 4, 4, 1) == [(all_, all_, all_)]

    d, s = 64, 512
    cfg = dataclasses.replace(HOP, hopper_block_m=64, hopper_block_n=128, hopper_stages=2,
                              hopper_split=2)

    def prepared(b: int, hq: int, hk: int, c: BwdConfig = cfg) -> tuple[object, tuple]:
        # The flash-attn layout: (B, S, H, D) storage seen as (B, H, S, D).
        q, do, o = (torch.randn(b, s, hq, d, dtype=torch.bfloat16).transpose(1, 2)
                    for _ in range(3))
        k, v = (torch.randn(b, s, hk, d, dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        return prepare_hopper_bwd(do, q, k, v, o, sm_scale=0.125, mask=(-1, 0, False, True),
                                  scales=(0.18, 0.0, 0.0), softcap=0.0, config=c,
                                  deterministic=True), (q, k, v)

    whole, _ = prepared(2, 4, 4, dataclasses.replace(cfg, hopper_split=1))
    assert type(whole) is HopperBwdLaunch
    alone, _ = prepared(1, 4, 1)
    assert type(alone) is HopperBwdLaunch

    heads, (q, k, v) = prepared(1, 6, 3)
    assert isinstance(heads, SplitHopperBwdLaunch) and len(heads.parts) == 2
    first, second = heads.parts
    # The main kernel's grid is (key tiles, batch x KV heads); dK and dV strides are the
    # whole call's (B, S, H, D) ones, not a contiguous half's.
    assert first.main.grid[:2] == (4, 1) and second.main.grid[:2] == (4, 2)
    bshd = (s * 3 * d, d, 3 * d)
    assert tuple(first.main.args[10:13]) == tuple(second.main.args[13:16]) == bshd
    assert first.sem_shape == (2, s // 64, 2) and second.sem_shape == (4, s // 64, 2)
    # The finish kernel writes dQ with the whole call's strides too.
    assert tuple(second.finish.args[2:6]) == tuple(torch.empty_like(q).stride())
    bufs = heads.buffers(q, k, v, torch.randn(1, 6, s))
    assert [t.shape for t in bufs[:5]] == [q.shape, k.shape, v.shape, (1, 6, s), (1, 6, s)]
    assert bufs[0].stride() == torch.empty_like(q).stride()
    assert [t.shape for t in bufs[5:]] == [torch.Size(first.acc_shape),
                                           torch.Size(first.sem_shape),
                                           torch.Size(second.acc_shape),
                                           torch.Size(second.sem_shape)]

    batch, _ = prepared(3, 4, 2)
    assert [p.main.grid[:2] for p in batch.parts] == [(4, 2), (4, 4)]


def test_a_split_backward_forks_before_its_first_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """The side stream must fork from the current one before the first half's launches,
    so that the halves run at once: forking after them made the second half wait for the
    whole first one (session 54: 0.84-0.99x the whole call, with every gradient right).
    Streams and launches are recorded here in the order ``run`` issues them."""
    import contextlib

    import torch

    from flashtune.kernels.attn_bwd_hopper import prepare_hopper_bwd

    b, h, s, d = 2, 4, 512, 64
    q, do, o, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(5))
    cfg = dataclasses.replace(HOP, hopper_block_m=64, hopper_block_n=128, hopper_stages=2,
                              hopper_split=2)
    launch = prepare_hopper_bwd(do, q, k, v, o, sm_scale=0.125, mask=(-1, 0, False, True),
                                scales=(0.18, 0.0, 0.0), softcap=0.0, config=cfg,
                                deterministic=True)
    log: list[tuple[str, ...]] = []
    on = ["cur"]

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            log.append(("wait", self.name, other.name))

    @contextlib.contextmanager
    def stream(st: Stream):  # type: ignore[no-untyped-def]
        on.append(st.name)
        yield
        on.pop()

    cur = Stream("cur")
    launch.side = Stream("side")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cur)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    for i, part in enumerate(launch.parts):
        def run(*args: object, i: int = i) -> None:
            log.append(("run", f"half {i}", on[-1]))
        monkeypatch.setattr(part, "run", run)
    launch.run(do, q, k, v, o, launch.buffers(q, k, v, torch.randn(b, h, s)))
    assert log == [("wait", "side", "cur"), ("run", "half 0", "cur"),
                   ("run", "half 1", "side"), ("wait", "cur", "side")]


def test_a_forced_config_the_launch_cannot_plan_fails_before_any_launch(
        on_hopper: None) -> None:
    """A forced Hopper backward config that passes the feasibility formula but not the
    launch's plan is refused when the call is checked (forced_configs), with the plan's
    reason, not when its backward is launched after the forward ran."""
    import torch

    from flashtune.kernels.attention import flash_attention, forced_configs

    det = dataclasses.replace(P, deterministic=True)
    four = dataclasses.replace(HOP, hopper_block_m=64, hopper_block_n=128, hopper_stages=4)
    check_bwd(four, det)  # the formula alone lets it through
    with pytest.raises(InfeasibleConfigError, match="staging buffers"):
        forced_configs(four, det)
    three = dataclasses.replace(four, hopper_stages=3)
    assert forced_configs(three, det) == (None, three)
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(InfeasibleConfigError, match="staging buffers"):
        flash_attention(q, q, q, config=four)


def test_a_free_order_call_runs_the_fixed_order_where_its_staging_does_not_fit(
        on_hopper: None) -> None:
    """The free order stages each consumer's fp32 dQ tile in shared memory; where that does
    not fit beside a config's buffers, a ``deterministic=False`` call runs the fixed order
    (a deterministic run serves it) instead of the config being rejected for it."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch, check_launch_plan

    free = Problem(4, 32, 8, 4096, 4096, 128, "bf16", False, deterministic=False)
    three = dataclasses.replace(HOP, hopper_block_m=64, hopper_block_n=128, hopper_stages=3)
    two = dataclasses.replace(three, hopper_stages=2)
    assert smem_bwd_hopper(three, 128, False) > DEFAULT_SMEM_BYTES \
        >= smem_bwd_hopper(three, 128, True)
    assert smem_bwd_hopper(two, 128, False) <= DEFAULT_SMEM_BYTES
    assert hopper_bwd_fixed_order(three, 128, False) and hopper_bwd_fixed_order(three, 128, True)
    assert not hopper_bwd_fixed_order(two, 128, False) and hopper_bwd_fixed_order(two, 128, True)
    check_bwd(three, free)  # feasible: it runs in the fixed order
    check_launch_plan(three, 128, False)
    # A device with less shared memory than either order needs still refuses it.
    with pytest.raises(InfeasibleConfigError, match="shared memory"):
        check_bwd(three, free, smem_bytes=smem_bwd_hopper(three, 128, True) - 1)

    b, hq, hk, s, d = 1, 8, 2, 256, 128
    q, do, o = (torch.randn(b, hq, s, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.randn(b, hk, s, d, dtype=torch.bfloat16) for _ in range(2))
    for cfg, fixed in ((three, True), (two, False)):
        launch = HopperBwdLaunch(do, q, k, v, o, sm_scale=0.125, mask=(-1, 0, False, True),
                                 scales=(0.18, 0.0, 0.0), softcap=0.0, config=cfg,
                                 deterministic=False)
        assert launch.deterministic is fixed and launch.main.kwargs["DETERMINISTIC"] is fixed
        bufs = launch.buffers(q, k, v, torch.randn(b, hq, s))
        assert (bufs[6] is not bufs[5]) is fixed  # semaphores only for the fixed order


def test_kv_regs_is_a_d64_knob_on_by_default_there(on_hopper: None) -> None:
    """``hopper_kv_regs`` (session 42): 1 holds K and V in registers for Sᵀ and dPᵀ, at
    D=64 only. Configs written before it read as 0 (the code they were tuned on); the
    default Hopper backward takes 1 at D=64 and 0 at D=128; D=128 refuses 1 with the
    reason, and a search there never proposes it; the launch passes it as KV_REGS."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch

    old = config_to_dict(HOP)
    del old["hopper_kv_regs"]
    assert config_from_dict("bwd", old).hopper_kv_regs == 0
    p64 = dataclasses.replace(P, head_dim=64)
    assert default_bwd(p64, BWD_HOPPER).hopper_kv_regs == 1
    assert default_bwd(P, BWD_HOPPER).hopper_kv_regs == 0
    regs = dataclasses.replace(HOP, hopper_kv_regs=1)
    check_bwd(regs, p64)
    check_bwd(regs, dataclasses.replace(p64, deterministic=True))
    with pytest.raises(InfeasibleConfigError, match="hopper_kv_regs=1 needs head_dim 64"):
        check_bwd(regs, P)
    full = SearchSpace.full("bwd")
    assert full.for_problem(P).fields["hopper_kv_regs"] == (0,)
    assert full.for_problem(p64).fields["hopper_kv_regs"] == (0, 1)
    det128 = full.for_problem(dataclasses.replace(P, deterministic=True))
    assert det128.fields["hopper_kv_regs"] == (0,) and det128.fields["hopper_dq_fixed"] == (0,)
    b, h, s, d = 1, 2, 256, 64
    q, do, o, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(5))
    for kv_regs in (0, 1):
        launch = HopperBwdLaunch(do, q, k, v, o, sm_scale=0.125, mask=(-1, 0, False, True),
                                 scales=(0.18, 0.0, 0.0), softcap=0.0,
                                 config=dataclasses.replace(HOP, hopper_kv_regs=kv_regs),
                                 deterministic=False)
        assert launch.main.kwargs["KV_REGS"] is bool(kv_regs)


def test_dq_frag_is_a_knob_of_both_orders_and_the_default_at_d128(on_hopper: None) -> None:
    """``hopper_dq_frag`` (session 48): 1 stages dQ in the wgmma's register order and keeps
    the fp32 accumulator in that order, in either dQ order. Configs written before it read
    as 0; the default Hopper backward takes it at D=128; it excludes column groups (two
    layouts of one buffer) with the reason; the fixed order hands over the chunks column
    groups would, in the same shared memory; the launch allocates the accumulator as one
    block per (query tile, column chunk), zeroed by run() (the part the tuner times) instead
    of by the preprocess, and casts it back with the register-order kernel."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch, _smem_plan, dq_chunk

    old = config_to_dict(HOP)
    del old["hopper_dq_frag"]
    assert config_from_dict("bwd", old).hopper_dq_frag == 0
    frag = dataclasses.replace(HOP, hopper_dq_frag=1)
    assert config_from_dict("bwd", config_to_dict(frag)) == frag
    d128, d64 = default_bwd(P, BWD_HOPPER), default_bwd(dataclasses.replace(P, head_dim=64),
                                                         BWD_HOPPER)
    assert (d128.hopper_dq_frag, d128.hopper_dq_groups, d64.hopper_dq_frag) == (1, 0, 0)
    det = dataclasses.replace(P, deterministic=True)
    free = dataclasses.replace(P, deterministic=False)
    check_bwd(frag, det)
    check_bwd(frag, free)
    both = dataclasses.replace(frag, hopper_dq_groups=1)
    for c, p in ((both, det), (dataclasses.replace(both, hopper_dq_fixed=1), free)):
        with pytest.raises(InfeasibleConfigError, match="hopper_dq_groups=1 and hopper_dq_frag=1"):
            check_bwd(c, p)
    grouped = dataclasses.replace(HOP, hopper_dq_groups=1)
    assert dq_chunk(frag, 128, True) == dq_chunk(grouped, 128, True) == 64
    assert dq_chunk(frag, 64, True) == 32 and dq_chunk(frag, 128, False) == 128
    assert _smem_plan(frag, 128, True) == _smem_plan(grouped, 128, True)
    b, h, s, d = 1, 2, 300, 128
    q, do, o, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(b, h, s)
    for cfg, deterministic, rows in ((frag, True, 64 * 64 // 256),
                                     (frag, False, 64 * 128 // 256), (HOP, True, None)):
        launch = HopperBwdLaunch(do, q, k, v, o, sm_scale=0.125, mask=(-1, 0, False, True),
                                 scales=(0.18, 0.0, 0.0), softcap=0.0, config=cfg,
                                 deterministic=deterministic)
        bufs = launch.buffers(q, k, v, lse)
        acc = bufs[5]
        if rows is None:  # rows, zeroed by the preprocess
            assert launch.main.kwargs["DQ_LAYOUT"] == 0 and launch.pre.kwargs["ZERO_DQ"]
            assert acc.shape == (b, h, s, d)
            continue
        n_m, chunks = -(-s // 64), d // (rows * 256 // 64)
        assert launch.main.kwargs["DQ_LAYOUT"] == 2 and not launch.pre.kwargs["ZERO_DQ"]
        assert acc.shape == (b * h, n_m * chunks, rows, 256)
        assert launch.finish.kwargs == dict(HEAD_DIM=d, BLOCK_M=64, CHUNK=rows * 256 // 64,
                                            num_warps=4)
        # run() zeroes the accumulator before the kernels add into it, on every call: the
        # tuner times run() again and again on buffers made once. (The kernels cannot run
        # here; the launches record what the accumulator holds when each would start.)
        seen: list[tuple[str, float]] = []
        for name in ("pre", "main", "finish"):
            setattr(launch, name, lambda *a, name=name, seen=seen, acc=acc: seen.append(
                (name, float(acc.abs().sum()))))
        for _ in range(2):
            acc.fill_(3.0)  # what a previous call's reduce-adds left
            launch.run(do, q, k, v, o, bufs)
        assert seen == [("pre", 0.0), ("main", 0.0), ("finish", 0.0)] * 2


def test_dq_store_first_is_a_fixed_order_frag_knob(on_hopper: None) -> None:
    """``hopper_dq_store_first``: the fixed order's first turn stores its dQ into the
    register-order accumulator, which run() then leaves unzeroed (only the tiles no key
    tile visits are zeroed). Configs written before it read as 0; it needs
    ``hopper_dq_frag=1`` and a call that runs the fixed order, and says so."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch

    old = config_to_dict(HOP)
    del old["hopper_dq_store_first"]
    assert config_from_dict("bwd", old).hopper_dq_store_first == 0
    det = dataclasses.replace(P, deterministic=True)
    free = dataclasses.replace(P, deterministic=False)
    for form in (1, 2):
        first = dataclasses.replace(HOP, hopper_dq_frag=1, hopper_dq_store_first=form)
        assert config_from_dict("bwd", config_to_dict(first)) == first
        check_bwd(first, det)
        check_bwd(dataclasses.replace(first, hopper_dq_fixed=1), free)
        for c, p in ((dataclasses.replace(first, hopper_dq_frag=0), det), (first, free)):
            with pytest.raises(InfeasibleConfigError,
                               match=f"hopper_dq_store_first={form} .* needs hopper_dq_frag=1 "
                                     f"and a call that runs the fixed order"):
                check_bwd(c, p)
    with pytest.raises(ValueError, match="hopper_dq_store_first"):
        config_from_dict("bwd", {**config_to_dict(first), "hopper_dq_store_first": 3})
    first = dataclasses.replace(HOP, hopper_dq_frag=1, hopper_dq_store_first=1)
    b, h, sq, sk, d = 1, 2, 1000, 300, 128
    q, do, o = (torch.randn(b, h, sq, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.randn(b, h, sk, d, dtype=torch.bfloat16) for _ in range(2))
    plans = {}
    for name, cfg in (("first", first), ("frag", dataclasses.replace(first,
                                                                     hopper_dq_store_first=0)),
                      ("first2", dataclasses.replace(first, hopper_dq_store_first=2))):
        plans[name] = HopperBwdLaunch(do, q, k, v, o, sm_scale=0.125, mask=(0, 0, False, True),
                                      scales=(0.18, 0.0, 0.0), softcap=0.0, config=cfg,
                                      deterministic=True).zero_blocks
    # Causal, Sq - Sk = 700: rows 0-699 see no key; 64-row tiles 0-9 hold only such rows,
    # each tile two blocks of 64 columns.
    assert plans == {"first": [(0, 20)], "frag": None, "first2": [(0, 20)]}


def test_dq_rows_splits_the_fixed_orders_128_row_tiles_by_rows(on_hopper: None) -> None:
    """``hopper_dq_rows``: the fixed order's 128-row dQ tiles split between the two
    consumers by query rows. Configs written before it read as 0; it needs 128x128 tiles,
    ``hopper_dq_frag=1`` and a call that runs the fixed order, and says so. Its launch
    stages a consumer's 64 rows of every column (one 64-column chunk) as its half of the
    query tile's block, so the accumulator is the free order's (one block per query tile,
    cast by the same kernel), the writers' box half a block, and the staging ring as many
    bytes as the column split's."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch, _smem_plan, dq_chunk

    old = config_to_dict(HOP)
    del old["hopper_dq_rows"]
    assert config_from_dict("bwd", old).hopper_dq_rows == 0
    det = dataclasses.replace(P, head_dim=64, deterministic=True)
    free = dataclasses.replace(det, deterministic=False)
    rows = dataclasses.replace(HOP, hopper_block_m=128, hopper_dq_frag=1, hopper_dq_rows=1)
    check_bwd(rows, det)
    check_bwd(dataclasses.replace(rows, hopper_dq_store_first=2, hopper_split=2), det)
    check_bwd(dataclasses.replace(rows, hopper_dq_fixed=1), free)
    for c, p in ((dataclasses.replace(rows, hopper_block_m=64), det),
                 (dataclasses.replace(rows, hopper_block_n=64), det),
                 (dataclasses.replace(rows, hopper_dq_frag=0), det), (rows, free)):
        with pytest.raises(InfeasibleConfigError,
                           match="hopper_dq_rows=1 .* needs hopper_block_m=128, "
                                 "hopper_block_n=128, hopper_dq_frag=1 and a call that runs "
                                 "the fixed order"):
            check_bwd(c, p)
    cols = dataclasses.replace(rows, hopper_dq_rows=0)
    assert (dq_chunk(rows, 64, True), dq_chunk(cols, 64, True)) == (64, 32)
    assert _smem_plan(rows, 64, True) == _smem_plan(cols, 64, True)
    b, h, sq, sk, d = 1, 2, 1000, 700, 64
    q, do, o = (torch.randn(b, h, sq, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.randn(b, h, sk, d, dtype=torch.bfloat16) for _ in range(2))
    plan = {}
    for name, cfg, det_call in (("rows", rows, True), ("cols", cols, True),
                                ("free", cols, False)):
        launch = HopperBwdLaunch(do, q, k, v, o, sm_scale=0.125, mask=(0, 0, False, True),
                                 scales=(0.18, 0.0, 0.0), softcap=0.0, config=cfg,
                                 deterministic=det_call)
        plan[name] = (launch.acc_shape, launch.templates[4].block_shape,
                      launch.main.kwargs["DQ_LAYOUT"], launch.finish.kwargs["CHUNK"])
    n_m = -(-sq // 128)
    assert plan["rows"] == ((b * h, n_m, 32, 256), [1, 1, 16, 256], 3, 64)
    assert plan["free"] == ((b * h, n_m, 32, 256), [1, 1, 32, 256], 2, 64)
    assert plan["cols"] == ((b * h, 2 * n_m, 16, 256), [1, 1, 16, 256], 2, 32)
    # The search: no pick on it above head dim 64 (no 128-row tiles there); a prior point
    # and a move on an older winner for deterministic calls at head dim 64, not else.
    from flashtune.autotune.priors import prior_points, winner_points

    full = SearchSpace.full("bwd")
    assert full.for_problem(P).fields["hopper_dq_rows"] == (0,)
    assert full.for_problem(det).fields["hopper_dq_rows"] == (0, 1)
    won = config_to_dict(dataclasses.replace(cols, hopper_dq_store_first=2))
    assert {**won, "hopper_dq_rows": 1} in winner_points("bwd", won, det, "9.0")
    for p, seeded in ((det, True), (free, False), (dataclasses.replace(P, deterministic=True),
                                                   False)):
        points = prior_points("bwd", p, "9.0")
        assert any(pt.get("hopper_dq_rows") for pt in points) == seeded
        assert all(config.is_feasible(BwdConfig(**pt), p)[0] for pt in points)


@pytest.mark.parametrize("blocks", [(64, 128), (128, 128), (64, 64)])
def test_unvisited_query_tiles_see_no_key(blocks: tuple[int, int]) -> None:
    """The query tiles that ``hopper_dq_store_first`` zeroes because no key tile's walk
    reaches them: every row of such a tile sees no key under the visibility rule, the runs
    are sorted, disjoint and merged, and with Sq <= Sk + right (every row sees a key)
    there are none."""
    import random

    from flashtune.kernels.attn_bwd_hopper import unvisited_query_tiles

    rng = random.Random(11)
    m, n = blocks
    seen_some = False
    for _ in range(300):
        sq, sk = rng.randint(1, 1500), rng.randint(1, 1500)
        left = rng.choice([-1, rng.randint(0, 300)])
        right = rng.choice([-1, 0, rng.randint(0, 300)])
        mask_left, mask_right = left >= 0, right >= 0
        runs = unvisited_query_tiles(sq, sk, m, n, left, right, mask_left, mask_right)
        assert runs == sorted(runs) and all(a < z for a, z in runs)
        assert all(z1 < a2 for (_, z1), (a2, _) in zip(runs, runs[1:], strict=False))
        off = sk - sq
        for a, z in runs:
            for x in range(a * m, min(z * m, sq)):
                lo = max(x + off - left, 0) if mask_left else 0
                hi = min(x + off + right, sk - 1) if mask_right else sk - 1
                assert lo > hi, (sq, sk, left, right, x)
        if not mask_right or sq <= sk + right:
            assert runs == [] or mask_left, (sq, sk, left, right, runs)
        seen_some |= bool(runs)
    assert seen_some


def test_persist_is_an_unmasked_one_launch_knob(on_hopper: None) -> None:
    """``hopper_persist=1`` serves calls without a mask, in one launch: a causal or
    windowed call, or two halves, get the reason; G (the programs per key tile) holds
    whole heads on the SMs, at least one, at most the call's."""
    from flashtune.kernels.attn_bwd_hopper import persistent_heads

    pers = dataclasses.replace(HOP, hopper_persist=1)
    unmasked = dataclasses.replace(P, causal=False)
    check_bwd(pers, unmasked)
    check_bwd(pers, dataclasses.replace(unmasked, deterministic=True))
    for problem, words in ((P, "without a causal mask or window"),
                           (dataclasses.replace(unmasked, window=(64, 64)), "or window"),
                           (unmasked, "set one of them")):
        cfg = dataclasses.replace(pers, hopper_split=2) if problem is unmasked else pers
        with pytest.raises(InfeasibleConfigError, match=words):
            check_bwd(cfg, problem)
    assert persistent_heads(4, 512, 132) == 33
    assert persistent_heads(8, 256, 132) == 16
    assert persistent_heads(8, 3, 132) == 3
    assert persistent_heads(200, 16, 132) == 1


def test_kv_rep_splits_a_group_into_equal_parts(on_hopper: None) -> None:
    """``hopper_kv_rep=r`` runs r programs per key tile and KV head, each over 1/r of the
    group's query heads: any r that divides the group, masked or not, in either order;
    another r gets the reason and what fits; 1 fits every call. A search over a problem
    offers only the divisors of its group (an MHA call: 1 alone)."""
    for hq, hk in ((8, 2), (16, 2), (4, 2), (14, 2), (12, 2)):
        for r in (1, 2, 3, 4, 7, 8):
            for causal, det in ((True, True), (False, False)):
                p = dataclasses.replace(P, heads_q=hq, heads_kv=hk, causal=causal,
                                        deterministic=det)
                cfg = dataclasses.replace(HOP, hopper_kv_rep=r)
                if (hq // hk) % r:
                    with pytest.raises(InfeasibleConfigError,
                                       match=f"group of {hq // hk} query heads into {r}"):
                        check_bwd(cfg, p)
                else:
                    check_bwd(cfg, p)
    one = dataclasses.replace(P, heads_q=6, heads_kv=6)
    check_bwd(HOP, one)
    with pytest.raises(InfeasibleConfigError, match="a divisor of the group"):
        check_bwd(dataclasses.replace(HOP, hopper_kv_rep=2), one)
    full = SearchSpace.full("bwd")
    assert full.fields["hopper_kv_rep"] == tuple(range(1, 9))
    for hq, hk, want in ((32, 8, (1, 2, 4)), (28, 4, (1, 7)), (64, 8, (1, 2, 4, 8)),
                         (24, 4, (1, 2, 3, 6)), (16, 16, (1,)), (40, 8, (1, 5))):
        p = dataclasses.replace(P, heads_q=hq, heads_kv=hk)
        space = full.for_problem(p)
        assert space.fields["hopper_kv_rep"] == want, (hq, hk)
        assert all(n["hopper_kv_rep"] in want
                   for n in space.neighbours(config_to_dict(HOP), 1))
    narrowed = full.restrict(hopper_kv_rep=(2, 4))
    mha = dataclasses.replace(P, heads_q=16, heads_kv=16)
    assert narrowed.for_problem(mha).fields["hopper_kv_rep"] == (2, 4)  # as given
    assert narrowed.for_problem(
        dataclasses.replace(P, heads_q=16, heads_kv=8)).fields["hopper_kv_rep"] == (2,)
    # Configs written before the knob read as one program per KV head.
    old = config_to_dict(HOP)
    del old["hopper_kv_rep"]
    assert config_from_dict("bwd", old).hopper_kv_rep == 1

