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
from dataclasses import dataclass, field
from typing import Any

from flashtune._problem import Problem
from flashtune.exceptions import InfeasibleConfigError

POW2_BLOCKS = (16, 32, 64, 128, 256)
WARPS = (1, 2, 4, 8, 16)
STAGES = (1, 2, 3, 4, 5, 6)
# 0 means "let the compiler choose". Otherwise a per-thread register cap (multiple of 8).
MAXNREG = (0, 128, 168, 200, 232, 255)

# Shared memory per block the estimate must fit. Hopper allows 227 KiB per block; this is
# the default when the device cannot be asked (CPU interpreter).
DEFAULT_SMEM_BYTES = 227 * 1024
# Register file per thread before Triton spills: 255 is the hardware cap; leave headroom for
# addresses and softmax state.
_REG_BUDGET = 224


def knob(default: Any, choices: tuple[Any, ...], doc: str) -> Any:
    return field(default=default, metadata={"choices": choices, "doc": doc})


@dataclass(frozen=True)
class FwdConfig:
    """Forward kernel: Q tile of ``block_m`` rows, K/V streamed in tiles of ``block_n``."""

    block_m: int = knob(64, POW2_BLOCKS, "query rows per program")
    block_n: int = knob(64, POW2_BLOCKS, "keys per inner-loop step")
    num_warps: int = knob(4, WARPS, "warps per program")
    num_stages: int = knob(2, STAGES, "software-pipelining depth of the K/V loop")
    maxnreg: int = knob(0, MAXNREG, "register cap per thread (0 = compiler's choice)")

    kind = "fwd"


@dataclass(frozen=True)
class BwdConfig:
    """Backward: a dK/dV kernel (keys held, loop over queries) and a dQ kernel (queries held,
    loop over keys), each with its own tile and launch knobs, plus the delta preprocess."""

    dkdv_block_m: int = knob(32, POW2_BLOCKS, "dK/dV: query rows per inner-loop step")
    dkdv_block_n: int = knob(64, POW2_BLOCKS, "dK/dV: keys held per program")
    dkdv_warps: int = knob(4, WARPS, "dK/dV: warps per program")
    dkdv_stages: int = knob(2, STAGES, "dK/dV: pipelining depth")
    dq_block_m: int = knob(64, POW2_BLOCKS, "dQ: query rows held per program")
    dq_block_n: int = knob(32, POW2_BLOCKS, "dQ: keys per inner-loop step")
    dq_warps: int = knob(4, WARPS, "dQ: warps per program")
    dq_stages: int = knob(2, STAGES, "dQ: pipelining depth")
    pre_block_m: int = knob(64, POW2_BLOCKS, "delta preprocess: rows per program")
    maxnreg: int = knob(0, MAXNREG, "register cap per thread for both kernels (0 = compiler)")

    kind = "bwd"


CONFIG_TYPES: dict[str, type] = {"fwd": FwdConfig, "bwd": BwdConfig}


def config_fields(cls: type) -> dict[str, tuple[Any, ...]]:
    """``{field name: allowed values}`` for a config type: the search space, as data."""
    return {f.name: f.metadata["choices"] for f in dataclasses.fields(cls)}


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


def _smem_fwd(c: FwdConfig, d: int, elt: int) -> int:
    # Q tile stays resident; K and V tiles are multi-buffered num_stages deep.
    return c.block_m * d * elt + max(c.num_stages - 1, 1) * 2 * c.block_n * d * elt


def _regs(rows: int, cols: int, d: int, warps: int) -> float:
    # fp32 score tile + fp32 accumulator, spread across the program's threads.
    return (rows * cols + rows * d) / (32 * warps)


def _check_launch(where: str, block_m: int, warps: int, maxnreg: int) -> None:
    if warps > max(4, block_m // 8):
        raise InfeasibleConfigError(
            f"{where}: {warps} warps for a {block_m}-row tile leaves warps idle "
            f"(allowed up to {max(4, block_m // 8)})")
    if maxnreg and maxnreg * 32 * warps > 65536:
        raise InfeasibleConfigError(
            f"{where}: maxnreg={maxnreg} x {warps} warps exceeds the 64K-register file")


def check_fwd(c: FwdConfig, p: Problem, smem_bytes: int = DEFAULT_SMEM_BYTES) -> None:
    """Raise InfeasibleConfigError (with the reason) if ``c`` cannot run ``p``."""
    d = padded_head_dim(p.head_dim)
    _check_launch("fwd", c.block_m, c.num_warps, c.maxnreg)
    smem = _smem_fwd(c, d, 2)
    if smem > smem_bytes:
        raise InfeasibleConfigError(
            f"fwd: estimated shared memory {smem} B exceeds the device's {smem_bytes} B")
    regs = _regs(c.block_m, c.block_n, d, c.num_warps)
    if regs > _REG_BUDGET:
        raise InfeasibleConfigError(
            f"fwd: ~{regs:.0f} fp32 registers/thread for the score tile and accumulator "
            f"exceeds {_REG_BUDGET}; use smaller blocks or more warps")


def check_bwd(c: BwdConfig, p: Problem, smem_bytes: int = DEFAULT_SMEM_BYTES) -> None:
    d = padded_head_dim(p.head_dim)
    _check_launch("bwd dkdv", c.dkdv_block_n, c.dkdv_warps, c.maxnreg)
    _check_launch("bwd dq", c.dq_block_m, c.dq_warps, c.maxnreg)
    # dK/dV: K, V held; Q, dO streamed (staged); dk, dv accumulators in registers.
    smem1 = 2 * c.dkdv_block_n * d * 2 + max(c.dkdv_stages - 1, 1) * 2 * c.dkdv_block_m * d * 2
    smem2 = 2 * c.dq_block_m * d * 2 + max(c.dq_stages - 1, 1) * 2 * c.dq_block_n * d * 2
    for where, smem in (("dkdv", smem1), ("dq", smem2)):
        if smem > smem_bytes:
            raise InfeasibleConfigError(
                f"bwd {where}: estimated shared memory {smem} B exceeds the device's "
                f"{smem_bytes} B")
    r1 = (2 * c.dkdv_block_n * d + 2 * c.dkdv_block_n * c.dkdv_block_m) / (32 * c.dkdv_warps)
    r2 = (c.dq_block_m * d + 2 * c.dq_block_m * c.dq_block_n) / (32 * c.dq_warps)
    for where, regs in (("dkdv", r1), ("dq", r2)):
        if regs > _REG_BUDGET:
            raise InfeasibleConfigError(
                f"bwd {where}: ~{regs:.0f} fp32 registers/thread exceeds {_REG_BUDGET}; "
                f"use smaller blocks or more warps")


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


def default_fwd(p: Problem) -> FwdConfig:
    """Heuristic forward config (FA2-on-Hopper rules of thumb), always feasible."""
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


def default_bwd(p: Problem) -> BwdConfig:
    """Heuristic backward config, always feasible."""
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
    check_bwd(c, p)
    return c


def default_config(direction: str, p: Problem) -> FwdConfig | BwdConfig:
    return default_fwd(p) if direction == "fwd" else default_bwd(p)
