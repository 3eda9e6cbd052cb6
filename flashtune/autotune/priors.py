"""Architecture priors: warm-start points that carry what long searches learned on an
architecture to a search that is too short to find it again.

A short search polishes the heuristic default one field at a time. Where the best configs
of an architecture sit several fields away from the default, consistently across shapes,
that search cannot reach them in its budget, while a search five times as long does. A
prior names those moves, relative to the default, so that they apply to any shape; the
tuner compiles the resulting points with the seeds, on the pool's otherwise idle workers,
and measures them like any other candidate (the gate included). A prior is a guess to
measure, never a result.

The backward prior for sm90 (H100, H200) comes from the 60 s searches of the budget check
on the H200 in session 10 (``benchmarks/data/budget_h200_s10.json``; BENCHMARKS.md, issue
17, "with the sm90 backward prior"): over 15 long searches of four shapes,
the winner moved the dQ kernel to 2 stages (14 of 15) and 64 keys per step (13 of 15),
ran both kernels as one launch (12 of 15), and grew the dK/dV tile's query rows at
head dim 128 (9 of 11) or shrank its key rows and the dQ tile's query rows at head dim 64
(4 of 4).

The register caps of the portable points at head dim 64 come from the shipped layer's
sweeps (session 45's count of ``flashtune/data/shipped.json``; BENCHMARKS.md, issue 17,
session 45): of its 17 portable backward winners at head dim 64 on the H100 and the H200,
10 of the 13 causal ones cap the registers at 168 and 3 of the 4 others at 255, and the
budget check's one problem there whose 12 s search missed its 60 s one by 5% (in sessions
18 and 45) missed exactly the cap. At head dim 128 the winners leave the cap to the
compiler (20 of 23), and no capped point is added.

The Hopper backward's deeper point (three Q/dO stages, 232 registers a consumer) comes
from the same check in session 45 (``benchmarks/data/budget_bwd_h200_s45.json``): of the
nine 60 s searches that ended on the Hopper backward, five took three stages and five took
232 registers (four both), while all eight 12 s searches that ended there kept the
default's two stages, two of them without trying three at all. As a prior (session 46,
``benchmarks/data/budget_against_bwd_h200_s46.json``: 12 s searches judged against the
stored 60 s winners in one re-timing) it is tried fifth or sixth; two short searches ended
on it or its polish (B4 H32/8 S4096 D128 causal, B32 H16 S512 D128, within 0.2% of the long
winners), and the check stayed at six of eight within 2%. At B1 H16 S16384 D128 causal its
trial read 2% slower than the default while the re-timing puts a three-stage config 3%
ahead: a ranking the trials and the re-timing disagree on, which no start point fixes.

At head dim 64 in the fixed dQ order, the deeper point stages dQ in column groups, and a
third Hopper point holds 128-row tiles, column groups and K and V in registers: the two
60 s winners of B2 H32 S8192 D64 causal, which a 12 s search missed by 7% in session 46
when it never tried 128 rows with column groups (BENCHMARKS.md, issue 17, session 46).
At head dim 128 from 8k keys, the deeper point and a third (the default with column
groups) stage dQ in column groups as well, as every shipped H200 winner there does
(session 47).

At head dim 128 the Hopper points open with the ring depths the shipped H200 winners hold
(session 61): three Q/dO stages unmasked, one under a causal mask without GQA, and for GQA
under a mask with virtual KV heads, one query head per program at one stage (groups under
8), then the virtual heads at three stages and 232 registers. 12 s searches from the
default, judged against the shipped configs (``benchmarks/tune_autotuner.py budget
--against-shipped``), had missed the first kind by 6-8% where a cold search measured only
the default and the first eight points; with them, 8 of 9 standard problems land within
2% (BENCHMARKS.md, issue 13, session 61).

A last point, for the Hopper backward at head dim 64, comes from its A/B runs on the H100
in session 25 (BENCHMARKS.md, issue 13, "a dQ writer warp"): with dQ in the fixed order,
128-row query tiles ran 1.22-1.40x its default 64-row ones and, at 16k keys, 1.13x the
shipped portable backward; the variant seeds only carry the default's tiles there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashtune.kernels.config import (
    BWD_HOPPER,
    BWD_ONE_LAUNCH,
    BWD_TWO_KERNEL,
    BwdConfig,
    InfeasibleConfigError,
    active_fields,
    config_fields,
    config_to_dict,
    default_bwd,
    is_feasible,
)
from flashtune.problem import Problem

Move = Callable[[dict[str, Any], Problem], dict[str, Any]]
# A prior point's move may instead return None: the point does not apply to the problem
# and is left out (see prior_points), wherever it sits in the order.
PointMove = Callable[[dict[str, Any], Problem], dict[str, Any] | None]


MIN_BLOCK = 16  # the smallest tile side the kernels take


def _grow(size: int, length: int) -> int:
    """``size`` doubled, unless the sequence (``length`` rows) is shorter than that."""
    return 2 * size if 2 * size <= max(MIN_BLOCK, length) else size


def _shrink(size: int) -> int:
    return max(MIN_BLOCK, size // 2)


def _dq_wide(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """The dQ kernel: twice the keys per inner step, two stages."""
    return {"dq_block_n": _grow(c["dq_block_n"], p.seqlen_k), "dq_stages": 2}


def _tiles(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """The dK/dV tile by head dim: more query rows at D > 64; at D <= 64 fewer key rows,
    and fewer query rows per dQ program."""
    if p.head_dim > 64:
        return {"dkdv_block_m": _grow(c["dkdv_block_m"], p.seqlen_q)}
    return {"dkdv_block_n": _shrink(c["dkdv_block_n"]), "dq_block_m": _shrink(c["dq_block_m"])}


def _cap(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """A register cap at head dim <= 64: 168 when causal, else 255 (the shipped winners);
    nothing at larger head dims."""
    if p.head_dim > 64:
        return {}
    return {"maxnreg": 168 if p.causal else 255}


def _hopper_rows(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """The Hopper backward: 128 query rows per step at head dim 64 (at 128 a consumer has
    no registers for them), with K and V read from shared memory as when the prior was
    measured (the default's registers for them ran 0.76-0.95x with 128-row tiles in the
    free dQ order; BENCHMARKS.md, issue 13, session 42)."""
    return {"hopper_block_m": 128, "hopper_kv_regs": 0} if p.head_dim <= 64 else {}


def _hopper_deep(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """The Hopper backward: a third Q/dO stage, consumers capped at 232 registers."""
    return {"hopper_stages": 3, "hopper_regs": 232}


# From this many keys the fixed dQ order's prior points at head dim 128 stage dQ in
# column groups too (see _hopper_groups).
GROUPS_LONG_KEYS = 8192


def _hopper_groups(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """The Hopper backward in the fixed dQ order: dQ staged in column groups of eight.
    At head dim 64 every 60 s winner with 128-row tiles in the session 45 budget check
    used it, and polishing cannot reach it from 64-row tiles in one move (it was slower at
    64 rows, 128 rows slower without it). At head dim 128 from 8k keys, all seven shipped
    H200 winners of the fixed order use it (two with three stages), and at 16k causal
    the 60 s winner is three stages, 232 registers and column groups, which two of three
    12 s searches never reached (session 47)."""
    if not p.deterministic or c.get("hopper_dq_frag"):
        return {}  # (dQ staged in register order, the default at head dim 128, supersedes it)
    return {"hopper_dq_groups": 1} if p.head_dim <= 64 or p.seqlen_k >= GROUPS_LONG_KEYS \
        else {}


def _hopper_frag(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """The Hopper backward with dQ staged in the order of the wgmma's registers (16-byte
    stores, no bank conflicts), the default at head dim 128. At head dim 64 with 128-row
    tiles it ran 1.06x the staging in rows in the fixed order and 1.30x in the free order
    (H200, 4x32x4096x64; BENCHMARKS.md, issue 13, session 48)."""
    return {"hopper_dq_frag": 1, "hopper_dq_groups": 0}


# Up to this many keys the store-first point branches on the dQ turn in the writer
# (hopper_dq_store_first=1); beyond, it issues both TMA ops instead (=2; see
# _hopper_store_first).
STORE_FIRST_BRANCH_MAX_KEYS = 1024


def _hopper_store_first(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """The fixed dQ order with its first turn stored, so the fp32 accumulator is not zeroed
    per call (``hopper_dq_store_first``): zeroing it costs the same at every length of the
    standard rows, about 35 us there. The writer's runtime branch on the turn (=1) costs
    the consumers registers (spills) on every tile; issuing both TMA ops, one of them out
    of bounds (=2), does not. With the shipped configs (H200, session 52) =1 ran
    32x16x512x128 and 16x16x1024x128 1.09x and 1.07x as fast as without the knob, =2 1.06x
    and 1.03x; from 2k keys =1 ran 0.78-0.97x, =2 1.00-1.04x. A ``deterministic=False``
    call takes it with the fixed order (``hopper_dq_fixed``)."""
    form = 1 if p.seqlen_k <= STORE_FIRST_BRANCH_MAX_KEYS else 2
    return {"hopper_dq_store_first": form, **({} if p.deterministic else {"hopper_dq_fixed": 1})}


def _hopper_split(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """The call in two concurrent halves (``hopper_split``), so that one half's
    preprocess and dQ cast (about 97 us together at every standard D=128 row, H200,
    session 53) overlap the other's main kernel. With the shipped configs (H200, session
    54, ``bwd_split_streams.py``) two halves on two streams ran the D=128 rows of 512 to
    4k keys 1.01-1.03x as fast as the whole call (causal 1k 1.03x), both orders; a
    problem of one sequence and one KV head has nothing to split."""
    return {"hopper_split": 2} if p.batch * p.heads_kv >= 2 else {}


# The longest keys at which hopper_persist ran at least as fast as the shipped configs
# (H200, session 55: 512 keys faster, 1k even or slower, 2k and 4k 3-5% slower; see
# _hopper_persist): the seed is a guess to measure, so 1k is still tried.
PERSIST_MAX_KEYS = 1024


def _hopper_persist(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """A persistent grid over heads (``hopper_persist``), which loads each next head's
    first Q and dO while the last head finishes, for unmasked calls of at most
    PERSIST_MAX_KEYS keys. Beside the shipped configs in one interleaved loop (H200,
    session 55, ``retime_knob.py``, the tuner's gate and timing) it ran 32x16x512x128
    1.019x as fast in the fixed order and 1.025x in the free one, 16x32x1024x64 free
    1.025x, 16x16x1024x128 1.002x and 0.979x; with the shipped configs otherwise unchanged
    (``bwd_shipped_variants.py``) 2k keys ran 0.95x: every program then spills more, and
    128 of 132 SMs hold whole heads. A second point adds dK and dV stored with TMA
    (:func:`_hopper_persist_tma`)."""
    if p.causal or tuple(p.window) != (-1, -1) or p.seqlen_k > PERSIST_MAX_KEYS:
        return {}
    return {"hopper_persist": 1, "hopper_split": 1}


def _hopper_persist_tma(c: dict[str, Any], p: Problem) -> dict[str, Any] | None:
    """:func:`_hopper_persist` with dK and dV stored through TMA, as the shipped 512-key
    D=128 winners (both orders) hold them: a 12 s search without this point missed B32 H16
    S512 D128's by 2.6% (H200, session 61). Left out (None) where the grid cannot
    persist."""
    persist = _hopper_persist(c, p)
    return {**persist, **_hopper_dkdv_tma(c, p)} if persist else None


def _hopper_dkdv_tma(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """dK and dV stored through shared memory with TMA (``hopper_dkdv_tma``) instead of
    from registers. Beside the shipped configs (H200, session 56,
    ``bwd_shipped_variants.py``) it ran the D=128 rows 1.00-1.12x as fast (512 keys 1.12x,
    2k 1.07x, 16k 1.00-1.02x) in both orders; at D=64 0.94-1.05x, so it is tried there
    too, not assumed. Re-timed beside their own configs (``retime_knob.py``, the tuner's
    gate and timing), 26 of the 30 standard D=128 entries took it at 1.005-1.129x; the GQA
    causal fixed order ran 0.97-0.99x (ptxas spills more in its loop with it)."""
    return {"hopper_dkdv_tma": 1}


def _hopper_kv_regs(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """K and V back in registers (the default at head dim 64) beside 128-row tiles, in the
    fixed dQ order only (in the free order that pair ran 0.76-0.95x; see _hopper_rows)."""
    return {"hopper_kv_regs": 1} if p.head_dim <= 64 and p.deterministic else {}


def _hopper_kv_regs_masked(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """K and V in registers (as :func:`_hopper_kv_regs`) for calls under a mask only, on
    the point with every later knob: 8x32x2048x64 causal, whose searches had kept a
    portable winner, ran 1.064x as fast with the 4x32x4096x64 causal winner's config
    (this point but for its store-first form) and took it (H200, session 60,
    ``retime_knob.py``, the tuner's gate and timing); unmasked, the same registers ran the
    8x32x2048x64 winner 0.91x."""
    return _hopper_kv_regs(c, p) if p.causal or tuple(p.window) != (-1, -1) else {}


def _hopper_dq_rows(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """The fixed dQ order's 128-row tiles split between the consumers by rows
    (``hopper_dq_rows``) at head dim <= 64 for deterministic calls: beside the shipped H200
    winners 1.010-1.046x on seven of the ten, 0.98-1.00x on the other three (BENCHMARKS.md,
    issue 13, session 63). A ``deterministic=False`` call at these head dims runs the free
    order, which has no split."""
    return {"hopper_dq_rows": 1} if p.head_dim <= 64 and p.deterministic else {}


def _hopper_dq_rows_point(c: dict[str, Any], p: Problem) -> dict[str, Any] | None:
    """:func:`_hopper_dq_rows` as the move of a prior point of its own: the point is left
    out (None) where the split does not apply. Where it applies it is the likeliest
    winner (eight of the eleven deterministic D=64 Hopper winners on the H200 hold it) and
    comes before the other D=64 points: last in the list, a 12 s search at B8 H32 S2048
    D64 ran out of time one trial before it (14 trials; 3.8% over the shipped config; H200,
    session 64)."""
    return _hopper_dq_rows(c, p) or None


def _hopper_unordered(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """For a ``deterministic=False`` call: the fixed order's dQ staging without its turns
    (``hopper_dq_unordered``), a masked call's heaviest key tiles launched first. Beside the
    shipped H200 free-call configs at D=128, as a module copy (session 67,
    ``bwd_free_order_ab.py``): causal 1.07x at 16k, 1.02x at 8k, 0.95-0.98x at 1k-2k (the
    accumulator zeroed whole, which the first turn's stores had spared); unmasked
    1.00-1.03x from 3k keys, but 0.97x at 4k. As the knob beside each free entry, five of
    the twenty took it (1.015-1.075x). A deterministic call keeps the turns."""
    if p.deterministic:
        return {}
    return {"hopper_dq_fixed": 1, "hopper_dq_unordered": 1, "hopper_dq_store_first": 0}


def _hopper_unordered_point(c: dict[str, Any], p: Problem) -> dict[str, Any] | None:
    """:func:`_hopper_unordered` as the move of a prior point of its own, left out (None)
    for a deterministic call."""
    return _hopper_unordered(c, p) or None


def _hopper_newest(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """dQ staged in register order, its first turn stored, dK and dV stored with TMA: the
    knobs of sessions 48, 52 and 56 in one move, for winners tuned before them. One at a
    time they can lose where together they win: on eight GQA causal H200 winners of 1k-8k
    keys searched before session 48 (H200, session 60), register order alone ran
    0.99-1.10x (six of them), the three together 0.97-1.13x, 1.02-1.13x on six (the 8k
    window 0.99x alone, 1.11x together)."""
    return {**_hopper_frag(c, p), **_hopper_store_first(c, p), **_hopper_dkdv_tma(c, p)}


def _hopper_stages_d128(c: dict[str, Any], p: Problem) -> dict[str, Any] | None:
    """The Q/dO ring's depth at head dim 128 by mask: three stages unmasked, one under a mask
    without GQA, as the shipped H200 winners hold them (session 61's count of
    ``flashtune/data/shipped.json``: 12 of the 14 unmasked MHA Hopper winners of 1k-16k keys
    took three stages, the two others 512 keys with a persistent grid; 12 of the 14 causal
    MHA ones one stage, both orders, and 13 after that session's retimes). A 12 s search
    from the default (two stages) missed B4 H16 S4096 D128's three-stage winner by 7.7%
    (session 61, 28 trials); the GQA masked winners are split between two and three stages,
    and head dim 64 keeps two (a window takes the causal depth by analogy: no H200 winner
    under a window without GQA at head dim 128 to count): there the point is left out
    (None). It is the first Hopper point, the likeliest winner where it applies: a cold 12 s
    search at B4 H16 S4096 D128 measured only the default and the eight points before it in
    the order of session 60 (session 61)."""
    if p.head_dim != 128:
        return None
    if p.causal or tuple(p.window) != (-1, -1):
        return {"hopper_stages": 1} if p.heads_q == p.heads_kv else None
    return {"hopper_stages": 3}


def _hopper_kv_rep(c: dict[str, Any], p: Problem) -> dict[str, Any]:
    """Virtual KV heads (``hopper_kv_rep``) for GQA calls under a mask, whose programs each
    walk a whole group: r of them per key tile share it. Measured with the shipped configs
    as a module copy (H200, session 58, ``bwd_gqa_virtual_kv_ab.py``): the heavier a
    group's walk (group size x keys), the more it paid: r = 4 1.13-1.30x at group x keys
    >= 32k (4 x 8k, 8 x 4k, 8 x 8k), r = 2 1.04-1.11x at 16k (4 x 4k, 8 x 2k) and 1.08x
    at 8 x 1k, both slower at 4 x 2k and 4 x 1k (0.89-0.98x) and in the free order at
    4 x 4k (0.99x); as the config field (session 59, ``retime_knob.py``) the same split:
    1.02-1.25x where this seeds it, 0.87-0.98x at 4 x 2k and 4 x 1k. A
    ``deterministic=False`` call takes it in the fixed order (``hopper_dq_fixed``): there
    4 x 4k ran 1.02x its free-order entry (session 59), in the free order 0.99x. An odd
    group has no such r: it takes r = the group (one query head per program), as groups of
    7 measured (session 59): 1.32x and 1.33x the portable winners at 7 x 8k and 7 x 4k,
    1.20x the one-program Hopper entry at 7 x 2k (groups of 5 follow by analogy,
    unmeasured); a group of 8 ran 0.93-0.95x with r = 8 against its r = 2 or 4.

    Since session 62 the partials are summed straight into dK and dV (no fp32 copy), which
    made virtual heads 1.01-1.02x cheaper at the GQA causal rows and moved the two
    smallest walks that had lost or tied (H200, ``retime_knob.py`` beside the entries): 7 x
    1k with r = 7 1.047-1.072x (1.00x before), 4 x 2k with r = 2 1.011-1.015x (0.98x
    before); so r = 2 is seeded from 8k for every even group and r = the group from 7k for
    odd ones. 4 x 1k still loses (r = 4 at one stage 0.90x, r = 2 0.87x)."""
    group = p.heads_q // p.heads_kv
    walk = group * p.seqlen_k
    if not (p.causal or tuple(p.window) != (-1, -1)) or group < 4:
        return {}
    fixed = {} if p.deterministic else {"hopper_dq_fixed": 1}
    if walk >= 32 * 1024 and group % 4 == 0:
        return {"hopper_kv_rep": 4, **fixed}
    if walk >= 8 * 1024 and group % 2 == 0:
        return {"hopper_kv_rep": 2, **fixed}
    if group % 2 and walk >= 7 * 1024 and group in _kv_rep_choices():
        return {"hopper_kv_rep": group, **fixed}
    return {}


def _hopper_kv_rep_deep(c: dict[str, Any], p: Problem) -> dict[str, Any] | None:
    """:func:`_hopper_kv_rep` one stage deeper with 232 registers a consumer
    (:func:`_hopper_deep`), as five of the ten shipped H200 deterministic GQA winners with
    virtual KV heads held it when the point was added (session 61's count; two of them then
    took :func:`_hopper_kv_rep_single`'s one stage, 1.01-1.02x faster): a 12 s search
    measured the virtual heads at two stages and missed B4 H32/8 S4096 D128 causal's winner
    by 5.1% (session 61). Left out (None) where no virtual heads are seeded."""
    rep = _hopper_kv_rep(c, p)
    return {**rep, **_hopper_deep(c, p)} if rep else None


def _hopper_kv_rep_single(c: dict[str, Any], p: Problem) -> dict[str, Any] | None:
    """One query head per program (r = the group) with one Q/dO stage and 240 registers,
    where :func:`_hopper_kv_rep` seeds virtual heads and the group is under 8: each
    program then walks what a causal MHA program walks, and takes that depth. Retimed
    beside their entries (H200, session 61, ``retime_knob.py``): 2x32/8x8192x128 causal
    1.064x (one stage, two halves, from r = 4 at two stages), 4x32/8x4096x128 causal
    1.024x (from r = 2 at three stages, 232 registers), 8x28/4x2048x128 causal 1.014x (r
    = 7 already), 2x28/4x8192 and 4x28/4x4096 1.004-1.006x; the same depth at r = 2 with
    groups of 8 ran 0.97-0.99x, and a group of 8 at r = 8 0.93-0.95x (session 59). Left
    out (None) elsewhere, and at head dim 64 (no GQA winner there to learn from)."""
    group = p.heads_q // p.heads_kv
    rep = _hopper_kv_rep(c, p)
    if not rep or group >= 8 or group not in _kv_rep_choices() or p.head_dim != 128:
        return None
    return {**rep, "hopper_kv_rep": group, "hopper_stages": 1, "hopper_regs": 240}


def _kv_rep_choices() -> tuple[int, ...]:
    """The values ``BwdConfig.hopper_kv_rep`` may take."""
    return config_fields(BwdConfig)["hopper_kv_rep"]


# Compute-capability major -> the backward's prior points, as (kernel variant, moves)
# applied in order to that variant's heuristic tiles; the most likely first.
BWD_PRIORS: dict[int, list[tuple[int, tuple[PointMove, ...]]]] = {
    9: [
        (BWD_ONE_LAUNCH, (_dq_wide, _tiles, _cap)),
        (BWD_ONE_LAUNCH, (_dq_wide, _tiles)),
        (BWD_TWO_KERNEL, (_dq_wide, _tiles, _cap)),
        (BWD_TWO_KERNEL, (_dq_wide, _tiles)),
        (BWD_ONE_LAUNCH, (_dq_wide,)),
        (BWD_TWO_KERNEL, (_dq_wide,)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_split,
                      _hopper_dkdv_tma, _hopper_stages_d128)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_split,
                      _hopper_dkdv_tma, _hopper_kv_rep_single)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_split,
                      _hopper_kv_rep_deep)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_split,
                      _hopper_dq_rows_point)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_split,
                      _hopper_dkdv_tma, _hopper_unordered_point)),
        (BWD_HOPPER, (_hopper_rows,)),
        (BWD_HOPPER, (_hopper_rows, _hopper_deep, _hopper_groups)),
        (BWD_HOPPER, (_hopper_rows, _hopper_groups, _hopper_kv_regs)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_split)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_split,
                      _hopper_dkdv_tma)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_split,
                      _hopper_dkdv_tma, _hopper_kv_regs_masked)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_persist)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_persist_tma)),
        (BWD_HOPPER, (_hopper_rows, _hopper_frag, _hopper_store_first, _hopper_split,
                      _hopper_kv_rep)),
    ],
}


# Compute-capability major -> moves tried on a key's stale or shipped winner (see
# winner_points): the architecture's newest knobs, which winners tuned before they landed
# never tried. A knob that lands later adds its move here.
WINNER_MOVES: dict[int, tuple[Move, ...]] = {
    9: (_hopper_store_first, _hopper_split, _hopper_dkdv_tma, _hopper_newest,
        _hopper_persist, _hopper_kv_rep, _hopper_dq_rows, _hopper_unordered)}


def _major(capability: str) -> int | None:
    head = str(capability).split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _feasible(point: dict[str, Any], problem: Problem) -> bool:
    return bool(is_feasible(BwdConfig(**point), problem)[0])


def prior_points(direction: str, problem: Problem, capability: str) -> list[dict[str, Any]]:
    """The architecture's prior points for ``problem`` (full config dicts), feasible ones
    only, in order; none for the forward (its short searches already land within 2% of
    the long ones), an architecture without a prior, or the CPU interpreter."""
    major = _major(capability)
    if direction != "bwd" or major is None:
        return []
    out: list[dict[str, Any]] = []
    for variant, moves in BWD_PRIORS.get(major, []):
        try:
            base = config_to_dict(default_bwd(problem, variant))
        except InfeasibleConfigError:
            continue  # the variant cannot serve this problem
        point, applies = dict(base), True
        for move in moves:
            step = move(point, problem)
            if step is None:  # the point does not apply to this problem
                applies = False
                break
            point.update(step)
        if not applies:
            continue
        # The knobs the variant does not use keep their defaults: one spelling per kernel.
        used, blank = set(active_fields(BwdConfig, variant)), config_to_dict(BwdConfig())
        point = {k: v if k in used else blank[k] for k, v in point.items()}
        # A dQ tile too large for its warps' registers gives up query rows (the long
        # searches' two-kernel winners at head dim 128 ran 64 of them).
        while not _feasible(point, problem) and point["dq_block_m"] > MIN_BLOCK:
            point["dq_block_m"] //= 2
        if _feasible(point, problem) and point != base and point not in out:
            out.append(point)
    return out


def winner_points(direction: str, winner: dict[str, Any], problem: Problem,
                  capability: str) -> list[dict[str, Any]]:
    """``winner`` (a key's stale or shipped winner, a full config dict) with each of the
    architecture's winner moves (:data:`WINNER_MOVES`) applied, feasible ones that differ
    from it only, in order. A knob that landed after the winner was tuned sits one move
    from it, but a short search seeded with the winner polishes it only if it has time
    for that field, and a prior point carries the knob with the default's tiles, not the
    winner's."""
    major = _major(capability)
    if direction != "bwd" or major is None:
        return []
    out: list[dict[str, Any]] = []
    for move in WINNER_MOVES.get(major, ()):
        point = {**winner, **move(winner, problem)}
        if point != winner and point not in out and _feasible(point, problem):
            out.append(point)
    return out
