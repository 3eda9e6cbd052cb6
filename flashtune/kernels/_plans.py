"""Per-call Python work, cached by the call's signature.

A :class:`Plan` holds what one call signature needs and no data pointer changes:
the validated options, the forced or resolved configs, the problem's key family, and
the prepared launches (:class:`~flashtune.kernels.attn_fwd.FwdLaunch`,
:class:`~flashtune.kernels.attn_bwd.BwdLaunch`, each launching through kernels bound
once). A call whose signature was seen before looks its plan up and then only allocates
outputs, reads data pointers and launches.

The signature is everything validation and config selection read: the shapes, strides,
dtypes and devices of the tensors, and the scalar arguments *with their types* (``1``
is not ``True`` to the validation, so it must not be to the cache either). Launches are
kept only for 16-byte aligned data, the class they were prepared for; other calls
prepare a launch of their own, as every call did before.

Config selection goes through a resolver hook (the heuristic defaults, or the
dispatcher's lookup once :func:`flashtune.dispatch.install` ran). A plan remembers
what the resolver chose, so whoever changes the resolver's answers says which
decisions to forget (:func:`forget`): the dispatcher does on a database reload, on a
new tuned entry and per device. Forced configs (``config=``) are never forgotten.
Nothing is remembered during CUDA-graph capture (the dispatcher may answer from
memory there without remembering), and nothing of this runs under torch.compile
tracing: the traced graph holds the custom op, whose implementation uses the same
plans at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from flashtune.kernels import _native
from flashtune.kernels._bound import aligned, hooked
from flashtune.kernels.attn_bwd import BwdLaunch
from flashtune.kernels.attn_fwd import FwdLaunch, Packed
from flashtune.kernels.config import BwdConfig, FwdConfig, default_config
from flashtune.problem import Problem

Config = FwdConfig | BwdConfig
# (direction, q, k, causal, window, softcap, deterministic) -> config.
Resolver = Callable[[str, torch.Tensor, torch.Tensor, bool, tuple[int, int], float, bool],
                    Config]
ProblemResolver = Callable[[str, Problem, torch.device], Config]
MAX_PLANS = 4096  # per cache; past it the cache starts over (shapes that never repeat)


def heuristic_resolver(direction: str, q: torch.Tensor, k: torch.Tensor, causal: bool,
                       window: tuple[int, int], softcap: float,
                       deterministic: bool = True) -> Config:
    p = Problem.from_tensors(q, k, causal=causal, window_size=window, softcap=softcap,
                             deterministic=deterministic)
    return default_config(direction, p)


def heuristic_problem_resolver(direction: str, problem: Problem,
                               device: torch.device) -> Config:
    return default_config(direction, problem)


class _Resolvers:
    dense: Resolver = heuristic_resolver
    varlen: ProblemResolver = heuristic_problem_resolver


def set_resolvers(dense: Resolver | None, varlen: ProblemResolver | None) -> None:
    """Install the functions that pick a config where the caller forces none (None: the
    heuristic). Every remembered decision is forgotten."""
    _Resolvers.dense = dense if dense is not None else heuristic_resolver
    _Resolvers.varlen = varlen if varlen is not None else heuristic_problem_resolver
    forget()


def resolvers() -> tuple[Resolver, ProblemResolver]:
    return _Resolvers.dense, _Resolvers.varlen


class Plan:
    """One call signature: options, configs and prepared launches.

    ``maxlen`` is (max_seqlen_q, max_seqlen_k) for a varlen signature (its prefix sums are
    passed per call), None for a dense one; ``fwd_cfg`` / ``bwd_cfg`` are the forced
    configs (None: resolve). The resolved launches live in ``fwd`` and ``bwd`` (by the
    strides and dtype of dO and O) until forgotten.
    """

    __slots__ = ("device", "causal", "scale", "window", "cap", "deterministic", "fwd_cfg",
                 "bwd_cfg", "maxlen", "problem", "fwd", "bwd", "config", "native", "programs",
                 "fwd_native")

    def __init__(self, problem: Problem, device: torch.device, causal: bool, scale: float,
                 window: tuple[int, int], cap: float, deterministic: bool,
                 fwd_cfg: FwdConfig | None, bwd_cfg: BwdConfig | None,
                 maxlen: tuple[int, int] | None = None, config: Any = None) -> None:
        self.problem = problem
        self.device = device
        self.causal, self.scale, self.window, self.cap = causal, scale, window, cap
        self.deterministic = deterministic
        self.fwd_cfg, self.bwd_cfg = fwd_cfg, bwd_cfg
        self.maxlen = maxlen
        self.fwd: FwdLaunch | None = None
        self.bwd: dict[Hashable, BwdLaunch] = {}
        self.config = config  # the public call's config argument, as given
        # The C++ backward node's view of this plan (``_native``): its programs, one per
        # entry of ``bwd`` that could be made one (``programs``: the keys tried).
        self.native: Any = None
        self.programs: set[Hashable] = set()
        # The extension's program of ``fwd`` and its launcher; () none can be made; None
        # not tried yet.
        self.fwd_native: tuple[Any, ...] | None = None

    def native_handle(self, ext: Any) -> Any:
        """The extension's per-plan object the C++ nodes of this plan share."""
        if self.native is None:
            self.native = ext.PlanNative()
        return self.native

    def _resolve(self, direction: str, q: torch.Tensor, k: torch.Tensor) -> Config:
        if self.maxlen is None:
            return _Resolvers.dense(direction, q, k, self.causal, self.window, self.cap,
                                    self.deterministic)
        return _Resolvers.varlen(direction, self.problem, q.device)

    def _packed(self, cu: tuple[torch.Tensor, ...]) -> Packed | None:
        if self.maxlen is None:
            return None
        return Packed(cu[0], cu[1], *self.maxlen)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                *cu: torch.Tensor, lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """O and the LSE (``cu``: the prefix sums of a varlen signature). ``lse=False``: the
        caller drops the LSE, which may then be a scratch buffer, not this call's."""
        launch = self.fwd
        if launch is None or not aligned(q, k, v, *cu):
            cfg = self.fwd_cfg if self.fwd_cfg is not None else self._resolve("fwd", q, k)
            assert isinstance(cfg, FwdConfig)
            launch = FwdLaunch(q, k, v, causal=self.causal, sm_scale=self.scale,
                               window=self.window, softcap=self.cap, config=cfg,
                               packed=self._packed(cu))
            if aligned(q, k, v, *cu) and (self.fwd_cfg is not None or _remembering(q.device)):
                self.fwd = launch
                self.fwd_native = None
        elif self.fwd_native and not hooked():
            if cu:
                return self.fwd_native[1](self.fwd_native[0], q, k, v, cu[0], cu[1], lse)
            return self.fwd_native[1](self.fwd_native[0], q, k, v, None, None, lse)
        cu_q, cu_k = cu if cu else (None, None)
        out = launch(q, k, v, cu_q, cu_k, lse=lse)
        if self.fwd_native is None and launch is self.fwd and q.is_cuda:
            # Bound now: the extension may allocate and launch it from here on.
            ext = _native.module()
            if ext is not None:
                program = _native.forward_program(ext, launch, q, bool(cu))
                self.fwd_native = (program, ext.forward) if program is not None else ()
            elif _native.settled():  # switched off, or the build failed: never
                self.fwd_native = ()
        return out

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, *cu: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK and dV."""
        key = (do.stride(), do.dtype, o.stride())
        ok = aligned(do, q, k, v, o, lse, *cu)
        launch = self.bwd.get(key) if ok else None
        if launch is None:
            cfg = self.bwd_cfg if self.bwd_cfg is not None else self._resolve("bwd", q, k)
            assert isinstance(cfg, BwdConfig)
            launch = BwdLaunch(do, q, k, v, o, causal=self.causal, sm_scale=self.scale,
                               window=self.window, softcap=self.cap, config=cfg,
                               packed=self._packed(cu), deterministic=self.deterministic)
            if ok and (self.bwd_cfg is not None or _remembering(q.device)):
                self.bwd[key] = launch
        grads = launch(do, q, k, v, o, lse, *cu)
        if self.native is not None and key not in self.programs and self.bwd.get(key) is launch:
            # Bound now: the C++ node may launch it from here on (_native.add_program).
            self.programs.add(key)
            _native.add_program(self.native, launch, do, q, k, v, o, lse)
        return grads

    def forget(self, family: tuple[Any, ...] | None = None) -> bool:
        """Drop the resolved launches (of the direction whose key family is ``family``; of
        both with None). Forced configs stay. True if anything was dropped."""
        dropped = False
        if self.fwd_cfg is None and self.fwd is not None and self._matches("fwd", family):
            self.fwd, self.fwd_native, dropped = None, None, True
        if self.bwd_cfg is None and self.bwd and self._matches("bwd", family):
            self.bwd.clear()
            self.programs.clear()
            if self.native is not None:
                self.native.clear()
            dropped = True
        return dropped

    def _matches(self, direction: str, family: tuple[Any, ...] | None) -> bool:
        return family is None or self.problem.key(direction).family() == family


def _remembering(device: torch.device) -> bool:
    """False inside CUDA-graph capture: a decision made there is not remembered."""
    if device.type != "cuda":
        return True
    return not torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------- the caches

# "call": the public functions' arguments as given (validated on first sight);
# "op": the custom ops' normalised arguments (torch.compile's graphs, the SDPA paths).
caches: dict[str, dict[Hashable, Plan]] = {"call": {}, "op": {}}


def remember(cache: dict[Hashable, Plan], key: Hashable | None, plan: Plan) -> Plan:
    if key is not None:
        if len(cache) >= MAX_PLANS:
            cache.clear()
        cache[key] = plan
    return plan


def forget(device: torch.device | None = None, family: tuple[Any, ...] | None = None) -> int:
    """Forget resolved decisions: every plan's (no arguments), one device's, and/or those
    whose problem key family (:meth:`~flashtune.problem.ProblemKey.family`, direction
    included) is ``family``. Returns how many plans dropped a launch."""
    n = 0
    for cache in caches.values():
        for plan in cache.values():
            if device is None or plan.device == device:
                n += plan.forget(family)
    return n
