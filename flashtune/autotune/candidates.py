"""The project's own candidates, beside the sampler's picks: recombination and polishing.

Pure functions of what the search has seen (:class:`Seen`); the search decides when to
ask for them (see :mod:`flashtune.autotune.tuner`).

- :func:`compose_point`: the best measured setting of each backward launch's own
  fields, put together, when predicted faster than the incumbent (the launches run one
  after another, so their times add up; see :meth:`SearchSpace.compose`).
- :func:`polish_point`: the incumbent's nearest untried feasible neighbour, one field
  moved to an adjacent choice, else two; among those, the move of the fields polished
  least so far in the search (each new incumbent would otherwise restart at the first
  field, and the last ones, such as the register cap or the ping-pong schedule, went
  unpolished in short searches). For a backward incumbent that runs as separate
  launches (:func:`by_launch`), each launch's fields move at once, around the best
  measured setting of that launch, since each launch is timed on its own.
- :func:`rival`: the best measured point of the other kernel family (portable Triton or
  Hopper Gluon), while it is close enough to the incumbent that the final re-timing may
  still rank it first; the search polishes it too, in turn with the incumbent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flashtune.autotune.space import SearchSpace
from flashtune.kernels.config import BWD_FUSED, BWD_HOPPER, BWD_ONE_LAUNCH, HOPPER
from flashtune.problem import Problem

Params = dict[str, Any]
PartTimes = tuple[Params, dict[str, float]]  # (params, {launch: ms})
# Backward variants that run as one launch (timed as a whole, polished field by field).
ONE_LAUNCH_VARIANTS = frozenset({BWD_ONE_LAUNCH, BWD_FUSED, BWD_HOPPER})


# How close (trial time over the incumbent's) the other kernel family's best point must be
# to be polished and re-timed as a finalist. A search's trials are short timings; in the
# final re-timing (the house protocol, longer) the two families ranked differently by up
# to 10% on the H200 (BENCHMARKS.md, issue 17, "Search quality on the conditional
# space"), and polishing only the incumbent's family never measured the other's best
# point, one move from its best trial.
RIVAL_MARGIN = 0.10


def family(direction: str, params: Mapping[str, Any]) -> str:
    """The kernel family of a point: "hopper" (the Gluon kernels) or "portable"."""
    hopper = HOPPER if direction == "fwd" else BWD_HOPPER
    return "hopper" if params.get("variant", 0) == hopper else "portable"


def rival(direction: str, done: Mapping[tuple[Any, ...], Any], best_params: Params,
          best_ms: float) -> Params:
    """The fastest measured point (``done``: signature -> finished trial) of the kernel
    family the incumbent ``best_params`` is not in, if within :data:`RIVAL_MARGIN` of
    ``best_ms``; else {}."""
    if not best_params or not math.isfinite(best_ms):
        return {}
    mine = family(direction, best_params)
    out, out_ms = {}, math.inf
    for key, t in done.items():
        if t.state.name != "COMPLETE" or t.value is None:
            continue
        params = dict(key)
        if family(direction, params) != mine and t.value < out_ms:
            out, out_ms = params, float(t.value)
    return out if out_ms <= (1 + RIVAL_MARGIN) * best_ms else {}


def sig(params: Mapping[str, Any]) -> tuple[Any, ...]:
    """A hashable signature of a point."""
    return tuple(sorted(params.items()))


@dataclass(frozen=True)
class Seen:
    """What the search knows when it picks a candidate."""

    space: SearchSpace
    problem: Problem
    done: Mapping[tuple[Any, ...], Any]  # signature -> a finished (complete or failed) trial
    part_times: Mapping[tuple[Any, ...], PartTimes]  # backward: each launch's time
    best_params: Params  # the incumbent ({} before the first passing candidate)
    queued: list[Params]  # asked for, not measured yet
    moved: Mapping[str, int] = field(default_factory=dict)  # polishing moves per field


def usable(seen: Seen, cand: Params) -> bool:
    """Not measured, not queued, and feasible."""
    return (sig(cand) not in seen.done and cand not in seen.queued
            and seen.space.feasible(seen.space.config(cand), seen.problem)[0])


def compose_point(seen: Seen) -> Params | None:
    """The recombined point predicted fastest, if it beats the incumbent by 0.2%."""
    incumbent = seen.part_times.get(sig(seen.best_params))
    if incumbent is None:
        return None
    limit = sum(incumbent[1].values()) * (1 - 2e-3)
    for predicted, cand in seen.space.compose(seen.part_times.values()):
        if predicted >= limit:
            break
        if usable(seen, cand):
            return cand
    return None


def part_polish_point(seen: Seen, radius: int, skipped: set[tuple[Any, ...]]) -> Params | None:
    """Every launch's best setting moved ``radius`` steps at once (backward only).
    ``skipped`` collects launch settings that do not fit even alone (kept across calls)."""
    space = seen.space
    ranked = space.compose(seen.part_times.values())
    base = ranked[0][1] if ranked else seen.best_params
    tried = {space.part_setting(part, prm) for prm in
             [r[0] for r in seen.part_times.values()] + seen.queued for part in space.parts}
    for _ in range(50):
        cand = space.part_moves(base, tried | skipped, radius)
        if cand is None:
            return None
        if usable(seen, cand):
            return cand
        # The moves do not fit together: try each launch's move alone, and drop a
        # move that does not fit even alone.
        for part, fields in space.parts.items():
            if any(cand[f] != base[f] for f in fields):
                alone = {**base, **{f: cand[f] for f in fields}}
                if usable(seen, alone):
                    return alone
                skipped.add(space.part_setting(part, alone))
    return None


def by_launch(seen: Seen) -> bool:
    """Whether the incumbent runs as the space's separate launches, each timed on its own
    (the two-kernel and atomic backward), so that polishing moves every launch at once.
    A one-launch incumbent (the fused or the Hopper backward) is polished field by field,
    like a forward."""
    parts = seen.space.parts
    if not parts:
        return False
    rec = seen.part_times.get(sig(seen.best_params))
    if rec is None:  # not timed by launch (a seed polishing is planned around): its variant
        return seen.best_params.get("variant") not in ONE_LAUNCH_VARIANTS
    return all(p in rec[1] for p in parts)


def polish_point(seen: Seen, skipped: set[tuple[Any, ...]]) -> Params | None:
    """The incumbent's nearest untried feasible point: one step away, else two.
    For a backward that runs as separate launches, every launch moves at once (see
    :func:`part_polish_point`) and plain moves are left with the shared fields, since a
    new mix of launch settings already timed is the recombination's job."""
    split = by_launch(seen)
    for radius in (1, 2):
        if split:
            cand = part_polish_point(seen, radius, skipped)
            if cand is not None:
                return cand
        among = seen.space.shared if split else None
        near = seen.space.neighbours(seen.best_params, radius, among=among)
        if seen.moved:  # the fields polished least so far first (a stable sort)
            near.sort(key=lambda c: sum(seen.moved.get(n, 0)
                                        for n in moves(seen.space, seen.best_params, c)))
        for cand in near:
            if usable(seen, cand):
                return cand
    return None


def moves(space: SearchSpace, centre: Params, point: Params) -> tuple[str, ...]:
    """The fields ``point`` moves away from ``centre``: ("variant",) for another kernel
    (whose knobs it does not share go back to their defaults), else each field changed."""
    a, b = space.complete(centre), space.complete(point)
    if a.get("variant") != b.get("variant"):
        return ("variant",)
    return tuple(n for n in space.fields if a.get(n) != b.get(n))
