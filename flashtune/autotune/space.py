"""Search spaces, as data.

A :class:`SearchSpace` is built from a config dataclass's field metadata
(:func:`flashtune.kernels.config.config_fields`): every field is a dimension and
its ``choices`` are the values, so a knob added to ``FwdConfig`` or ``BwdConfig``
joins the search with no change here. Each dimension maps to an Optuna
``CategoricalDistribution``. :meth:`SearchSpace.restrict` narrows dimensions (a
sub-grid for experiments, or a smaller space for online tuning); a restricted
space gets its own :attr:`signature`, so its studies never mix with the full one's.

Feasibility is the kernels' own rule (:func:`flashtune.kernels.config.check`):
:meth:`SearchSpace.feasible` returns the rejection reason, so the tuner can
record it on the trial without compiling anything.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from flashtune.exceptions import InfeasibleConfigError
from flashtune.kernels.config import (
    BWD_HOPPER,
    CONFIG_TYPES,
    BwdConfig,
    FwdConfig,
    active_fields,
    config_fields,
    config_parts,
    config_to_dict,
    is_feasible,
    variant_of,
    variant_unavailable,
)
from flashtune.problem import Problem

Config = FwdConfig | BwdConfig

# Fields whose declared order is no path a polishing walk can follow, so a move may go
# from any choice to any other:
# - the variant and the tile order name kinds, not sizes (from the two-kernel backward
#   straight to the one-launch one, which the variant between them, atomic dQ, cannot
#   stand in for on a deterministic problem);
# - the register cap: 0 (the compiler's choice) is declared first, beside the tightest
#   cap (128), and the time is not unimodal in the cap. On the H200 the 60 s backward
#   searches ended on caps of 168-255 on 5 of 8 problems (one at +2.5% over a 12 s
#   search that never left 0), while a forward one ran 7% faster at 128 than at 0
#   (BENCHMARKS.md, issue 17).
# - the Hopper forward's consumer registers: two and three consumer warpgroups take
#   disjoint counts (216-240 and 152-160), so no single step in the declared order
#   crosses between them.
UNORDERED = frozenset({"variant", "tile_order", "maxnreg", "consumer_regs"})
# Fields whose effects depend on each other, so that moving both at once is one step
# (:meth:`SearchSpace.neighbours`): the tile order means another walk on a persistent grid
# (each SM's tiles) than on one program per tile (the launch order). On the H200 a causal
# forward (B16 H16 S1000 D128) ran 2.1% faster on a persistent grid in order 2 than a 12 s
# search's winner (one program per tile, order 1), and each move alone was slower in its
# trials (+3% and +15%), so that search, stepping one field at a time, never tried it
# (BENCHMARKS.md, issue 17). The Hopper forward's query rows and consumer registers: a
# third consumer warpgroup (block_m 128 -> 192) is feasible only at 152-160 registers,
# and two consumers only above them, so neither field can move alone between two and
# three consumers. Without the pair no search tried three consumers on the H200's
# unmasked D=64 rows (session 40's sweep: 0 of 334 trials), where they ran 1.10-1.18x as
# fast as the shipped two-consumer configs at S >= 2048 (BENCHMARKS.md, issue 12).
COUPLED = (("persistent", "tile_order"), ("block_m", "consumer_regs"))


@dataclass(frozen=True)
class SearchSpace:
    """The values each config field may take for one direction (``"fwd"`` or ``"bwd"``)."""

    direction: str
    choices: tuple[tuple[str, tuple[Any, ...]], ...]

    @classmethod
    def full(cls, direction: str) -> SearchSpace:
        """Every field of the direction's config type, with all its declared choices."""
        if direction not in CONFIG_TYPES:
            raise ValueError(f"direction must be one of {sorted(CONFIG_TYPES)}, got {direction!r}")
        return cls(direction, tuple(config_fields(CONFIG_TYPES[direction]).items()))

    @classmethod
    def subgrid(cls, direction: str, **fields: Any) -> SearchSpace:
        """Only the named fields vary (as in :meth:`restrict`); every other field, including
        knobs added later, stays at its config default. For experiments over a stated grid."""
        defaults = CONFIG_TYPES[direction]()
        fixed = {n: getattr(defaults, n) for n, _ in cls.full(direction).choices
                 if n not in fields}
        return cls.full(direction).restrict(**fixed, **fields)

    @property
    def fields(self) -> dict[str, tuple[Any, ...]]:
        return dict(self.choices)

    def restrict(self, **fields: Any) -> SearchSpace:
        """A narrower space: ``restrict(block_m=(64, 128), maxnreg=0)``; a scalar fixes a field.

        Every value must be one of the field's declared choices.
        """
        full = config_fields(CONFIG_TYPES[self.direction])
        out = self.fields
        for name, vals in fields.items():
            if name not in full:
                raise ValueError(f"unknown {self.direction} config field {name!r}; "
                                 f"known: {sorted(full)}")
            vals = tuple(vals) if isinstance(vals, (tuple, list)) else (vals,)
            bad = [v for v in vals if v not in full[name]]
            if bad or not vals:
                raise ValueError(f"{self.direction} field {name!r}: values {bad or vals} are "
                                 f"not among its choices {full[name]}")
            out[name] = tuple(dict.fromkeys(vals))
        return SearchSpace(self.direction, tuple(out.items()))

    def for_problem(self, problem: Problem) -> SearchSpace:
        """This space less the choices ``problem`` cannot take: a deterministic backward
        always runs the Hopper kernel's fixed dQ order, so ``hopper_dq_fixed`` and
        ``hopper_dq_unordered`` stay at 0 there (1 is for ``deterministic=False`` calls; the
        feasibility rules refuse it), and neither the sampler nor a polishing walk spends a
        pick on them. Likewise
        ``hopper_kv_regs`` stays at 0 where the head dim is not 64 (K and V only fit in
        registers there), ``hopper_dq_rows`` at 0 above head dim 64 (it splits 128-row
        query tiles, which only fit up to 64), and ``hopper_kv_rep`` at the divisors of the
        GQA group (the feasibility rules refuse any other; an MHA call keeps 1)."""
        out = self
        if self.direction != "bwd":
            return out
        if problem.deterministic:
            for name in ("hopper_dq_fixed", "hopper_dq_unordered"):
                if len(out.fields.get(name, ())) > 1:
                    out = out.restrict(**{name: 0})
        if problem.head_dim != 64 and len(out.fields.get("hopper_kv_regs", ())) > 1:
            out = out.restrict(hopper_kv_regs=0)
        if problem.head_dim > 64 and len(out.fields.get("hopper_dq_rows", ())) > 1:
            out = out.restrict(hopper_dq_rows=0)
        reps = out.fields.get("hopper_kv_rep", ())
        group = problem.heads_q // problem.heads_kv
        fits = tuple(r for r in reps if group % r == 0)
        if fits and fits != reps:  # (none fits: a space narrowed by hand, left as given)
            out = out.restrict(hopper_kv_rep=fits)
        return out

    @property
    def size(self) -> int:
        n = 1
        for _, vals in self.choices:
            n *= len(vals)
        return n

    @property
    def is_full(self) -> bool:
        return self == SearchSpace.full(self.direction)

    @property
    def signature(self) -> str:
        """A short id of the exact space ("full" for the declared one)."""
        if self.is_full:
            return "full"
        blob = json.dumps([self.direction, [[n, list(v)] for n, v in self.choices]])
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    def distributions(self) -> dict[str, Any]:
        """``{field: optuna.distributions.CategoricalDistribution}``."""
        from optuna.distributions import CategoricalDistribution

        return {name: CategoricalDistribution(list(vals)) for name, vals in self.choices}

    def active(self, params: Mapping[str, Any]) -> list[str]:
        """The fields of this space that exist for ``params``' kernel variant: the space is
        conditional, the variant decides which knobs there are."""
        used = set(active_fields(CONFIG_TYPES[self.direction], variant_of(dict(params))))
        return [n for n, _ in self.choices if n in used]

    def variants(self, problem: Problem | None = None) -> list[int]:
        """The variants of this space that may serve ``problem``: those that
        :func:`~flashtune.kernels.config.variant_unavailable` rules out whatever their other
        knobs (the atomic backward for a deterministic problem, a kernel this machine cannot
        run) are left out, so they are never sampled."""
        vals = list(self.fields.get("variant", ()))
        if problem is None:
            return vals
        return [v for v in vals if not variant_unavailable(self.direction, v, problem)]

    def suggest(self, trial: Any, problem: Problem | None = None) -> Config:
        """Ask an Optuna trial for the variant first (among those that may serve
        ``problem``), then for one value per field that the variant uses (define-by-run);
        the other fields keep their defaults."""
        params: dict[str, Any] = {}
        if "variant" in self.fields:
            allowed = self.variants(problem) or list(self.fields["variant"])
            params["variant"] = trial.suggest_categorical("variant", allowed)
        for name in self.active(params):
            if name not in params:
                params[name] = trial.suggest_categorical(name, list(self.fields[name]))
        return self.config(params)

    def config(self, params: Mapping[str, Any]) -> Config:
        """The config of ``params``; fields it lacks (unused by its variant) take defaults."""
        cls = CONFIG_TYPES[self.direction]
        return cls(**{n: params[n] for n, _ in self.choices  # type: ignore[no-any-return]
                      if n in params})

    def complete(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with every field of the config type: the ones its variant does not use
        (so an Optuna trial never suggested them) take their defaults."""
        return config_to_dict(self.config(params))

    def contains(self, params: Mapping[str, Any]) -> bool:
        return all(params.get(n) in vals for n, vals in self.choices)

    def project(self, params: Mapping[str, Any]) -> dict[str, Any] | None:
        """``params`` as a point of this space (missing fields take the config's defaults),
        or None if some value lies outside it."""
        cls = CONFIG_TYPES[self.direction]
        full = {**{n: getattr(cls(), n) for n, _ in self.choices}, **dict(params)}
        point = {n: full[n] for n, _ in self.choices}
        return point if self.contains(point) else None

    def neighbours(self, params: Mapping[str, Any], radius: int = 1,
                   among: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Points ``radius`` steps away from ``params``: that many fields (of ``among``,
        default all) each moved to an adjacent choice (choices are ordered as declared,
        e.g. increasing block sizes). For a field whose order is no path
        (:data:`UNORDERED`: the kernel variant, the tile order, the register cap), every
        other choice is one step away. Both fields of a :data:`COUPLED` pair moved
        together count as one step; those points follow the single moves."""
        live = set(self.active(params))
        default = CONFIG_TYPES[self.direction]()
        base = {n: params.get(n, getattr(default, n)) for n, _ in self.choices}
        names = [n for n, vals in self.choices if len(vals) > 1 and base[n] in vals
                 and n in live and (among is None or n in among)]
        groups: list[tuple[str, ...]] = list(itertools.combinations(names, radius))
        if radius == 1:  # a coupled pair moves as one step too, after the single moves
            groups += [pair for pair in COUPLED if all(n in names for n in pair)]
        out = []
        for moved in groups:
            steps = []
            for n in moved:
                vals = self.fields[n]
                i = vals.index(base[n])
                steps.append([v for v in vals if v != base[n]] if n in UNORDERED
                             else [vals[j] for j in (i - 1, i + 1) if 0 <= j < len(vals)])
            for values in itertools.product(*steps):
                cand = {**base, **dict(zip(moved, values, strict=True))}
                if cand.get("variant", None) != base.get("variant", None):
                    # Another kernel: the knobs it does not use go back to their defaults
                    # (one spelling per kernel), the ones it shares keep their values.
                    used = set(self.active(cand))
                    cand = {n: v if n in used else getattr(default, n) for n, v in cand.items()}
                if self.contains(cand) and cand != base and cand not in out:
                    out.append(cand)
        return out

    @functools.cached_property
    def parts(self) -> dict[str, list[str]]:
        """``{launch: the fields that affect only it}`` for a config launched as several
        kernels (the backward); empty when the config is one launch."""
        out: dict[str, list[str]] = {}
        for name, part in config_parts(CONFIG_TYPES[self.direction]).items():
            if part is not None and name in self.fields:
                out.setdefault(part, []).append(name)
        return out if len(out) > 1 else {}

    @functools.cached_property
    def shared(self) -> list[str]:
        """The fields that affect every launch (all of them for a one-launch config)."""
        owned = {f for fs in self.parts.values() for f in fs}
        return [n for n, _ in self.choices if n not in owned]

    def compose(self, records: Iterable[tuple[Mapping[str, Any], Mapping[str, float]]],
                ) -> list[tuple[float, dict[str, Any]]]:
        """Recombine measured configs part by part, best predicted first.

        ``records`` are (params, {part: median ms}) of configs that ran. The launches of a
        multi-kernel config run one after another and each depends only on its own
        fields, so its time is close to the sum of its parts' times. Among records that
        agree on the shared fields, the fastest setting of each part is taken; the
        result is ``[(predicted ms, params), ...]``, one per shared-field setting.
        """
        parts = self.parts
        if not parts:
            return []
        shared = self.shared
        groups: dict[tuple[Any, ...], dict[str, tuple[float, dict[str, Any]]]] = {}
        for params, times in records:
            if not self.contains(params) or any(p not in times for p in parts):
                continue
            best = groups.setdefault(tuple(params[n] for n in shared), {})
            for part, fs in parts.items():
                t = float(times[part])
                if part not in best or t < best[part][0]:
                    best[part] = (t, {f: params[f] for f in fs})
        out = []
        for key, best in groups.items():
            point = dict(zip(shared, key, strict=True))
            for _, fields in best.values():
                point.update(fields)
            out.append((sum(t for t, _ in best.values()),
                        {n: point[n] for n, _ in self.choices}))
        return sorted(out, key=lambda x: x[0])

    def part_setting(self, part: str, params: Mapping[str, Any]) -> tuple[Any, ...]:
        """What identifies one launch's timing: its own fields and the shared ones."""
        own = set(self.parts[part]) | set(self.shared)
        return (part, *(params[n] for n, _ in self.choices if n in own))

    def part_moves(self, base: Mapping[str, Any], tried: set[tuple[Any, ...]],
                   radius: int = 1) -> dict[str, Any] | None:
        """``base`` with every launch's fields moved ``radius`` steps (as in
        :meth:`neighbours`) to a setting of that launch not in ``tried``
        (:meth:`part_setting` values), all launches at once: one trial then explores a
        neighbour of each launch, since each launch is timed on its own. None when no
        launch has an untried setting at that distance."""
        if not self.parts:
            return None
        point = {n: base[n] for n, _ in self.choices}
        moved = False
        for part, fields in self.parts.items():
            for cand in self.neighbours(base, radius, among=fields):
                if self.part_setting(part, cand) not in tried:
                    point.update({n: cand[n] for n in fields})
                    moved = True
                    break
        return point if moved else None

    def feasible(self, cfg: Config, problem: Problem) -> tuple[bool, str]:
        """(True, "") or (False, the kernels' reason for rejecting ``cfg``): the
        feasibility rules, and for the Hopper backward its launch's shared-memory plan."""
        ok, why = is_feasible(cfg, problem)
        if ok and isinstance(cfg, BwdConfig) and cfg.variant == BWD_HOPPER:
            # Importable here: the rules passed, so Gluon's Hopper API is present.
            from flashtune.kernels.attn_bwd_hopper import check_launch_plan

            try:
                check_launch_plan(cfg, problem.head_dim, problem.deterministic)
            except InfeasibleConfigError as e:
                return False, str(e)
        return ok, why

    def grid(self) -> Iterator[dict[str, Any]]:
        """Every point of the space, in a fixed order."""
        names = [n for n, _ in self.choices]
        for vals in itertools.product(*(v for _, v in self.choices)):
            yield dict(zip(names, vals, strict=True))

    def feasible_grid(self, problem: Problem) -> list[dict[str, Any]]:
        return [p for p in self.grid() if self.feasible(self.config(p), problem)[0]]
