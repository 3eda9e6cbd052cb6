"""The Hopper (Gluon) forward on an sm90 GPU, against the fp32 reference (2x rule).

Every case runs through the public ``flash_attention`` with the variant forced, backward
included (the portable backward consumes the Hopper forward's O and LSE). Each group runs
in a child process under a watchdog: a barrier mistake hangs the GPU, and the watchdog
turns that into a failed test instead of a hung run.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

WATCHDOG_S = 600.0

# (B, Hq, Hkv, Sq, Sk, D, dtype, causal, window, softcap, layout)
CASES = [
    (2, 4, 4, 256, 256, 128, "bf16", False, (-1, -1), 0.0, "bhsd"),
    (2, 4, 4, 1000, 1000, 128, "bf16", True, (-1, -1), 0.0, "bhsd"),
    (1, 8, 2, 97, 1025, 128, "fp16", True, (-1, -1), 0.0, "bshd"),     # Sq < Sk, GQA 4:1
    (1, 4, 1, 1025, 97, 64, "bf16", True, (-1, -1), 0.0, "bhsd"),      # MQA, empty rows
    (2, 6, 3, 300, 333, 64, "fp16", False, (-1, -1), 0.0, "bshd"),
    (1, 2, 2, 333, 517, 128, "bf16", False, (100, 20), 0.0, "bhsd"),   # window
    (1, 2, 2, 700, 700, 64, "bf16", True, (50, -1), 0.0, "bshd"),      # causal + window
    (1, 4, 2, 250, 250, 128, "bf16", True, (-1, -1), 30.0, "bhsd"),    # softcap
    (1, 4, 2, 250, 250, 64, "bf16", False, (-1, -1), 1e5, "bhsd"),     # softcap, tanh near 0
    (2, 4, 2, 1, 77, 128, "fp16", False, (-1, -1), 5.0, "bhsd"),       # one query row
    (2, 4, 2, 77, 1, 64, "bf16", True, (-1, -1), 0.0, "bhsd"),         # one key
    (1, 2, 2, 64, 300, 128, "bf16", False, (0, 0), 0.0, "bhsd"),       # diagonal only
    (1, 2, 1, 200, 200, 128, "bf16", True, (-1, -1), 0.0, "dpad"),     # TMA-unaligned: falls back
    (1, 16, 16, 4096, 4096, 128, "bf16", True, (-1, -1), 0.0, "bhsd"),
    # causal D=64 past 2048 (the three-consumer default), ~5 tiles per persistent program
    (2, 16, 4, 2500, 2500, 64, "bf16", True, (-1, -1), 0.0, "bhsd"),
    # unmasked D=64 past 2048 (the three-consumer persistent default with defer_o), Sq != Sk
    (2, 16, 4, 2500, 2311, 64, "bf16", False, (-1, -1), 0.0, "bshd"),
]


def _hopper_configs(p: Any, rng: random.Random, n: int) -> list[Any]:
    """``n`` distinct feasible Hopper configs for ``p``. With ``n > 1``, at least one runs
    a persistent grid (programs walk several tiles: the double-buffered Q); where three
    consumers can run (D=64), the last of them has three (``block_m=192``, either
    ``block_n``), so every D=64 case covers them."""
    import dataclasses

    from flashtune.kernels.config import HOPPER, default_fwd, is_feasible

    from .helpers import distinct_configs

    out = distinct_configs(default_fwd(p), p, rng, n, HOPPER, max_stages=4)
    if n > 1 and not any(c.persistent for c in out[:-1]):
        grids = [dataclasses.replace(c, persistent=1)
                 for c in distinct_configs(None, p, rng, 8, HOPPER, max_stages=4)]
        grids = [c for c in grids if is_feasible(c, p)[0] and c not in out]
        assert grids, f"no feasible persistent config for {p}"
        out[0 if len(out) < 3 else 1] = rng.choice(grids)
    if n > 1 and p.head_dim == 64 and all(c.block_m != 192 for c in out):
        three = [dataclasses.replace(c, block_m=192, pingpong=0, consumer_regs=regs,
                                     block_n=bn)
                 for c in distinct_configs(None, p, rng, 8, HOPPER, max_stages=4)
                 for regs in (152, 160) for bn in (64, 128)]
        three = [c for c in three if is_feasible(c, p)[0] and c not in out]
        assert three, f"no feasible three-consumer config for {p}"
        out[-1] = rng.choice(three)
    return out


def _grid(seed: int) -> list[str]:
    import torch

    from .helpers import case_problem, check_case

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    for case in CASES:
        p = case_problem(case)
        for cfg in _hopper_configs(p, rng, 3):
            try:
                check_case(p, "cuda", fwd=cfg, layout=case[-1], backward=p.seqlen_q < 4096,
                           gen=gen)
            except AssertionError as e:
                failures.append(f"{case} {cfg}: {e}")
    return failures


def _random_configs(seed: int) -> list[str]:
    """30 random feasible Hopper configs, each on a random odd-shaped problem."""
    import torch

    from .helpers import check_case, random_problem

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    for _ in range(30):
        p = random_problem(rng)
        (cfg,) = _hopper_configs(p, rng, 1)[-1:]
        try:
            check_case(p, "cuda", fwd=cfg, backward=False, gen=gen)
        except AssertionError as e:
            failures.append(str(e))
    return failures


def _bit_identical(seed: int) -> list[str]:
    import torch

    from flashtune.kernels.attention import flash_attention
    from flashtune.problem import Problem

    from .helpers import make_qkv

    rng = random.Random(seed)
    failures = []
    for causal in (False, True):
        p = Problem(2, 8, 2, 1500, 1500, 128, "bf16", causal)
        q, k, v, _ = make_qkv(p, "cuda", gen=torch.Generator().manual_seed(seed))
        for cfg in _hopper_configs(p, rng, 4):
            o1, l1 = flash_attention(q, k, v, causal=causal, return_lse=True, config=cfg)
            o2, l2 = flash_attention(q, k, v, causal=causal, return_lse=True, config=cfg)
            if not (torch.equal(o1, o2) and torch.equal(l1, l2)):
                failures.append(f"{p} {cfg}: repeated forwards differ")
    return failures


def _tile_end_knobs(seed: int) -> list[str]:
    """``defer_o=1`` changes only when a tile's O store is waited for, and
    ``tile_overlap=1`` only what runs beside a tile's end: each config's outputs equal the
    serial one's bit for bit, on persistent grids that walk many tiles, including tiles
    whose rows see no key (Sq > Sk, causal) and short rows. (``tile_overlap`` is refused
    outside tests, ``config.REFUSED_KNOBS`` says why: this child process lets it in.)"""
    import dataclasses
    import os

    import torch

    from flashtune.kernels.attention import flash_attention
    from flashtune.kernels.config import HOPPER, UNVERIFIED_ENV, is_feasible
    from flashtune.problem import Problem

    from .helpers import distinct_configs, make_qkv

    os.environ[UNVERIFIED_ENV] = "1"  # a spawned child: the test process is untouched
    rng = random.Random(seed)
    failures = []
    for p in (Problem(2, 8, 2, 1500, 1500, 128, "bf16", True),
              Problem(2, 8, 2, 1500, 1500, 64, "fp16", False),
              Problem(8, 16, 2, 1025, 97, 64, "bf16", True),
              Problem(32, 16, 16, 512, 512, 128, "bf16", True),
              Problem(2, 4, 4, 700, 700, 64, "bf16", True, (50, -1))):
        q, k, v, _ = make_qkv(p, "cuda", gen=torch.Generator().manual_seed(seed))
        for knob in ("defer_o", "tile_overlap"):
            picked: list[Any] = []
            for c in distinct_configs(None, p, rng, 16, HOPPER, max_stages=4):
                on = dataclasses.replace(c, **{"persistent": 1, "defer_o": 0,
                                               "tile_overlap": 0, knob: 1})
                if is_feasible(on, p)[0] and on not in picked:
                    picked.append(on)
            if not picked:
                failures.append(f"{p}: no feasible {knob} config drawn")
            for on in picked[:3]:
                off = dataclasses.replace(on, **{knob: 0})
                o1, l1 = flash_attention(q, k, v, causal=p.causal, window_size=p.window,
                                         return_lse=True, config=on)
                o0, l0 = flash_attention(q, k, v, causal=p.causal, window_size=p.window,
                                         return_lse=True, config=off)
                if not (torch.equal(o1, o0) and torch.equal(l1, l0)):
                    failures.append(f"{p} {on}: differs from {knob}=0")
    return failures


# Packed batches: (Hq, Hkv, D, causal, window, softcap, same lengths for q and k)
VARLEN_CASES = [
    (4, 4, 128, True, (-1, -1), 0.0, True),
    (8, 2, 128, True, (-1, -1), 0.0, False),     # GQA, Sq != Sk per sequence
    (4, 1, 64, False, (-1, -1), 0.0, False),     # MQA
    (4, 2, 128, False, (100, 20), 0.0, True),    # window
    (2, 2, 64, True, (50, -1), 0.0, True),       # causal + window
    (4, 2, 128, True, (-1, -1), 30.0, False),    # softcap
]


def _varlen(seed: int) -> list[str]:
    """Packed batches through the Hopper forward (sequences of length 0 and 1 among them),
    three configs each, the portable backward on its O and LSE; then bit-identical repeats."""
    import dataclasses

    import torch

    from flashtune.kernels.attn_fwd import Packed, attn_fwd
    from flashtune.kernels.config import HOPPER, default_fwd
    from flashtune.problem import Problem

    from .test_varlen import check_varlen, cu_seqlens, make_packed, random_lengths

    rng = random.Random(seed)
    failures = []
    for hq, hk, d, causal, win, cap, same in VARLEN_CASES:
        lens_q = random_lengths(rng, 7, 1, 700)
        lens_k = list(lens_q) if same else random_lengths(rng, 7, 1, 700)
        p = Problem(7, hq, hk, max(lens_q), max(lens_k), d, "bf16", causal, win, cap,
                    total_q=sum(lens_q), total_k=sum(lens_k))
        dense = dataclasses.replace(p, total_q=0, total_k=0)
        # A packed batch keeps the Hopper kernel where a dense one has it, though not every
        # knob: defer_o needs a dense batch, and three consumers were measured only dense.
        if default_fwd(dense).variant == HOPPER and default_fwd(p).variant != HOPPER:
            failures.append(f"{p}: the default forward of a packed batch is not the Hopper one")
        for cfg in _hopper_configs(p, rng, 3):
            try:
                check_varlen(lens_q, lens_k, hq, hk, d, "bf16", causal, win, cap, "cuda", seed,
                             fwd=cfg)
            except AssertionError as e:
                failures.append(f"varlen {p} {cfg}: {e}")
    lens = random_lengths(rng, 9, 1, 2000)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, _ = make_packed(lens, lens, 8, 2, 128, "bf16", "cuda", gen)
    packed = Packed(cu_seqlens(lens, "cuda"), cu_seqlens(lens, "cuda"), max(lens), max(lens))
    p = Problem(9, 8, 2, max(lens), max(lens), 128, "bf16", True, total_q=sum(lens),
                total_k=sum(lens))
    for cfg in _hopper_configs(p, rng, 3):
        kw = dict(causal=True, sm_scale=0.1, window=(-1, -1), softcap=0.0, config=cfg,
                  packed=packed)
        o1, l1 = attn_fwd(q, k, v, **kw)
        o2, l2 = attn_fwd(q, k, v, **kw)
        if not (torch.equal(o1, o2) and torch.equal(l1, l2)):
            failures.append(f"varlen {p} {cfg}: repeated forwards differ")
    return failures


def _watched(name: str, seed: int) -> list[str]:
    """Run ``name(seed)`` in a child process; fail the test if it hangs."""
    from .helpers import run_watched

    return run_watched(__name__, name, seed, WATCHDOG_S)


@pytest.fixture
def needs_hopper() -> None:
    from flashtune.kernels.config import hopper_support

    reason = hopper_support()
    if reason:
        pytest.skip(f"Hopper kernels cannot run here: {reason}")


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["_grid", "_random_configs", "_bit_identical",
                                   "_tile_end_knobs", "_varlen"])
def test_hopper_forward(group: str, seed: int, needs_hopper: None) -> None:
    failures = _watched(group, seed)
    assert not failures, "\n".join(failures)


def test_watchdog_fails_a_hung_child() -> None:
    """The watchdog itself: a child that never reports is killed and the test fails."""
    global WATCHDOG_S
    old, WATCHDOG_S = WATCHDOG_S, 3.0
    try:
        with pytest.raises(pytest.fail.Exception, match="watchdog"):
            _watched("_sleep_forever", 0)
    finally:
        WATCHDOG_S = old


def _sleep_forever(seed: int) -> list[str]:
    import time

    while True:
        time.sleep(1)
