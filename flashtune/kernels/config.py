"""Kernel configs: every performance knob of every kernel, as data.

A config is a frozen dataclass. Each field carries its allowed values in its
metadata (``choices``), so the tuner builds its search space from the dataclass
itself and the database validates imports against the same source: a knob added
here joins both automatically.

Each config type has a feasibility function (``check_fwd`` / ``check_bwd``) that
rejects an impossible config with a reason *before* anything is compiled, and a
heuristic default per problem (``default_fwd`` / ``default_bwd``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from flashtune._env import flag
from flashtune.exceptions import InfeasibleConfigError
from flashtune.kernels._triton_info import triton_version
from flashtune.problem import Problem

POW2_BLOCKS = (16, 32, 64, 128, 256)
# The forward's query rows per program: the portable kernel takes powers of two; the Hopper
# kernel runs one consumer warpgroup per 64 rows, so 192 is its three-consumer tile.
FWD_BLOCK_M = (16, 32, 64, 128, 192, 256)
WARPS = (1, 2, 4, 8, 16)
STAGES = (1, 2, 3, 4, 5, 6)
# 0 means "let the compiler choose". Otherwise a per-thread register cap (multiple of 8).
MAXNREG = (0, 128, 168, 200, 232, 255)

# (major, minor) of the Triton that builds the kernels: some compiler bugs are version-bound.
TRITON_VERSION: tuple[int, int] = triton_version()

# Shared memory per block the estimate must fit. Hopper allows 227 KiB per block; this is
# the default when the device cannot be asked (CPU interpreter).
DEFAULT_SMEM_BYTES = 227 * 1024
# Register file per thread before Triton spills: 255 is the hardware cap; leave headroom for
# addresses and softmax state.
_REG_BUDGET = 224
# Registers a thread needs beyond its tiles' fp32 values (addresses, softmax state, loop state).
_REG_OVERHEAD = 64
# The Hopper forward's margin with three consumer warpgroups (see _check_fwd_hopper).
_REG_OVERHEAD_THREE_CONSUMERS = 24


# Forward kernel families (FwdConfig.variant).
PORTABLE = 0  # FlashAttention-2 in plain Triton: any GPU, and the CPU interpreter
HOPPER = 1  # FA3-style Gluon kernel for sm90 (kernels/attn_fwd_hopper.py)
VARIANT_NAMES = {PORTABLE: "portable", HOPPER: "hopper"}

# Triton versions whose Gluon Hopper API the Hopper kernels were verified on (on a GPU,
# with the whole correctness grid). Gluon is experimental: its API moves between releases,
# so any other version keeps the variant infeasible until it is verified.
GLUON_VERIFIED_TRITON = ((3, 6),)


def knob(default: Any, choices: tuple[Any, ...], doc: str, part: str | None = None,
         variants: tuple[int, ...] | None = None) -> Any:
    """A config field: its allowed values, a doc line, for a config launched as several
    kernels the launch (``part``) it alone affects (None: it affects every launch), and the
    kernel variants that use it (None: every variant). A field that the chosen variant does
    not use must keep its default, so one kernel has one spelling."""
    return field(default=default, metadata={"choices": choices, "doc": doc, "part": part,
                                            "variants": variants})


_P, _H = (PORTABLE,), (HOPPER,)

# Backward kernel families (BwdConfig.variant).
BWD_TWO_KERNEL = 0  # dK/dV kernel + a dQ kernel that recomputes: 7 products, deterministic
BWD_ATOMIC = 1  # dQ added with atomics inside the dK/dV kernel: 5 products, no fixed order
BWD_ONE_LAUNCH = 2  # the programs of variant 0 in one grid, as FlexAttention: deterministic
BWD_HOPPER = 3  # FA3-style Gluon backward for sm90 (kernels/attn_bwd_hopper.py)
BWD_FUSED = 4  # variant 2 with delta computed in its programs: one launch in all
BWD_VARIANT_NAMES = {BWD_TWO_KERNEL: "portable", BWD_ATOMIC: "portable-atomic",
                     BWD_ONE_LAUNCH: "portable-one-launch", BWD_HOPPER: "hopper",
                     BWD_FUSED: "portable-fused"}
_BP = (BWD_TWO_KERNEL, BWD_ATOMIC, BWD_ONE_LAUNCH, BWD_FUSED)
# The portable variants that run the dK/dV and dQ programs in one grid.
BWD_ONE_GRID = (BWD_ONE_LAUNCH, BWD_FUSED)
_BH = (BWD_HOPPER,)


@dataclass(frozen=True)
class FwdConfig:
    """Forward kernel: Q tile of ``block_m`` rows, K/V streamed in tiles of ``block_n``.

    ``variant`` picks the kernel family and so which knobs exist: the portable kernel
    uses ``num_warps``, ``maxnreg`` and ``use_tma``; the Hopper kernel runs one consumer
    warpgroup per 64 query rows (``block_m`` 64, 128 or 192), a K/V ring ``num_stages`` deep,
    and uses ``consumer_regs``, ``persistent``, ``tile_order``, ``pingpong``, ``defer_o``
    and ``tile_overlap``.
    """

    block_m: int = knob(64, FWD_BLOCK_M, "query rows per program (192: Hopper only)")
    block_n: int = knob(64, POW2_BLOCKS, "keys per inner-loop step")
    num_warps: int = knob(4, WARPS, "warps per program", variants=_P)
    num_stages: int = knob(2, STAGES, "pipelining depth of the K/V loop (Hopper: ring buffers)")
    maxnreg: int = knob(0, MAXNREG, "register cap per thread (0 = compiler's choice)",
                        variants=_P)
    use_tma: int = knob(0, (0, 1), "load K/V through TMA tensor descriptors (Hopper+)",
                        variants=_P)
    variant: int = knob(PORTABLE, (PORTABLE, HOPPER),
                        "kernel family: 0 portable Triton FA2, 1 Hopper Gluon FA3 (sm90)")
    consumer_regs: int = knob(240, (152, 160, 216, 232, 240),
                              "registers per consumer thread", variants=_H)
    persistent: int = knob(0, (0, 1), "one program per SM looping over tiles", variants=_H)
    tile_order: int = knob(0, (0, 1, 2, 3), "tile order: 0 query blocks fastest; 1 same, "
                           "heaviest first; 2 heads fastest, heaviest first; 3 as 2 within "
                           "chunks of heads whose K/V fit in L2", variants=_H)
    pingpong: int = knob(0, (0, 1), "the two consumer warpgroups take turns on the tensor "
                         "cores", variants=_H)
    defer_o: int = knob(0, (0, 1), "a tile's O store is waited for behind the next tile's "
                        "first product (persistent, two Q buffers, dense batches)",
                        variants=_H)
    tile_overlap: int = knob(0, (0, 1), "a tile's last PV and its end run beside the next "
                             "tile's first QK^T (persistent, two Q buffers, dense batches)",
                             variants=_H)

    kind = "fwd"


@dataclass(frozen=True)
class BwdConfig:
    """Backward: the delta preprocess, then, by ``variant``:

    - 0 (two kernels): a dK/dV kernel (keys held, loop over queries) and a dQ kernel
      (queries held, loop over keys) that recomputes QK^T and dO.V^T: seven matrix
      products, deterministic.
    - 1 (atomic dQ): the dK/dV kernel also adds each dQ contribution to an fp32
      accumulator with atomics (a tensor-descriptor reduce-add with ``dkdv_atomic_tma``),
      then a small kernel scales and casts it: five products, no fixed dQ order, so only
      for ``deterministic=False``. ``dq_block_m`` / ``dq_warps`` size that last kernel.
    - 2 (one launch): the dK/dV and dQ programs of variant 0 in one grid, dK/dV programs
      first; ``dkdv_warps`` / ``dkdv_stages`` apply to the whole launch. Deterministic.
    - 3 (Hopper): the FA3-style Gluon backward for sm90 (``kernels/attn_bwd_hopper.py``):
      five products, dQ by TMA reduce-add; with ``deterministic=True`` the dQ adds of each
      query tile take turns in a fixed order. Its knobs are the ``hopper_*`` fields.
    - 4 (fused): variant 2 without the preprocess: each program computes the delta rows
      it reads from O and dO itself (a dK/dV program once per query tile it visits, so
      an O tile more per step). One launch in all, for calls whose time is the host's.
      Deterministic.
    """

    dkdv_block_m: int = knob(32, POW2_BLOCKS, "dK/dV: query rows per inner-loop step", "dkdv",
                             variants=_BP)
    dkdv_block_n: int = knob(64, POW2_BLOCKS, "dK/dV: keys held per program", "dkdv",
                             variants=_BP)
    dkdv_warps: int = knob(4, WARPS, "dK/dV: warps per program (one launch: every program)",
                           "dkdv", variants=_BP)
    dkdv_stages: int = knob(2, STAGES, "dK/dV: pipelining depth (one launch: every program)",
                            "dkdv", variants=_BP)
    dq_block_m: int = knob(64, POW2_BLOCKS, "dQ: query rows held per program (atomic dQ: "
                           "rows per program of the scale-and-cast kernel)", "dq", variants=_BP)
    dq_block_n: int = knob(32, POW2_BLOCKS, "dQ: keys per inner-loop step", "dq",
                           variants=(BWD_TWO_KERNEL, *BWD_ONE_GRID))
    dq_warps: int = knob(4, WARPS, "dQ: warps per program", "dq",
                         variants=(BWD_TWO_KERNEL, BWD_ATOMIC))
    dq_stages: int = knob(2, STAGES, "dQ: pipelining depth", "dq", variants=(BWD_TWO_KERNEL,))
    pre_block_m: int = knob(64, POW2_BLOCKS, "delta preprocess: rows per program", "pre",
                            variants=(BWD_TWO_KERNEL, BWD_ATOMIC, BWD_ONE_LAUNCH, BWD_HOPPER))
    maxnreg: int = knob(0, MAXNREG, "register cap per thread for every launch (0 = compiler)",
                        variants=_BP)
    variant: int = knob(BWD_TWO_KERNEL, tuple(BWD_VARIANT_NAMES),
                        "kernel family: 0 two portable kernels (7 products), 1 portable with "
                        "atomic dQ (5 products, not deterministic), 2 portable in one launch, "
                        "3 Hopper (Gluon, sm90), 4 as 2 with the delta preprocess fused in")
    dkdv_atomic_tma: int = knob(0, (0, 1), "dK/dV, atomic dQ: add dQ through a tensor "
                                "descriptor (TMA reduce-add on sm90) instead of pointer "
                                "atomics", "dkdv", variants=(BWD_ATOMIC,))
    hopper_block_m: int = knob(64, (64, 128), "Hopper: query rows per step (128: D <= 64)",
                               variants=_BH)
    hopper_block_n: int = knob(128, (64, 128), "Hopper: keys held per program (one consumer "
                               "warpgroup per 64)", variants=_BH)
    hopper_stages: int = knob(2, (1, 2, 3, 4), "Hopper: Q/dO ring buffers", variants=_BH)
    hopper_regs: int = knob(240, (216, 232, 240), "Hopper: registers per consumer thread",
                            variants=_BH)
    hopper_stagger: int = knob(1, (0, 1), "Hopper, no mask: each key tile starts its walk "
                               "over the queries at its own offset", variants=_BH)
    hopper_walk: int = knob(1, (0, 1), "Hopper, GQA: 1 walks the group's query heads in one "
                            "flat loop, 0 in a loop per head (ptxas spills differently)",
                            variants=_BH)
    hopper_dq_fixed: int = knob(0, (0, 1), "Hopper, deterministic=False calls only: 1 keeps "
                                "the fixed dQ order, 0 takes the free order where its "
                                "staging fits", variants=_BH)
    hopper_dq_groups: int = knob(0, (0, 1), "Hopper, fixed dQ order: 1 stages each dQ chunk "
                                 "in column groups of eight, up to 64 columns a chunk; 0 in "
                                 "rows of 32 columns", variants=_BH)
    hopper_kv_regs: int = knob(0, (0, 1), "Hopper, D=64: 1 holds each consumer's K and V "
                               "tiles in registers as the left operands of S^T and dP^T, "
                               "which then read only Q and dO from shared memory",
                               variants=_BH)
    hopper_dq_frag: int = knob(0, (0, 1), "Hopper: 1 stages dQ (and keeps its fp32 "
                               "accumulator) in the order of the wgmma's registers, with "
                               "16-byte stores free of bank conflicts; 0 in rows (or column "
                               "groups)", variants=_BH)
    hopper_dq_store_first: int = knob(0, (0, 1, 2), "Hopper, fixed dQ order with "
                                      "hopper_dq_frag=1: 1 or 2 store each query tile's first "
                                      "dQ turn instead of adding it, so the fp32 accumulator "
                                      "is not zeroed per call; the next turn then waits for "
                                      "the stores to complete. 1 branches on the turn in the "
                                      "dQ writer, which costs the consumers registers; 2 "
                                      "issues both TMA ops, the one not the turn's out of "
                                      "bounds, with no branch", variants=_BH)
    hopper_split: int = knob(1, (1, 2), "Hopper: 1 launches each kernel once for the whole "
                             "call; 2 runs it as two independent halves (of the batch, else "
                             "of the KV heads; one sequence of one KV head stays whole), the "
                             "second on a side stream, so that one half's bandwidth-bound "
                             "preprocess and dQ cast overlap the other's main kernel. The "
                             "gradients are bit-identical either way", variants=_BH)
    hopper_persist: int = knob(0, (0, 1), "Hopper, no mask, hopper_split=1: 1 launches "
                               "as many programs per key tile as the SMs hold whole heads, "
                               "each walking its heads in turn and loading the next head's "
                               "first Q and dO while it finishes the last (0: one program per "
                               "key tile and head)", variants=_BH)
    hopper_kv_rep: int = knob(1, (1, 2, 3, 4, 5, 6, 7, 8), "Hopper, GQA: r programs per "
                              "key tile and KV head (r divides the group), each loading its "
                              "K and V and walking 1/r of the group's query heads into a dK "
                              "and dV partial of its own, summed in a fixed order after the "
                              "kernel: r times shorter programs, a shorter tail of heavy "
                              "ones under a causal mask (1: one program walks the whole "
                              "group)", variants=_BH)
    hopper_dkdv_tma: int = knob(0, (0, 1), "Hopper: 1 stores dK and dV through shared memory "
                                "(the K and V tiles' buffers) with TMA, 0 from registers "
                                "(same values)", variants=_BH)
    hopper_dq_rows: int = knob(0, (0, 1), "Hopper, fixed dQ order with 128x128 tiles and "
                               "hopper_dq_frag=1: 1 splits each dQ tile between the two "
                               "consumers by query rows (each its 64 rows, every column, "
                               "over both consumers' keys), 0 by columns", variants=_BH)
    hopper_dq_unordered: int = knob(0, (0, 1), "Hopper, deterministic=False calls in the "
                                    "fixed order's dQ staging (hopper_dq_fixed=1, or a free "
                                    "staging that does not fit): 1 adds each dQ chunk as soon "
                                    "as it is staged, without the fixed order's turns, and "
                                    "launches a masked call's heaviest key tiles first; the "
                                    "fp32 accumulator is then zeroed whole per call (0: the "
                                    "turns)", variants=_BH)

    kind = "bwd"


CONFIG_TYPES: dict[str, type] = {"fwd": FwdConfig, "bwd": BwdConfig}


def config_fields(cls: type) -> dict[str, tuple[Any, ...]]:
    """``{field name: allowed values}`` for a config type: the search space, as data."""
    return {f.name: f.metadata["choices"] for f in dataclasses.fields(cls)}


def config_parts(cls: type) -> dict[str, str | None]:
    """``{field name: the launch it affects}`` (None: shared by every launch)."""
    return {f.name: f.metadata.get("part") for f in dataclasses.fields(cls)}


def active_fields(cls: type, variant: int | None = None) -> list[str]:
    """The fields a config of ``variant`` uses (every field when the type has no variants)."""
    out = []
    for f in dataclasses.fields(cls):
        used = f.metadata.get("variants")
        if variant is None or used is None or variant in used:
            out.append(f.name)
    return out


def variant_of(params: Any) -> int | None:
    """The ``variant`` of a config or a params mapping (None when it has none)."""
    if isinstance(params, dict):
        portable = "num_warps" in params or "dkdv_warps" in params
        return params.get("variant", PORTABLE if portable else None)
    return getattr(params, "variant", None)


def validate_config(cfg: FwdConfig | BwdConfig) -> None:
    """Raise ValueError naming the first field of ``cfg`` whose value is not one of its
    choices (the exact type too: ``64.0`` and ``True`` are not ``64`` and ``1``)."""
    for f in dataclasses.fields(cfg):
        val, choices = getattr(cfg, f.name), f.metadata["choices"]
        if not any(type(val) is type(c) and val == c for c in choices):
            raise ValueError(f"{type(cfg).__name__}.{f.name} = {val!r} is not one of {choices}")


def config_to_dict(cfg: FwdConfig | BwdConfig) -> dict[str, int]:
    return dataclasses.asdict(cfg)


def config_from_dict(direction: str, d: dict[str, Any]) -> FwdConfig | BwdConfig:
    """Build a config from a dict, rejecting unknown fields and values outside the choices."""
    if direction not in CONFIG_TYPES:
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    cls = CONFIG_TYPES[direction]
    allowed = config_fields(cls)
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {direction} config field(s) {unknown}; known: {sorted(allowed)}")
    for name, val in d.items():
        if isinstance(val, bool) or not isinstance(val, int) or val not in allowed[name]:
            raise ValueError(
                f"{direction} config field {name!r} = {val!r} is not one of {allowed[name]}")
    return cls(**d)  # type: ignore[no-any-return]


def padded_head_dim(d: int) -> int:
    """Triton tiles are powers of two; head dims such as 80 or 192 are padded and masked."""
    return 1 << (d - 1).bit_length()


# Shared-memory model, fitted to what Triton 3.6 allocated on an H200 for a 1,248-config
# grid (benchmarks/probe_resources.py, data in benchmarks/data/probe_h200.jsonl). It never
# under-predicts a config that ran out of shared memory there. Sizes in bytes, 2-byte
# elements: a tile held for the whole program is counted once, a streamed tile once per
# pipeline stage, and K/V (or Q/dO) come in pairs.
def smem_fwd(c: FwdConfig, d: int) -> int:
    return 2 * d * (c.block_m + 2 * c.block_n * c.num_stages)


def smem_dkdv(c: BwdConfig, d: int) -> int:
    # K, V held; Q, dO streamed; plus the fp32 LSE and delta slices per stage. Unpipelined
    # (1 stage), Triton still double-buffers the transposed operands: count 2. The fused
    # variant streams O as well (an extension of the fit, not part of the probed grid).
    stages = max(c.dkdv_stages, 2)
    streamed = 3 if c.variant == BWD_FUSED else 2
    return 2 * d * (2 * c.dkdv_block_n + streamed * c.dkdv_block_m * stages) \
        + 16 * c.dkdv_block_m * stages


def smem_dq(c: BwdConfig, d: int) -> int:
    # Q, dO held; K, V streamed.
    return 2 * d * (2 * c.dq_block_m + 2 * c.dq_block_n * c.dq_stages) + 8 * c.dq_block_m


def _regs(rows: int, cols: int, d: int, warps: int) -> float:
    # fp32 score tile + fp32 accumulator, spread across the program's threads.
    return (rows * cols + rows * d) / (32 * warps)


def _check_launch(where: str, block_m: int, warps: int) -> None:
    if warps > max(4, block_m // 8):
        raise InfeasibleConfigError(
            f"{where}: {warps} warps for a {block_m}-row tile leaves warps idle "
            f"(allowed up to {max(4, block_m // 8)})")


def _check_regs(where: str, regs: float, maxnreg: int, warps: int) -> None:
    if regs > _REG_BUDGET:
        raise InfeasibleConfigError(
            f"{where}: ~{regs:.0f} fp32 registers/thread for the tiles exceeds {_REG_BUDGET} "
            f"(it would spill heavily); use smaller blocks or more warps")
    if maxnreg:
        if maxnreg * 32 * warps > 65536:
            raise InfeasibleConfigError(
                f"{where}: maxnreg={maxnreg} x {warps} warps exceeds the 64K-register file")
        # ptxas refuses to build when the cap is below what the accumulators alone need.
        if maxnreg < regs + _REG_OVERHEAD:
            raise InfeasibleConfigError(
                f"{where}: maxnreg={maxnreg} is below the ~{regs + _REG_OVERHEAD:.0f} "
                f"registers/thread the tiles need")


def _check_smem(where: str, need: int, smem_bytes: int) -> None:
    if need > smem_bytes:
        raise InfeasibleConfigError(
            f"{where}: estimated shared memory {need} B exceeds the device's {smem_bytes} B")


def _check_unused_at_default(c: FwdConfig | BwdConfig) -> None:
    default = type(c)()
    names = VARIANT_NAMES if isinstance(c, FwdConfig) else BWD_VARIANT_NAMES
    for f in dataclasses.fields(c):
        used = f.metadata.get("variants")
        if used is not None and c.variant not in used \
                and getattr(c, f.name) != getattr(default, f.name):
            raise InfeasibleConfigError(
                f"{c.kind}: {f.name}={getattr(c, f.name)} has no meaning for the "
                f"{names[c.variant]} kernel; leave it at {getattr(default, f.name)}")


@functools.lru_cache(maxsize=1)
def hopper_support() -> str:
    """'' when the Hopper (Gluon) kernels can run here, else why not. Checked once."""
    from flashtune._env import interpreting

    if interpreting():
        return "the CPU interpreter cannot run Gluon kernels"
    version = triton_version()
    if version not in GLUON_VERIFIED_TRITON:
        return (f"Gluon kernels are verified only on Triton "
                f"{', '.join('.'.join(map(str, v)) for v in GLUON_VERIFIED_TRITON)}, "
                f"this is {'.'.join(map(str, version))}")
    try:
        import torch
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError as e:
        return f"this Triton has no Gluon Hopper API ({e})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        return f"the device is sm{cc[0]}{cc[1]}; the Hopper kernels need sm90"
    return ""


def _smem_fwd_hopper(c: FwdConfig, d: int, q_buffers: int) -> int:
    # The Q buffers (one 64-row slice per consumer each), a ring of K and V tiles, and the
    # mbarriers.
    return 2 * d * (q_buffers * c.block_m + 2 * c.num_stages * c.block_n) + 1024


def hopper_q_buffers(c: FwdConfig, d: int) -> int:
    """Q buffers in the Hopper forward: two in a persistent grid where they fit beside the
    K/V ring in sm90's shared memory, so the producer loads the next tile's Q, and then
    its first K/V tiles, while the consumers still work on this one; else one (a program
    of a plain grid runs a single tile)."""
    if c.persistent and _smem_fwd_hopper(c, d, 2) <= DEFAULT_SMEM_BYTES:
        return 2
    return 1


def smem_fwd_hopper(c: FwdConfig, d: int) -> int:
    return _smem_fwd_hopper(c, d, hopper_q_buffers(c, d))


def l2_chunk_heads(rows_k: int, d: int, elem: int, gqa: int, bh_total: int,
                   l2_bytes: int) -> int:
    """Query heads per chunk in the Hopper forward's tile order 3: as many consecutive ones
    as keep their K/V (``rows_k`` keys of ``d`` x ``elem`` bytes per K/V head, each shared
    by ``gqa`` query heads) within half of an L2 of ``l2_bytes``, the rest left to Q, O
    and other traffic; a whole number of K/V groups, at least one head, at most all."""
    per_kv_head = 2 * max(rows_k, 1) * d * elem
    return max(1, min(bh_total, l2_bytes // 2 // per_kv_head * gqa))


def hopper_producer_regs(consumers: int, consumer_regs: int) -> int:
    """Registers per thread that Triton leaves the producer warpgroup (the default
    partition) when each of ``consumers`` 128-thread warpgroups asks for
    ``consumer_regs``: the launch cap is 64K registers over all warps (in multiples of 8),
    and what the consumers take above it comes out of the producer's share. Below 24
    Triton skips the re-allocation altogether, silently, and every partition runs at the
    launch cap (Triton's AllocateWarpGroups pass, 3.6)."""
    warps = 4 * (1 + consumers)
    cap = 65536 // (warps * 32) // 8 * 8
    budget = cap * 128 + consumers * (cap - consumer_regs) * 128
    return budget // 128 // 8 * 8


# Knobs refused by default (so never searched, stored or dispatched), each with its reason:
# kernel code that has not passed its GPU checks (a barrier slip in it would hang the
# kernel), or that passed them and measured slower than without it. Their GPU tests and A/B
# scripts reach them by setting UNVERIFIED_ENV (named when the list held only knobs not yet
# run on a GPU). defer_o left this list in session 38 (bit-identical to the serial
# consumer on the standard matrix on the H200, and faster; BENCHMARKS.md, issue 12).
REFUSED_KNOBS = {
    "tile_overlap": "is correct (bit-identical to tile_overlap=0 on the H200 since session "
                    "39) but ran 0.97x as fast as without it on the standard matrix up to "
                    "S=2048 (BENCHMARKS.md, issue 12)",
}
UNVERIFIED_ENV = "FLASHTUNE_UNVERIFIED_KNOBS"


def _check_fwd_hopper(c: FwdConfig, p: Problem, smem_bytes: int) -> None:
    if p.head_dim not in (64, 128):
        raise InfeasibleConfigError(
            f"fwd hopper: head_dim {p.head_dim} is not supported (allowed: 64, 128)")
    if c.block_m not in (64, 128, 192):
        raise InfeasibleConfigError(
            f"fwd hopper: block_m={c.block_m} (one consumer warpgroup per 64 rows; "
            f"allowed: 64, 128, 192)")
    consumers = c.block_m // 64
    if consumers == 3 and p.head_dim > 64:
        raise InfeasibleConfigError(
            f"fwd hopper: block_m=192 (three consumers) needs head_dim 64, got {p.head_dim}: "
            f"three consumer warpgroups share the register file, and a {p.head_dim}-wide "
            f"accumulator does not fit their share")
    if c.block_n not in (64, 128):
        raise InfeasibleConfigError(f"fwd hopper: block_n={c.block_n} (allowed: 64, 128)")
    if not 2 <= c.num_stages <= 4:
        raise InfeasibleConfigError(
            f"fwd hopper: a K/V ring of {c.num_stages} buffers (allowed: 2 to 4)")
    if c.pingpong and consumers != 2:
        raise InfeasibleConfigError("fwd hopper: pingpong needs two consumers (block_m=128)")
    for knob_name in ("defer_o", "tile_overlap"):
        if not getattr(c, knob_name):
            continue
        # Each holds a tile's Q buffer (its O goes out through it) into the next tile.
        if p.packed:
            raise InfeasibleConfigError(
                f"fwd hopper: {knob_name}=1 on a packed batch, whose O goes out with plain "
                f"stores (allowed: {knob_name}=0)")
        if hopper_q_buffers(c, p.head_dim) != 2:
            raise InfeasibleConfigError(
                f"fwd hopper: {knob_name}=1 needs a persistent grid with two Q buffers "
                f"(persistent={c.persistent}, and two must fit in shared memory beside "
                f"the K/V ring of {c.num_stages})")
    if c.tile_overlap and consumers == 3:
        # Built for sm_90a with Triton 3.6: the open tile's accumulator and P do not fit
        # the three consumers' 152-160 registers (the causal 192x128 tile at D=64 spilled
        # 408 bytes of loads, against none without the overlap).
        raise InfeasibleConfigError(
            "fwd hopper: tile_overlap=1 with three consumers (block_m=192): the open tile's "
            "accumulator and P do not fit their registers (allowed: block_m 64 or 128)")
    if c.defer_o and c.tile_overlap:
        raise InfeasibleConfigError(
            "fwd hopper: tile_overlap=1 defers the O store its own way; defer_o=1 beside it "
            "has no meaning (allowed: defer_o=0)")
    producer = hopper_producer_regs(consumers, c.consumer_regs)
    if producer < 24:
        raise InfeasibleConfigError(
            f"fwd hopper: consumer_regs={c.consumer_regs} for {consumers} consumer "
            f"warpgroups leaves the producer {producer} registers per thread (at least 24)")
    _check_smem("fwd hopper", smem_fwd_hopper(c, p.head_dim), smem_bytes)
    # Per consumer thread: the fp32 score tile, the fp32 accumulator, P in 16 bits, and a
    # margin. Three consumers get the tighter margin: their share is 152-160 registers by
    # construction, and ptxas (Triton 3.6) builds the causal 192x128 tile at D=64 there
    # without spilling, which ran 1.05-1.14x the two-consumer tuned configs on causal rows
    # of S >= 4096 on the H200 (BENCHMARKS.md, issue 12); the unmasked one spills 84-900
    # bytes and runs slower, which the tuner measures.
    regs = (64 * c.block_n + 64 * p.head_dim) / 128 + 64 * c.block_n / 256
    margin = _REG_OVERHEAD if consumers < 3 else _REG_OVERHEAD_THREE_CONSUMERS
    if regs + margin > c.consumer_regs:
        raise InfeasibleConfigError(
            f"fwd hopper: ~{regs + margin:.0f} registers per consumer thread exceed "
            f"consumer_regs={c.consumer_regs}")
    for name, why in REFUSED_KNOBS.items():
        if getattr(c, name) and not flag(UNVERIFIED_ENV):
            raise InfeasibleConfigError(
                f"fwd hopper: {name}=1 is refused: it {why} (allowed: {name}=0; set "
                f"{UNVERIFIED_ENV}=1 to try it)")
    reason = hopper_support()
    if reason:
        raise InfeasibleConfigError(f"fwd hopper: {reason}")


def check_fwd(c: FwdConfig, p: Problem, smem_bytes: int = DEFAULT_SMEM_BYTES) -> None:
    """Raise InfeasibleConfigError (with the reason) if ``c`` cannot run ``p``."""
    _check_unused_at_default(c)
    if c.variant == HOPPER:
        _check_fwd_hopper(c, p, smem_bytes)
        return
    d = padded_head_dim(p.head_dim)
    if c.block_m & (c.block_m - 1):
        raise InfeasibleConfigError(
            f"fwd: block_m={c.block_m} is the Hopper kernel's three-consumer tile; the "
            f"portable kernel takes powers of two")
    _check_launch("fwd", c.block_m, c.num_warps)
    _check_smem("fwd", smem_fwd(c, d), smem_bytes)
    _check_regs("fwd", _regs(c.block_m, c.block_n, d, c.num_warps), c.maxnreg, c.num_warps)
    if c.use_tma and d != p.head_dim:
        raise InfeasibleConfigError(
            f"fwd: use_tma needs a power-of-two head dim, got {p.head_dim}")
    if c.use_tma and c.num_stages == 2 and c.block_m >= 64 and TRITON_VERSION < (3, 7):
        # The ptxas bundled with Triton 3.6 crashes (SIGSEGV) on these descriptor kernels;
        # the ones of Triton 3.7-3.9 build them. Mapped without a GPU by
        # benchmarks/probe_ptxas.py (data: benchmarks/data/ptxas_tma_triton36.jsonl).
        raise InfeasibleConfigError(
            f"fwd: use_tma with num_stages=2 and block_m={c.block_m} crashes ptxas in Triton "
            f"{'.'.join(map(str, TRITON_VERSION))} (allowed: another num_stages, block_m < 64, "
            f"or Triton >= 3.7)")


def variant_unavailable(direction: str, variant: int, p: Problem) -> str:
    """Why no config of ``variant`` can serve ``p`` whatever its other knobs ('' if some
    may): the search space leaves such variants out before sampling."""
    if direction != "bwd":
        return ""
    if variant == BWD_HOPPER:
        return _bwd_hopper_unavailable(p)
    if variant == BWD_ATOMIC and p.deterministic:
        return ("bwd portable-atomic: dQ is summed with atomics in no fixed order, so it "
                "serves only deterministic=False (this problem is deterministic=True)")
    return ""


@functools.lru_cache(maxsize=1)
def descriptor_reduce_support() -> str:
    """'' when a tensor-descriptor atomic_add can run here, else why not. Checked once."""
    from flashtune._env import interpreting

    if interpreting():
        return "the CPU interpreter has no tensor-descriptor atomic_add"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    cc = torch.cuda.get_device_capability()
    if cc[0] < 9:
        return f"the device is sm{cc[0]}{cc[1]}; descriptor reduce-adds need sm90 or newer"
    return ""


def smem_dq_tile(c: BwdConfig, d: int) -> int:
    # Atomic dQ through TMA: the fp32 [dkdv_block_m, D] tile is staged in shared memory.
    return 4 * c.dkdv_block_m * d if c.dkdv_atomic_tma else 0


def _bwd_hopper_unavailable(p: Problem) -> str:
    if p.packed:
        return "bwd hopper: packed (varlen) batches run on the portable kernels only"
    if p.head_dim not in (64, 128):
        return f"bwd hopper: head_dim {p.head_dim} is not supported (allowed: 64, 128)"
    reason = hopper_support()
    return f"bwd hopper: {reason}" if reason else ""


def smem_bwd_hopper(c: BwdConfig, d: int, deterministic: bool) -> int:
    # Q and dO rings, the held K and V, each consumer's dS tile, and (without the fixed
    # order, which adds from registers) each consumer's fp32 dQ tile for the TMA reduce.
    m, n = c.hopper_block_m, c.hopper_block_n
    dq = 0 if deterministic else 4 * m * d * (n // 64)
    return 2 * (2 * c.hopper_stages * m * d + 2 * n * d + n * m) + dq + 1024


def hopper_bwd_fixed_order(c: BwdConfig, d: int, deterministic: bool,
                           smem_bytes: int = DEFAULT_SMEM_BYTES) -> bool:
    """Whether the Hopper backward runs ``c`` in the fixed dQ order: for every deterministic
    call, and for a non-deterministic one whose free order does not fit (its per-consumer
    fp32 dQ staging beside ``c``'s buffers; the fixed order stages less). A deterministic
    run serves a call that does not ask for one, so such a config is run rather than
    refused: refused, a deterministic entry of three 64x128 stages at D=128 could not serve
    its free-order twin, and the dispatcher's nearest rung fell to another GQA ratio's entry
    (BENCHMARKS.md, issue 13, session 34). ``c.hopper_dq_fixed`` keeps the fixed order for a
    non-deterministic call too: a search may find it faster, and the dispatcher sets it
    where a deterministic entry serves such a call, so that the config runs as it was timed
    (the free order of one such config ran 2x slower at 2x32x8192x64 causal on the H200,
    BENCHMARKS.md issue 13, session 35)."""
    return deterministic or bool(c.hopper_dq_fixed) or smem_bwd_hopper(c, d, False) > smem_bytes


def for_nondeterministic_call(c: FwdConfig | BwdConfig) -> FwdConfig | BwdConfig:
    """A deterministic entry's config as it serves a ``deterministic=False`` call: the
    Hopper backward keeps the fixed dQ order the entry was timed in
    (``hopper_dq_fixed``); any other config is unchanged."""
    if isinstance(c, BwdConfig) and c.variant == BWD_HOPPER:
        return dataclasses.replace(c, hopper_dq_fixed=1)
    return c


def _check_bwd_hopper(c: BwdConfig, p: Problem, smem_bytes: int) -> None:
    if c.hopper_block_m == 128 and p.head_dim > 64:
        raise InfeasibleConfigError(
            f"bwd hopper: hopper_block_m=128 needs head_dim <= 64 (got {p.head_dim}): a "
            f"consumer holds dK, dV and a 128-row dQ tile in registers")
    if c.hopper_kv_regs and p.head_dim != 64:
        raise InfeasibleConfigError(
            f"bwd hopper: hopper_kv_regs=1 needs head_dim 64 (got {p.head_dim}): at D=128 "
            f"the K and V tiles do not fit in a consumer's registers beside its "
            f"accumulators (use 0)")
    if c.hopper_dq_fixed and p.deterministic:
        raise InfeasibleConfigError(
            "bwd hopper: hopper_dq_fixed=1 is for deterministic=False calls; a deterministic "
            "call always takes the fixed dQ order (use 0)")
    fixed = hopper_bwd_fixed_order(c, p.head_dim, p.deterministic, smem_bytes)
    if c.hopper_dq_unordered and (p.deterministic or not fixed):
        raise InfeasibleConfigError(
            "bwd hopper: hopper_dq_unordered=1 drops the fixed dQ order's turns, for "
            "deterministic=False calls in the fixed order's staging; " + (
                "a deterministic call needs the turns (use 0)" if p.deterministic else
                "this call's free order fits and takes no turns anyway (use 0, or "
                "hopper_dq_fixed=1 for the fixed order's staging)"))
    if c.hopper_dq_unordered and c.hopper_dq_store_first:
        raise InfeasibleConfigError(
            f"bwd hopper: hopper_dq_store_first={c.hopper_dq_store_first} stores each query "
            "tile's first dQ turn, and hopper_dq_unordered=1 takes no turns (nothing comes "
            "first); set one of them")
    if c.hopper_dq_groups and not fixed:
        raise InfeasibleConfigError(
            "bwd hopper: hopper_dq_groups=1 stages the fixed dQ order's chunks, and this "
            "deterministic=False call runs the free order; use 0, or hopper_dq_fixed=1 to "
            "keep the fixed order")
    if c.hopper_dq_store_first and not (c.hopper_dq_frag and fixed):
        raise InfeasibleConfigError(
            f"bwd hopper: hopper_dq_store_first={c.hopper_dq_store_first} stores the first of "
            "the fixed dQ order's turns into the accumulator of hopper_dq_frag=1: it needs "
            "hopper_dq_frag=1 and a call that runs the fixed order (deterministic, "
            "hopper_dq_fixed=1, or a free order that does not fit); use 0")
    if c.hopper_dq_rows and not (fixed and c.hopper_dq_frag and c.hopper_block_m == 128
                                 and c.hopper_block_n == 128):
        raise InfeasibleConfigError(
            "bwd hopper: hopper_dq_rows=1 splits the fixed dQ order's 128-row tiles between "
            "two consumers by rows: it needs hopper_block_m=128, hopper_block_n=128, "
            "hopper_dq_frag=1 and a call that runs the fixed order (deterministic, "
            "hopper_dq_fixed=1, or a free order that does not fit); use 0")
    if c.hopper_dq_groups and c.hopper_dq_frag:
        raise InfeasibleConfigError(
            "bwd hopper: hopper_dq_groups=1 and hopper_dq_frag=1 are two layouts of one dQ "
            "staging buffer; set one of them")
    if (p.heads_q // p.heads_kv) % c.hopper_kv_rep:
        raise InfeasibleConfigError(
            f"bwd hopper: hopper_kv_rep={c.hopper_kv_rep} splits each KV head's group of "
            f"{p.heads_q // p.heads_kv} query heads into {c.hopper_kv_rep} equal parts; use a "
            f"divisor of the group (1 always fits)")
    if c.hopper_persist and (p.causal or tuple(p.window) != (-1, -1)):
        raise InfeasibleConfigError(
            "bwd hopper: hopper_persist=1 walks heads of whole key tiles, for calls without "
            "a causal mask or window (their key tiles' work differs: one program per key "
            "tile and head balances it); use 0")
    if c.hopper_persist and c.hopper_split > 1:
        raise InfeasibleConfigError(
            "bwd hopper: hopper_persist=1 holds every SM for the whole call, so a second "
            "half (hopper_split=2) would wait for it; set one of them")
    _check_smem("bwd hopper", smem_bwd_hopper(c, p.head_dim, fixed), smem_bytes)


def check_bwd(c: BwdConfig, p: Problem, smem_bytes: int = DEFAULT_SMEM_BYTES) -> None:
    """Raise InfeasibleConfigError (with the reason) if ``c`` cannot run ``p``."""
    _check_unused_at_default(c)
    reason = variant_unavailable("bwd", c.variant, p)
    if reason:
        raise InfeasibleConfigError(reason)
    if c.variant == BWD_HOPPER:
        _check_bwd_hopper(c, p, smem_bytes)
        return
    if c.dkdv_atomic_tma:
        reason = descriptor_reduce_support()
        if reason:
            raise InfeasibleConfigError(f"bwd portable-atomic: dkdv_atomic_tma=1: {reason}")
    d = padded_head_dim(p.head_dim)
    one_launch = c.variant in BWD_ONE_GRID
    # In one launch, every program runs with the dK/dV launch knobs.
    dq_warps = c.dkdv_warps if one_launch else c.dq_warps
    _check_launch("bwd dkdv", c.dkdv_block_n, c.dkdv_warps)
    _check_launch("bwd dq", c.dq_block_m, dq_warps)
    if one_launch:
        # Each program runs one of the two bodies: the launch needs the larger of the two.
        one = dataclasses.replace(c, dq_stages=c.dkdv_stages)
        _check_smem("bwd one launch", max(smem_dkdv(c, d), smem_dq(one, d)), smem_bytes)
    else:
        _check_smem("bwd dkdv", smem_dkdv(c, d) + smem_dq_tile(c, d), smem_bytes)
        if c.variant == BWD_TWO_KERNEL:
            _check_smem("bwd dq", smem_dq(c, d), smem_bytes)
    # dK/dV: two fp32 accumulators (dk, dv) plus the P^T and dP^T tiles, and with atomic dQ
    # the fp32 dQ tile of each step; dQ: one accumulator plus the P and dP tiles.
    r1 = (2 * c.dkdv_block_n * d + 2 * c.dkdv_block_n * c.dkdv_block_m
          + (c.dkdv_block_m * d if c.variant == BWD_ATOMIC else 0)) / (32 * c.dkdv_warps)
    _check_regs("bwd dkdv", r1, c.maxnreg, c.dkdv_warps)
    if c.variant != BWD_ATOMIC:
        r2 = (c.dq_block_m * d + 2 * c.dq_block_m * c.dq_block_n) / (32 * dq_warps)
        _check_regs("bwd dq", r2, c.maxnreg, dq_warps)


def check(c: FwdConfig | BwdConfig, p: Problem, smem_bytes: int = DEFAULT_SMEM_BYTES) -> None:
    if isinstance(c, FwdConfig):
        check_fwd(c, p, smem_bytes)
    elif isinstance(c, BwdConfig):
        check_bwd(c, p, smem_bytes)
    else:
        raise TypeError(f"config must be FwdConfig or BwdConfig, got {type(c).__name__}")


def is_feasible(c: FwdConfig | BwdConfig, p: Problem,
                smem_bytes: int = DEFAULT_SMEM_BYTES) -> tuple[bool, str]:
    try:
        check(c, p, smem_bytes)
    except InfeasibleConfigError as e:
        return False, str(e)
    return True, ""


def _fit_rows(block: int, n: int) -> int:
    """Shrink a row block toward the problem size: no point tiling 128 rows for Sq=17."""
    return max(16, min(block, 1 << max(n - 1, 1).bit_length()))


# Below this many scores per call the kernels run for a few microseconds and the call is
# bound by host time, where the portable launch is cheaper than the Hopper one (which builds
# TMA descriptors per call): bench_overhead.py measured 48 us against 20 us per call at
# B=1, H=1, S=128, D=64 on the H200.
HOST_BOUND_SCORES = 1 << 22


# Where the default backward is the Hopper kernel (see default_bwd): query and key
# sequences both at least HOPPER_BWD_MIN_SEQLEN long, or for deterministic=False at least
# HOPPER_BWD_FREE_MIN_KEYS keys (with any number of queries).
HOPPER_BWD_MIN_SEQLEN = 1024
HOPPER_BWD_FREE_MIN_KEYS = 8192


def host_bound(p: Problem) -> bool:
    """A call so small that host time, not the kernel, decides its speed."""
    return p.batch * p.heads_q * p.seqlen_q * p.seqlen_k < HOST_BOUND_SCORES


def default_fwd(p: Problem) -> FwdConfig:
    """Heuristic forward config, always feasible: the Hopper kernel where it can run and was
    measured faster (1.14x the portable default, geomean over the standard matrix on the
    H200), else the portable kernel with FA2-on-Hopper rules of thumb."""
    if p.seqlen_q >= 128 and p.head_dim in (64, 128) and not host_bound(p) \
            and not hopper_support():
        # Measured on the H200 (BENCHMARKS.md, issue 12):
        # - short causal rows (S <= 2048 at D=64, S <= 4096 at D=128): a persistent grid
        #   walking the heaviest tiles first within chunks of heads whose K/V stay in L2
        #   (tile order 3), 1.02-1.11x the same grid over all heads at once (order 2),
        #   which re-read every head's K/V from memory for each query block
        #   (benchmarks/experiments/hopper_fwd_qbuffers.py); at D=128 the consumers take
        #   turns;
        # - causal rows longer than that at D=64: three consumers (192-row tiles), a ring
        #   of three, 1.05-1.14x the shipped (tuned, two-consumer) configs at S >= 4096
        #   (benchmarks/experiments/hopper_fwd_consumers.py);
        # - other causal or windowed rows: one tile per program balances the diagonal
        #   better (benchmarks/fwd_default_scan.py);
        # - no mask at D=64 and S >= 2048, dense: three consumers (192-row tiles) on a
        #   persistent grid in query order, a ring of two (three at S=2048 in the
        #   measurement, the shipped config's), 1.10-1.18x the H200's shipped
        #   two-consumer configs beside cuDNN (1.05-1.14x cuDNN; at S <= 1024 a 192-row
        #   tile leaves too much of the last one idle: 0.91-0.93x against 0.96-0.97x)
        #   (benchmarks/experiments/fwd_knob_ab.py, session 40); no tuner had reached
        #   them, since neither the rows nor the registers can move alone between two and
        #   three consumers (autotune.space.COUPLED);
        # - no mask otherwise: a persistent grid in query order, consumers taking turns.
        # - a persistent grid with two Q buffers waits for a tile's O store behind the next
        #   tile's first product (defer_o): bit-identical, 1.016x geomean over the serial
        #   consumer on the matrix's rows of S <= 2048, 1.009x on the longer ones
        #   (benchmarks/experiments/fwd_tile_end_ab.py, session 38).
        if p.causal and p.seqlen_q <= (2048 if p.head_dim == 64 else 4096):
            return _defer_o(FwdConfig(variant=HOPPER, block_m=128, block_n=128, num_stages=2,
                                      persistent=1, tile_order=3,
                                      pingpong=int(p.head_dim == 128)), p)
        if p.causal and p.head_dim == 64 and p.window == (-1, -1):
            return FwdConfig(variant=HOPPER, block_m=192, block_n=128, num_stages=3,
                             consumer_regs=160)
        if p.causal or p.window != (-1, -1):
            return FwdConfig(variant=HOPPER, block_m=128, block_n=128, num_stages=2)
        if p.head_dim == 64 and p.seqlen_q >= 2048 and not p.packed:
            return _defer_o(FwdConfig(variant=HOPPER, block_m=192, block_n=128, num_stages=2,
                                      consumer_regs=160, persistent=1, tile_order=1), p)
        return _defer_o(FwdConfig(variant=HOPPER, block_m=128, block_n=128, num_stages=2,
                                  persistent=1, tile_order=1, pingpong=1), p)
    return default_portable_fwd(p)


def _defer_o(c: FwdConfig, p: Problem) -> FwdConfig:
    """``c`` with ``defer_o=1`` where it can take it (two Q buffers, a dense batch), else ``c``."""
    on = dataclasses.replace(c, defer_o=1)
    return on if is_feasible(on, p)[0] else c


def default_portable_fwd(p: Problem) -> FwdConfig:
    """The portable kernel's heuristic config (FA2-on-Hopper rules of thumb), always feasible."""
    d = padded_head_dim(p.head_dim)
    if d <= 64:
        c = FwdConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    elif d <= 128:
        c = FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    else:
        c = FwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    bm = _fit_rows(c.block_m, p.seqlen_q)
    bn = _fit_rows(c.block_n, p.seqlen_k)
    c = dataclasses.replace(c, block_m=bm, block_n=bn, num_warps=min(c.num_warps, max(4, bm // 8)))
    check_fwd(c, p)
    return c


def default_bwd(p: Problem, variant: int | None = None) -> BwdConfig:
    """Heuristic backward config, always feasible. ``variant`` None: the heuristic's pick,
    the fused one-launch backward for a host-bound call (:func:`host_bound`), the Hopper
    backward where it can run and the sequences are long enough (either determinism), else
    the two-kernel backward;
    else that variant (the portable ones with the same tiles; InfeasibleConfigError if the
    variant cannot serve ``p``)."""
    d = padded_head_dim(p.head_dim)
    if d <= 64:
        c = BwdConfig(dkdv_block_m=32, dkdv_block_n=128, dkdv_warps=4, dkdv_stages=3,
                      dq_block_m=128, dq_block_n=32, dq_warps=4, dq_stages=3, pre_block_m=64)
    elif d <= 128:
        c = BwdConfig(dkdv_block_m=32, dkdv_block_n=128, dkdv_warps=8, dkdv_stages=3,
                      dq_block_m=128, dq_block_n=32, dq_warps=4, dq_stages=3, pre_block_m=64)
    else:
        c = BwdConfig(dkdv_block_m=16, dkdv_block_n=64, dkdv_warps=8, dkdv_stages=2,
                      dq_block_m=64, dq_block_n=16, dq_warps=4, dq_stages=2, pre_block_m=64)
    c = dataclasses.replace(
        c,
        dkdv_block_m=_fit_rows(c.dkdv_block_m, p.seqlen_q),
        dkdv_block_n=_fit_rows(c.dkdv_block_n, p.seqlen_k),
        dq_block_m=_fit_rows(c.dq_block_m, p.seqlen_q),
        dq_block_n=_fit_rows(c.dq_block_n, p.seqlen_k),
        pre_block_m=_fit_rows(c.pre_block_m, p.seqlen_q),
    )
    c = dataclasses.replace(c, dkdv_warps=min(c.dkdv_warps, max(4, c.dkdv_block_n // 8)),
                            dq_warps=min(c.dq_warps, max(4, c.dq_block_m // 8)))
    if variant is None and host_bound(p):
        # A call this small is bound by host time: one launch (no preprocess) instead of
        # three, and no delta buffer to allocate (BENCHMARKS.md, issue 14).
        variant = BWD_FUSED
    if variant is None and not host_bound(p) and not _bwd_hopper_unavailable(p) and (
            min(p.seqlen_q, p.seqlen_k) >= HOPPER_BWD_MIN_SEQLEN
            or (not p.deterministic and p.seqlen_k >= HOPPER_BWD_FREE_MIN_KEYS)):
        # Measured on the H200 (BENCHMARKS.md, issue 13, session 42), this default Hopper
        # config against the portable one, S = 1k, 4k and 16k, D = 64 and 128, causal or
        # not: in the fixed dQ order (deterministic calls) 1.00-1.34x, in the free order
        # 1.11-1.38x. (Session 24's kernel, before the fixed order's dQ writers and staged
        # LSE, was even or behind below 8k keys and 0.5x cuDNN in the fixed order; the
        # free-order rule from 8k keys is its.)
        variant = BWD_HOPPER
    if variant == BWD_HOPPER:
        reason = _bwd_hopper_unavailable(p)
        if reason:
            raise InfeasibleConfigError(reason)
        # At D=64, K and V in registers (hopper_kv_regs) with the default 64-row query
        # tiles: 1.03-1.06x in the free dQ order, 1.02-1.07x in the fixed one on the H200
        # (BENCHMARKS.md, issue 13, session 42). At D=128, dQ staged in register order
        # (hopper_dq_frag): 1.03-1.09x in the fixed order (against column groups), 1.02-1.05x
        # in the free one (session 48).
        c = BwdConfig(variant=BWD_HOPPER, pre_block_m=c.pre_block_m,
                      hopper_kv_regs=int(p.head_dim == 64),
                      hopper_dq_frag=int(p.head_dim == 128))
    elif variant is not None and variant != c.variant:
        c = _as_variant(c, variant, p)
    check_bwd(c, p)
    return c


def _as_variant(c: BwdConfig, variant: int, p: Problem) -> BwdConfig:
    """``c``'s tiles run as ``variant``: the knobs it does not use back at their defaults."""
    reason = variant_unavailable("bwd", variant, p)
    if reason:
        raise InfeasibleConfigError(reason)
    base, used = BwdConfig(), set(active_fields(BwdConfig, variant))
    c = dataclasses.replace(c, variant=variant, **{
        f.name: getattr(base, f.name) for f in dataclasses.fields(c) if f.name not in used})
    if variant in BWD_ONE_GRID:
        # One launch, one num_warps: what the dQ tile can use, the dK/dV tile shrunk to fit
        # its registers with it.
        warps = min(c.dkdv_warps, max(4, c.dq_block_m // 8))
        c = dataclasses.replace(c, dkdv_warps=warps)
        while c.dkdv_block_n > 16 and not is_feasible(c, p)[0]:
            c = dataclasses.replace(c, dkdv_block_n=c.dkdv_block_n // 2)
    return c


def default_config(direction: str, p: Problem) -> FwdConfig | BwdConfig:
    return default_fwd(p) if direction == "fwd" else default_bwd(p)
