"""The Hopper (Gluon) backward on an sm90 GPU, against the fp32 reference (2x rule).

Every case runs through the public ``flash_attention`` with the backward variant forced,
with ``deterministic`` both ways: False takes the free-order dQ reduce-adds, True the
fixed-order turns, which must also give bit-identical gradients from run to run. One
group (``_tuner_launch``) runs the launches the tuner times instead, against one fresh
``attn_bwd``. Each group runs in a child process under the watchdog (a hung barrier fails, it
does not hang).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from .test_attn_fwd_hopper import CASES

WATCHDOG_S = 600.0


def _hopper_bwd_configs(p: Any, rng: random.Random, n: int) -> list[Any]:
    """Random configs up to four stages, as the search proposes them: those whose launch
    can be planned (the search space asks the same; four stages of 64 x 128 tiles at
    D=128 in the fixed order once hung, BENCHMARKS.md session 31)."""
    from flashtune.exceptions import InfeasibleConfigError
    from flashtune.kernels.attn_bwd_hopper import check_launch_plan
    from flashtune.kernels.config import BWD_HOPPER, default_bwd

    from .helpers import distinct_configs

    def plannable(c: Any) -> bool:
        try:
            check_launch_plan(c, p.head_dim, p.deterministic)
        except InfeasibleConfigError:
            return False
        return True

    return distinct_configs(default_bwd(p, BWD_HOPPER), p, rng, n, BWD_HOPPER, max_stages=4,
                            accept=plannable)


def _grid(seed: int) -> list[str]:
    import torch

    from .helpers import case_problem, check_case

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    for case in CASES:
        for det in (False, True):
            p = dataclasses.replace(case_problem(case), deterministic=det)
            for cfg in _hopper_bwd_configs(p, rng, 2):
                try:
                    check_case(p, "cuda", bwd=cfg, layout=case[-1], gen=gen,
                               deterministic=det)
                except AssertionError as e:
                    failures.append(f"{case} det={det} {cfg}: {e}")
    return failures


def _random_configs(seed: int) -> list[str]:
    """24 random feasible Hopper backward configs, each on a random odd-shaped problem."""
    import torch

    from .helpers import check_case, random_problem

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    for _ in range(24):
        p = random_problem(rng, deterministic=rng.random() < 0.5)
        cfg = _hopper_bwd_configs(p, rng, 2)[-1]
        try:
            check_case(p, "cuda", bwd=cfg, gen=gen, deterministic=p.deterministic)
        except AssertionError as e:
            failures.append(str(e))
    return failures


def _bit_identical(seed: int) -> list[str]:
    import torch

    from flashtune.kernels.attention import flash_attention
    from flashtune.kernels.config import BWD_HOPPER, default_bwd, hopper_bwd_fixed_order
    from flashtune.problem import Problem

    from .helpers import make_qkv

    rng = random.Random(seed)
    failures = []
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (300, 40))):
        p = Problem(2, 8, 2, 1500, 1700, 128, "bf16", causal, window, deterministic=True)
        q, k, v, do = make_qkv(p, "cuda", gen=torch.Generator().manual_seed(seed))
        for cfg in _hopper_bwd_configs(p, rng, 3):
            grads = []
            for _ in range(3):
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                out = flash_attention(qg, kg, vg, causal=causal, window_size=window,
                                      config=cfg, deterministic=True)
                grads.append(torch.autograd.grad(out, (qg, kg, vg), do))
            if not all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0],
                                                                          strict=True)):
                failures.append(f"{p} {cfg}: repeated deterministic backwards differ")
        # A free-order call runs the fixed order where its config's fp32 dQ staging does not
        # fit beside three 64 x 128 Q/dO stages, and where the config pins it
        # (hopper_dq_fixed, as the dispatcher serves a deterministic entry to such a call):
        # its gradients must be the deterministic call's, bit for bit.
        three = dataclasses.replace(default_bwd(p, BWD_HOPPER), hopper_block_m=64,
                                    hopper_block_n=128, hopper_stages=3)
        two = dataclasses.replace(three, hopper_stages=2)
        for cfg, free_cfg in ((three, three), (two, dataclasses.replace(two, hopper_dq_fixed=1))):
            assert hopper_bwd_fixed_order(free_cfg, p.head_dim, False)
            pair = []
            for det, c in ((True, cfg), (False, free_cfg)):
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                out = flash_attention(qg, kg, vg, causal=causal, window_size=window,
                                      config=c, deterministic=det)
                pair.append(torch.autograd.grad(out, (qg, kg, vg), do))
            if not all(torch.equal(a, b) for a, b in zip(*pair, strict=True)):
                failures.append(f"{p} {free_cfg}: the free-order call that runs the fixed "
                                f"order differs from the deterministic call")
        # Column-group staging (hopper_dq_groups) and staging in register order
        # (hopper_dq_frag, the default here) move where dQ waits in shared memory and, at
        # D=128, add 64 columns per hand-off instead of 32; every element still takes the
        # same products and the same turns, so the gradients are the same bits.
        rows = dataclasses.replace(two, hopper_dq_frag=0, hopper_dq_groups=0)
        runs = []
        for c in (rows, dataclasses.replace(rows, hopper_dq_groups=1),
                  dataclasses.replace(rows, hopper_dq_frag=1)):
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out = flash_attention(qg, kg, vg, causal=causal, window_size=window, config=c,
                                  deterministic=True)
            runs.append(torch.autograd.grad(out, (qg, kg, vg), do))
        for knob, run in (("hopper_dq_groups", runs[1]), ("hopper_dq_frag", runs[2])):
            if not all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True)):
                failures.append(f"{p}: {knob}=1 changes the deterministic gradients")
    # The same at D=64, where one consumer (64 keys) stages its 64 columns as one chunk
    # and two consumers with 128-row query tiles stage 32 each (the shipped H200 shape).
    p = Problem(1, 4, 2, 700, 901, 64, "bf16", True, deterministic=True)
    q, k, v, do = make_qkv(p, "cuda", gen=torch.Generator().manual_seed(seed + 1))
    base = default_bwd(p, BWD_HOPPER)
    # And K and V as register operands (hopper_kv_regs, D=64) feed Sᵀ and dPᵀ the same
    # values as from shared memory: the same products, the same gradients, bit for bit.
    square, wide = {"hopper_block_m": 64, "hopper_block_n": 64}, {"hopper_block_m": 64,
                                                                   "hopper_block_n": 128}
    tall = {"hopper_block_m": 128, "hopper_block_n": 128}
    for knob, tile_sets in (("hopper_dq_groups", (square, tall)),
                            ("hopper_kv_regs", (square, wide, tall)),
                            ("hopper_dq_frag", (square, wide, tall))):
        for tiles in tile_sets:
            pair = []
            for value in (0, 1):
                c = dataclasses.replace(base, **tiles, **{knob: value})
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                out = flash_attention(qg, kg, vg, causal=True, config=c, deterministic=True)
                pair.append(torch.autograd.grad(out, (qg, kg, vg), do))
            if not all(torch.equal(a, b) for a, b in zip(*pair, strict=True)):
                failures.append(f"{p} {tiles}: {knob}=1 changes the gradients")
    return failures


def _bound_launches(seed: int) -> list[str]:
    """Later calls of one signature run the prepared backward (``HopperBwdLaunch``) through
    its bound kernels: three calls on fresh inputs each, every one against the reference,
    and the second and third must each take the bound path for all three of the
    backward's launches (the forward adds at most one bound launch per call)."""
    import torch

    from flashtune.kernels import _bound
    from flashtune.problem import Problem

    from .helpers import check_case

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    for p, layout in (
            (Problem(2, 8, 2, 1000, 1000, 128, "bf16", True, deterministic=True), "bhsd"),
            (Problem(1, 4, 4, 777, 901, 64, "bf16", False, deterministic=False), "bshd"),
            (Problem(3, 6, 3, 512, 512, 128, "fp16", False, (200, 40), deterministic=True),
             "bshd")):
        cfg = _hopper_bwd_configs(p, rng, 1)[-1]
        for call in range(3):
            before = _bound.counts["bound"]
            try:
                check_case(p, "cuda", bwd=cfg, layout=layout, gen=gen,
                           deterministic=p.deterministic)
            except AssertionError as e:
                failures.append(f"call {call}: {e}")
            bound = _bound.counts["bound"] - before
            if call and bound < 3:
                failures.append(f"{p} {cfg} call {call}: {bound} bound launches, not 3")
    return failures


def _tuner_launch(seed: int) -> list[str]:
    """What the tuner times is what a call computes: the backward's launches from
    ``bwd_steps``, with buffers made once (as ``measure.Bench`` times them), run three
    times give each time the gradients of one fresh ``attn_bwd`` with the same config: bit
    for bit in the fixed dQ order, within rounding in the free one. With dQ staged in
    register order every run must zero the fp32 accumulator itself (session 49: it was
    zeroed once, where it was allocated, so repeated runs added into the last one's sums
    and the tuner's timing left the zeroing out)."""
    import torch

    from flashtune.kernels.attn_bwd import attn_bwd, bwd_steps
    from flashtune.kernels.attn_fwd import attn_fwd
    from flashtune.kernels.config import BWD_HOPPER, default_bwd, default_fwd
    from flashtune.problem import Problem, default_scale

    from .helpers import make_qkv

    gen = torch.Generator().manual_seed(seed)
    failures = []
    for p in (Problem(2, 8, 2, 1000, 1100, 128, "bf16", True, deterministic=True),
              Problem(1, 8, 8, 777, 777, 128, "bf16", False, deterministic=False),
              Problem(2, 4, 4, 1030, 1030, 64, "fp16", True, deterministic=True)):
        q, k, v, do = make_qkv(p, "cuda", "bhsd", gen)
        kw = dict(causal=p.causal, sm_scale=default_scale(p.head_dim), window=p.window,
                  softcap=0.0)
        o, lse = attn_fwd(q, k, v, config=default_fwd(p), **kw)
        base = default_bwd(p, BWD_HOPPER)
        for frag in (1, 0):
            cfg = dataclasses.replace(base, hopper_dq_frag=frag, hopper_dq_groups=0)
            once = attn_bwd(do, q, k, v, o, lse, config=cfg, deterministic=p.deterministic,
                            **kw)
            grads, steps = bwd_steps(do, q, k, v, o, lse, config=cfg,
                                     deterministic=p.deterministic, **kw)
            for run in range(3):
                for _, launch in steps:
                    launch()
                torch.cuda.synchronize()
                failures += _mismatches(p, grads, once, f"{p} frag={frag} run {run}",
                                        "one call's")
    return failures


def _store_first(seed: int) -> list[str]:
    """``hopper_dq_store_first`` (both forms): the fixed order with dQ in register order
    stores each query tile's first dQ turn instead of adding it to a zeroed accumulator,
    and zeroes
    only the tiles no key tile visits (a causal diagonal or a window with Sq > Sk leaves
    whole tiles without keys). With the accumulator filled with NaN before the launch, the
    gradients must still be those of dQ staged in rows (zeroed by the preprocess, every
    turn added), bit for bit, run after run on the same buffers."""
    import torch

    from flashtune.kernels.attn_bwd import attn_bwd
    from flashtune.kernels.attn_bwd_hopper import HopperBwdLaunch, unvisited_query_tiles
    from flashtune.kernels.attn_fwd import attn_fwd, mask_params, score_scales
    from flashtune.kernels.config import BWD_HOPPER, default_bwd, default_fwd
    from flashtune.problem import Problem, default_scale, effective_window

    from .helpers import make_qkv

    gen = torch.Generator().manual_seed(seed)
    failures = []
    for p, tiles in ((Problem(2, 4, 2, 1000, 300, 128, "bf16", True, deterministic=True),
                      (64, 128)),
                     (Problem(1, 6, 3, 900, 200, 64, "fp16", False, (64, 16),
                              deterministic=True), (128, 128)),
                     (Problem(1, 4, 4, 777, 777, 128, "bf16", True, deterministic=True),
                      (64, 128)),
                     (Problem(2, 4, 1, 513, 700, 64, "bf16", False, deterministic=True),
                      (64, 64))):
        q, k, v, do = make_qkv(p, "cuda", "bhsd", gen)
        window = effective_window(p.window, p.seqlen_q, p.seqlen_k)
        scale = default_scale(p.head_dim)
        kw = dict(causal=p.causal, sm_scale=scale, window=window, softcap=0.0)
        o, lse = attn_fwd(q, k, v, config=default_fwd(p), **kw)
        base = dataclasses.replace(default_bwd(p, BWD_HOPPER), hopper_block_m=tiles[0],
                                   hopper_block_n=tiles[1], hopper_stages=2,
                                   hopper_dq_groups=0)
        rows = attn_bwd(do, q, k, v, o, lse, config=dataclasses.replace(base, hopper_dq_frag=0),
                        deterministic=True, **kw)
        mask = mask_params(p.causal, window)
        empty = unvisited_query_tiles(p.seqlen_q, p.seqlen_k, tiles[0], tiles[1], *mask)
        if (p.seqlen_q > p.seqlen_k) != bool(empty):
            failures.append(f"{p}: unvisited query tiles {empty}")
        for form in (1, 2):  # the writer branching on the turn, or issuing both ops
            launch = HopperBwdLaunch(do, q, k, v, o, sm_scale=scale, mask=mask,
                                     scales=score_scales(scale, 0.0), softcap=0.0,
                                     config=dataclasses.replace(base, hopper_dq_frag=1,
                                                                hopper_dq_store_first=form),
                                     deterministic=True)
            bufs = launch.buffers(q, k, v, lse)
            for run in range(2):
                bufs[5].fill_(float("nan"))
                launch.run(do, q, k, v, o, bufs)
                torch.cuda.synchronize()
                for name, a, b in zip("dq dk dv".split(), bufs[:3], rows, strict=True):
                    if not torch.equal(a, b):
                        err = (a.float() - b.float()).abs().max().item()
                        failures.append(f"{p} {tiles} store_first={form} run {run}: {name} "
                                        f"differs from dQ staged in rows (max abs "
                                        f"difference {err:.3g})")
    return failures


def _against_base(p, layout: str, gen, base, cand, label: str, base_label: str) -> list[str]:
    """``cand`` against the reference, then its gradients against ``base``'s on the same
    inputs: twice through ``flash_attention`` and once as the tuner times it
    (``bwd_steps``, buffers made once, launched twice), bit for bit in the fixed order,
    within rounding in the free one."""
    import torch

    from flashtune.kernels.attention import flash_attention
    from flashtune.kernels.attn_bwd import bwd_steps
    from flashtune.kernels.attn_fwd import attn_fwd
    from flashtune.kernels.config import default_fwd
    from flashtune.problem import default_scale

    from .helpers import check_case, make_qkv

    failures = []
    try:
        check_case(p, "cuda", bwd=cand, layout=layout, gen=gen, deterministic=p.deterministic)
    except AssertionError as e:
        failures.append(f"{p} {label}: {e}")
    q, k, v, do = make_qkv(p, "cuda", layout, gen)
    runs = []
    for cfg in (base, cand, cand):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_attention(qg, kg, vg, causal=p.causal, window_size=p.window,
                              config=cfg, deterministic=p.deterministic)
        runs.append(torch.autograd.grad(out, (qg, kg, vg), do))
    kw = dict(causal=p.causal, sm_scale=default_scale(p.head_dim), window=p.window,
              softcap=0.0)
    o, lse = attn_fwd(q, k, v, config=default_fwd(p), **kw)
    grads, steps = bwd_steps(do, q, k, v, o, lse, config=cand,
                             deterministic=p.deterministic, **kw)
    for _ in range(2):
        for _, launch in steps:
            launch()
    torch.cuda.synchronize()
    runs.append(grads)
    for i, run in ((1, label), (2, f"{label} again"), (3, f"{label}, as the tuner times it")):
        failures += _mismatches(p, runs[i], runs[0], f"{p} {layout} {run}", base_label)
    return failures


def _mismatches(p, got, want, where: str, what: str) -> list[str]:
    """(dq, dk, dv) ``got`` against ``want``: bit for bit where ``p`` is deterministic,
    else within rounding (2% of the largest value); a line per gradient that is not."""
    import torch

    failures = []
    for name, a, b in zip("dq dk dv".split(), got, want, strict=True):
        same = torch.equal(a, b) if p.deterministic else torch.allclose(
            a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())
        if not same:
            err = (a.float() - b.float()).abs().max().item()
            failures.append(f"{where}: {name} differs from {what} (max abs difference "
                            f"{err:.3g})")
    return failures


def _split(seed: int) -> list[str]:
    """``hopper_split=2``: the call as two halves, the second on a side stream - of the
    batch (three sequences: one and two), else of the KV heads (one sequence, GQA, odd
    numbers of KV heads, the flash-attn layout whose head slices are strided views). In
    the fixed order each half sums every dQ tile in the whole call's order, so the
    gradients are the whole call's bits, call after call (an unmasked 1k problem takes
    the cyclic order, whose key tiles wait for each other, with both halves' main kernels
    in flight); in the free order within rounding; every case against the reference too.
    And what the tuner times (``bwd_steps``, buffers made once) is the same."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import split_plan
    from flashtune.kernels.config import BWD_HOPPER, default_bwd
    from flashtune.problem import Problem

    gen = torch.Generator().manual_seed(seed)
    failures = []
    for p, layout in (
            (Problem(3, 4, 2, 1000, 1100, 128, "bf16", True, deterministic=True), "bhsd"),
            (Problem(2, 4, 4, 1024, 1024, 128, "bf16", False, deterministic=True), "bshd"),
            (Problem(1, 8, 4, 777, 901, 64, "fp16", False, deterministic=True), "bshd"),
            (Problem(1, 6, 3, 900, 900, 128, "bf16", False, (300, 40), deterministic=True),
             "bshd"),
            (Problem(2, 4, 4, 1030, 1030, 64, "bf16", True, deterministic=False), "bhsd")):
        whole = dataclasses.replace(default_bwd(p, BWD_HOPPER), hopper_split=1)
        split = dataclasses.replace(whole, hopper_split=2)
        if len(split_plan(p.batch, p.heads_q, p.heads_kv, 2)) != 2:
            failures.append(f"{p}: not split")
        failures += _against_base(p, layout, gen, whole, split, "split", "the whole call's")
    return failures


def _persist(seed: int) -> list[str]:
    """``hopper_persist=1`` (no mask): G programs per key tile, each walking heads g,
    g + G, ...; where the call has more heads than G, programs walk two or more, taking
    K and V over from the last head's consumers. Against the reference; in the fixed
    order the gradients are the one-program-per-head launch's bits, call after call and
    as the tuner times it (buffers made once), in the cyclic order (key tiles waiting for
    each other, 1k keys) and the ascending one (past half the SMs in key tiles, 8.5k); the
    free order within rounding. GQA, odd lengths, both layouts."""
    import torch

    from flashtune.kernels.attn_bwd_hopper import persistent_heads
    from flashtune.kernels.attn_fwd_hopper import _sm_count
    from flashtune.kernels.config import BWD_HOPPER, default_bwd
    from flashtune.problem import Problem

    gen = torch.Generator().manual_seed(seed)
    failures = []
    sms = _sm_count(torch.cuda.current_device())
    for p, layout in (
            (Problem(5, 4, 4, 1024, 1024, 128, "bf16", False, deterministic=True), "bshd"),
            (Problem(4, 16, 4, 1000, 1100, 64, "fp16", False, deterministic=True), "bhsd"),
            (Problem(1, 2, 2, 8500, 8500, 64, "bf16", False, deterministic=True), "bhsd"),
            (Problem(2, 4, 4, 4100, 4100, 64, "bf16", False, deterministic=False), "bshd")):
        one = dataclasses.replace(default_bwd(p, BWD_HOPPER), hopper_split=1)
        pers = dataclasses.replace(one, hopper_persist=1)
        n_n = -(-p.seqlen_k // one.hopper_block_n)
        heads = p.batch * p.heads_kv
        if persistent_heads(n_n, heads, sms) >= heads:
            failures.append(f"{p}: every program walks one head (G >= {heads})")
        failures += _against_base(p, layout, gen, one, pers, "persist",
                                  "one program per head's")
    return failures


def _dkdv_tma(seed: int) -> list[str]:
    """``hopper_dkdv_tma=1``: dK and dV staged in the consumers' K and V tiles and stored
    with TMA. Against the reference, and the same gradients as stored from registers (bit
    for bit in the fixed order, call after call and as the tuner times it): two consumers
    in the fixed order, which meet before dK overwrites the K tiles both read; one
    consumer; key counts off the 64-row box (rows past the end clipped); GQA; the
    flash-attn layout (strided gradients); a window; split in two by heads (views of the
    call's gradients); persistent programs walking several heads, whose next K and V wait
    for the stores; the free order."""
    import torch

    from flashtune.kernels.config import BWD_HOPPER, default_bwd
    from flashtune.problem import Problem

    gen = torch.Generator().manual_seed(seed)
    failures = []
    for p, layout, knobs in (
            (Problem(2, 4, 2, 1000, 1100, 128, "bf16", True, deterministic=True), "bhsd", {}),
            (Problem(1, 8, 4, 777, 901, 64, "fp16", False, deterministic=True), "bshd", {}),
            (Problem(2, 4, 4, 700, 1000, 128, "bf16", False, deterministic=True), "bhsd",
             {"hopper_block_n": 64}),
            (Problem(1, 6, 3, 900, 900, 128, "bf16", False, (300, 40), deterministic=True),
             "bshd", {"hopper_split": 2}),
            (Problem(5, 4, 4, 1024, 1024, 128, "bf16", False, deterministic=True), "bshd",
             {"hopper_persist": 1}),
            (Problem(2, 4, 4, 1030, 1030, 64, "bf16", True, deterministic=False), "bhsd", {}),
            (Problem(2, 4, 4, 4100, 4100, 64, "bf16", False, deterministic=False), "bshd",
             {"hopper_persist": 1})):
        base = dataclasses.replace(default_bwd(p, BWD_HOPPER), **{"hopper_split": 1, **knobs})
        cand = dataclasses.replace(base, hopper_dkdv_tma=1)
        failures += _against_base(p, layout, gen, base, cand, f"dkdv_tma {knobs}",
                                  "the register stores'")
    return failures


def _dq_rows(seed: int) -> list[str]:
    """``hopper_dq_rows=1``: the fixed order's 128-row dQ tiles split between the two
    consumers by rows (each its 64 query rows over both consumers' keys) instead of by
    columns. Against the reference, and the same gradients as the column split, bit for bit
    (the same products over the same keys in the same order, and the same turns), call
    after call and as the tuner times it: both dQ hand-offs (the deferred one and not),
    both store-first forms, odd lengths, Sq != Sk, GQA, fp16, a window, two halves,
    persistent programs with dK and dV stored by TMA, K and V in registers, and a
    ``deterministic=False`` call kept in the fixed order (there within rounding, as every
    free call is compared)."""
    import torch

    from flashtune.kernels.config import BWD_HOPPER, default_bwd
    from flashtune.problem import Problem

    gen = torch.Generator().manual_seed(seed)
    failures = []
    tiles = {"hopper_block_m": 128, "hopper_block_n": 128, "hopper_dq_frag": 1,
             "hopper_dq_groups": 0, "hopper_split": 1}
    for p, layout, knobs in (
            (Problem(2, 4, 2, 1000, 1100, 64, "bf16", True, deterministic=True), "bhsd", {}),
            (Problem(1, 8, 4, 777, 901, 64, "fp16", False, deterministic=True), "bshd",
             {"hopper_dq_store_first": 2}),
            (Problem(2, 4, 4, 700, 1000, 64, "bf16", False, (300, 40), deterministic=True),
             "bhsd", {"hopper_dq_store_first": 1, "hopper_split": 2}),
            (Problem(5, 4, 4, 1024, 1024, 64, "bf16", False, deterministic=True), "bshd",
             {"hopper_persist": 1, "hopper_dkdv_tma": 1, "hopper_stages": 1}),
            (Problem(1, 4, 4, 2000, 2000, 64, "bf16", True, deterministic=True), "bhsd",
             {"hopper_kv_regs": 1, "hopper_dkdv_tma": 1, "hopper_dq_store_first": 2}),
            (Problem(2, 4, 4, 1030, 1030, 64, "bf16", True, deterministic=False), "bhsd",
             {"hopper_dq_fixed": 1}),
            # Three stages leave no room for a second dS slot: the hand-off not deferred.
            (Problem(3, 4, 4, 900, 1200, 64, "bf16", False, deterministic=True), "bshd",
             {"hopper_stages": 3, "hopper_dq_store_first": 2})):
        base = dataclasses.replace(default_bwd(p, BWD_HOPPER), **{**tiles, **knobs})
        cand = dataclasses.replace(base, hopper_dq_rows=1)
        failures += _against_base(p, layout, gen, base, cand, f"dq_rows {knobs}",
                                  "the column split's")
    return failures


def _dq_unordered(seed: int) -> list[str]:
    """``hopper_dq_unordered=1``: a ``deterministic=False`` call in the fixed order's dQ
    staging that adds each chunk without waiting for its turn, masked calls launching
    their heaviest key tiles first. Against the reference, and within rounding of the same
    config with the turns, call after call and as the tuner times it: dQ staged in rows,
    column groups and register order, the 128-row split by rows, odd lengths, Sq != Sk,
    fp16, a window, a GQA causal call in two halves with virtual KV heads and dK and dV
    stored by TMA, persistent programs, and three stages (the free staging does not fit,
    so the call is in the fixed staging without hopper_dq_fixed)."""
    import torch

    from flashtune.kernels.config import BWD_HOPPER, default_bwd
    from flashtune.problem import Problem

    gen = torch.Generator().manual_seed(seed)
    failures = []
    for p, layout, knobs in (
            (Problem(2, 4, 4, 1000, 1100, 128, "bf16", True, deterministic=False), "bhsd",
             {"hopper_dq_frag": 1}),
            (Problem(1, 8, 2, 777, 901, 128, "fp16", False, deterministic=False), "bshd",
             {"hopper_dq_frag": 0, "hopper_dq_groups": 1}),
            (Problem(2, 4, 4, 700, 1000, 128, "bf16", False, (300, 40), deterministic=False),
             "bhsd", {"hopper_dq_frag": 0, "hopper_dq_groups": 0}),
            (Problem(2, 8, 2, 1030, 1030, 128, "bf16", True, deterministic=False), "bhsd",
             {"hopper_dq_frag": 1, "hopper_split": 2, "hopper_dkdv_tma": 1,
              "hopper_kv_rep": 2}),
            (Problem(5, 4, 4, 1024, 1024, 128, "bf16", False, deterministic=False), "bshd",
             {"hopper_dq_frag": 1, "hopper_persist": 1, "hopper_dkdv_tma": 1}),
            (Problem(1, 4, 4, 1500, 1300, 128, "bf16", True, deterministic=False), "bhsd",
             {"hopper_dq_frag": 1, "hopper_stages": 3, "hopper_dq_fixed": 0}),
            (Problem(2, 4, 4, 1000, 1000, 64, "bf16", True, deterministic=False), "bhsd",
             {"hopper_block_m": 128, "hopper_dq_frag": 1, "hopper_dq_rows": 1,
              "hopper_split": 2})):
        base = dataclasses.replace(default_bwd(p, BWD_HOPPER),
                                   **{"hopper_dq_fixed": 1, "hopper_dq_store_first": 0,
                                      "hopper_kv_regs": 0, **knobs})
        cand = dataclasses.replace(base, hopper_dq_unordered=1)
        failures += _against_base(p, layout, gen, base, cand, f"dq_unordered {knobs}",
                                  "the turns'")
    return failures


def _kv_rep(seed: int) -> list[str]:
    """``hopper_kv_rep`` (virtual KV heads): r programs per key tile and KV head, each over
    1/r of the group's query heads, dK and dV summed from per-program partials after the
    kernel. Against the reference; in the fixed order the same bits call after call and as
    the tuner times it (dQ's order is the one-program order's, dK's and dV's their own);
    in the free order within rounding of r = 1. Causal with Sq != Sk, groups of 2, 4, 6, 7
    and 8, r up to the whole group (3 of 6, 7 of 7, 8 of 8), a window in two halves, the
    unmasked persistent grid, dK and dV through TMA, fp16 at D=64, and more programs than
    one wave."""
    import torch

    from flashtune.kernels.config import BWD_HOPPER, default_bwd
    from flashtune.problem import Problem

    gen = torch.Generator().manual_seed(seed)
    failures = []
    for p, layout, knobs in (
            (Problem(2, 8, 2, 1024, 1024, 128, "bf16", True, deterministic=True), "bhsd",
             {"hopper_kv_rep": 2}),
            (Problem(2, 8, 2, 1024, 1024, 128, "bf16", True, deterministic=True), "bhsd",
             {"hopper_kv_rep": 4}),
            (Problem(1, 4, 2, 1000, 1100, 128, "bf16", True, deterministic=True), "bshd",
             {"hopper_kv_rep": 2}),
            (Problem(1, 16, 2, 700, 700, 128, "bf16", False, (200, 30), deterministic=True),
             "bshd", {"hopper_kv_rep": 4, "hopper_split": 2}),
            (Problem(4, 8, 2, 1024, 1024, 128, "bf16", False, deterministic=True), "bhsd",
             {"hopper_kv_rep": 2, "hopper_persist": 1}),
            (Problem(2, 8, 2, 1024, 1024, 128, "bf16", True, deterministic=True), "bhsd",
             {"hopper_kv_rep": 2, "hopper_dkdv_tma": 1}),
            (Problem(2, 8, 2, 900, 900, 64, "fp16", True, deterministic=True), "bhsd",
             {"hopper_kv_rep": 4}),
            (Problem(4, 32, 8, 4100, 4100, 128, "bf16", True, deterministic=True), "bhsd",
             {"hopper_kv_rep": 2}),
            (Problem(2, 8, 2, 1030, 1030, 64, "bf16", True, deterministic=False), "bhsd",
             {"hopper_kv_rep": 2}),
            (Problem(1, 14, 2, 1000, 1000, 128, "bf16", True, deterministic=True), "bshd",
             {"hopper_kv_rep": 7}),
            (Problem(2, 12, 2, 700, 900, 128, "bf16", True, deterministic=True), "bhsd",
             {"hopper_kv_rep": 3}),
            (Problem(1, 16, 2, 1100, 1100, 128, "bf16", False, (300, 0),
                     deterministic=True), "bhsd", {"hopper_kv_rep": 8})):
        rest = {k: v for k, v in knobs.items() if k != "hopper_kv_rep"}
        base = dataclasses.replace(default_bwd(p, BWD_HOPPER), **{"hopper_split": 1, **rest})
        cand = dataclasses.replace(base, hopper_kv_rep=knobs["hopper_kv_rep"])
        # The fixed order's dK and dV are summed in another order: its bits are its own,
        # compared with themselves; the free order with one program per KV head.
        failures += _against_base(p, layout, gen, cand if p.deterministic else base, cand,
                                  f"kv_rep {knobs}", "its own first call's" if p.deterministic
                                  else "one program per KV head's")
    return failures


def _defaults(seed: int) -> list[str]:
    """What a call with no tuned entry is served from 1k queries and keys (session 42's
    default rule): the Hopper backward's default config, K and V in registers at D=64,
    in either order, against the reference; twice in the fixed order, bit for bit."""
    import torch

    from flashtune.kernels.attention import flash_attention
    from flashtune.kernels.config import BWD_HOPPER, default_bwd
    from flashtune.problem import Problem

    from .helpers import check_case, make_qkv

    gen = torch.Generator().manual_seed(seed)
    failures = []
    for p, layout in (
            (Problem(2, 8, 8, 1024, 1024, 64, "bf16", True, deterministic=True), "bhsd"),
            (Problem(1, 8, 2, 1031, 1500, 64, "fp16", False, deterministic=True), "bshd"),
            (Problem(1, 6, 6, 1100, 1100, 128, "bf16", True, deterministic=True), "bhsd"),
            (Problem(2, 8, 4, 1300, 1029, 128, "bf16", False, (400, 70), 0.0,
                     deterministic=True), "bshd"),
            (Problem(1, 4, 4, 2000, 2000, 64, "bf16", True, deterministic=False), "bhsd"),
            (Problem(1, 4, 2, 300, 8200, 128, "bf16", False, deterministic=False), "bhsd")):
        cfg = default_bwd(p)
        if cfg.variant != BWD_HOPPER or cfg.hopper_kv_regs != (p.head_dim == 64):
            failures.append(f"{p}: the default is {cfg}, not the Hopper backward's")
            continue
        try:
            check_case(p, "cuda", layout=layout, gen=gen, deterministic=p.deterministic)
        except AssertionError as e:
            failures.append(str(e))
        if p.deterministic:
            q, k, v, do = make_qkv(p, "cuda", layout, gen)
            grads = []
            for _ in range(2):
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                out = flash_attention(qg, kg, vg, causal=p.causal, window_size=p.window,
                                      config=cfg, deterministic=True)
                grads.append(torch.autograd.grad(out, (qg, kg, vg), do))
            if not all(torch.equal(a, b) for a, b in zip(*grads, strict=True)):
                failures.append(f"{p}: repeated default backwards differ")
    return failures


@pytest.fixture
def needs_hopper() -> None:
    from flashtune.kernels.config import hopper_support

    reason = hopper_support()
    if reason:
        pytest.skip(f"Hopper kernels cannot run here: {reason}")


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["_grid", "_random_configs", "_bit_identical",
                                   "_bound_launches", "_defaults", "_tuner_launch",
                                   "_store_first", "_split", "_persist", "_dkdv_tma",
                                   "_kv_rep", "_dq_rows", "_dq_unordered"])
def test_hopper_backward(group: str, seed: int, needs_hopper: None) -> None:
    from .helpers import run_watched

    failures = run_watched(__name__, group, seed, WATCHDOG_S)
    assert not failures, "\n".join(failures)
