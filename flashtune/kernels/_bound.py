"""Launch a jit kernel through its compiled kernel, bound once.

``kernel[grid](*args, **kwargs)`` (``JITFunction.run``) binds the arguments, computes
the specialization key and looks the compiled kernel up on every launch: tens of
microseconds of Python for a kernel that may run for five. A :class:`BoundLaunch` holds
one launch of one kernel with everything but the data pointers fixed (grid, scalars,
constexprs, launch options). Its first launch on a device goes through ``kernel[grid]``,
which compiles (or finds) the kernel for that specialization and returns the
``CompiledKernel``; later launches on that device call the compiled kernel's launcher
directly, with the argument list ``JITFunction.run`` itself hands it: every parameter
in declaration order, constexprs included. That call has the same form in Triton 3.6
and 3.9 (``run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *args)``), and serves Gluon kernels as it serves Triton ones.

What the specialization depends on:

- ints and floats are fixed in a BoundLaunch, so their specialization (== 1, divisible
  by 16, i32 / i64) is too;
- pointers specialize on 16-byte alignment: a launch binds only when every pointer is
  16-byte aligned, and takes the bound path only when they all still are;
- the device is the current CUDA device, as in ``JITFunction.run``: one binding each.

Anything else goes through ``kernel[grid]``: Triton's CPU interpreter (CI), a launch hook
(a profiler) installed, a kernel whose parameters cannot be listed, or a compiled kernel
without the launcher attributes this relies on. Those launches are correct, only slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flashtune._env import interpreting

ALIGN = 16  # bytes: Triton specializes pointer arguments on 16-byte alignment

# How launches went, for tests and diagnostics: "bound" through a compiled kernel,
# "jit" through kernel[grid], "bind" the jit launches that bound a compiled kernel.
counts = {"bound": 0, "jit": 0, "bind": 0}


def _runtime_knobs() -> Any:
    try:
        from triton import knobs

        return knobs.runtime
    except (ImportError, AttributeError):  # pragma: no cover - older Triton: no knobs
        return None


class _Driver:
    """Triton's current device and stream, looked up once (the GPU driver loads lazily)."""

    device: Any = None
    stream: Any = None

    @classmethod
    def load(cls) -> None:
        from triton.runtime import driver

        cls.device = driver.active.get_current_device
        cls.stream = driver.active.get_current_stream


def _hooked(rt: Any) -> bool:
    """True when a launch hook is installed (a profiler): launch as Triton does then."""
    if rt is None:
        return True
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class BoundLaunch:
    """One launch of ``kernel`` with everything but its leading pointer arguments fixed.

    ``args`` are the kernel's positional arguments, the first ``n_dynamic`` of them
    placeholders (any value); ``kwargs`` its constexprs and launch options. Calling it with
    one value per placeholder (tensors, or host tensor descriptors) launches on the current
    stream. A launch made from 16-byte aligned tensors must be called with aligned ones
    (:func:`aligned`): the compiled kernel it binds assumes so, as Triton's would.
    """

    __slots__ = ("kernel", "grid", "args", "kwargs", "n_dynamic", "is_tensor", "tail",
                 "bound", "compiled", "rt")

    def __init__(self, kernel: Any, grid: Sequence[int], args: Sequence[Any],
                 kwargs: dict[str, Any], n_dynamic: int) -> None:
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.args = list(args)
        self.kwargs = kwargs
        self.n_dynamic = n_dynamic
        self.is_tensor: tuple[bool, ...] = ()
        self.bound: dict[int, tuple[Any, Any, Any]] = {}
        self.compiled: dict[int, Any] = {}  # the CompiledKernel bound, by device
        self.rt = None if interpreting() else _runtime_knobs()
        self.tail = self._tail() if self.rt is not None else None

    def _tail(self) -> tuple[Any, ...] | None:
        """The values of every parameter after the placeholders, in declaration order,
        constexprs included: with the pointers, what ``JITFunction.run`` passes the
        launcher. None if the parameters cannot be listed."""
        names = getattr(self.kernel, "arg_names", None)
        n = len(self.args)
        if not isinstance(names, list) or len(names) < n:
            return None
        rest = names[n:]
        if set(rest) - set(self.kwargs):
            return None
        return tuple(self.args[self.n_dynamic:]) + tuple(self.kwargs[name] for name in rest)

    def __call__(self, *values: Any) -> None:
        if self.bound and not _hooked(self.rt):
            device = _Driver.device()
            bound = self.bound.get(device)
            if bound is not None:
                ptrs = [x.data_ptr() if t else x
                        for x, t in zip(values, self.is_tensor, strict=True)]
                run, function, metadata = bound
                counts["bound"] += 1
                run(*self.grid, _Driver.stream(device), function, metadata, None, None, None,
                    *ptrs, *self.tail)  # type: ignore[misc]
                return
        self._jit(values)

    def _jit(self, values: Sequence[Any]) -> None:
        args = list(values) + self.args[self.n_dynamic:]
        counts["jit"] += 1
        compiled = self.kernel[self.grid](*args, **self.kwargs)
        if self.tail is None:
            return
        self.is_tensor = tuple(isinstance(x, torch.Tensor) for x in values)
        run = getattr(compiled, "run", None)
        function = getattr(compiled, "function", None)
        metadata = getattr(compiled, "packed_metadata", None)
        tensors = [x for x in values if isinstance(x, torch.Tensor)]
        if run is None or function is None or metadata is None or not aligned(*tensors):
            return
        if _Driver.device is None:
            _Driver.load()
        device = _Driver.device()
        self.bound[device] = (run, function, metadata)
        self.compiled[device] = compiled
        counts["bind"] += 1


_KNOBS: list[Any] = []


def hooked() -> bool:
    """True when Triton has a launch hook installed (a profiler): a launch must then go
    through ``kernel[grid]``, which calls it. False under the interpreter (nothing binds)."""
    if not _KNOBS:
        _KNOBS.append(None if interpreting() else _runtime_knobs())
    rt = _KNOBS[0]
    return rt is not None and _hooked(rt)


def aligned(*ts: torch.Tensor) -> bool:
    """True when every tensor's data is 16-byte aligned: the pointer class a prepared launch
    (``FwdLaunch``, ``BwdLaunch``, ``HopperLaunch``) serves."""
    for t in ts:  # a plain loop: this runs on every call
        if t.data_ptr() % ALIGN:
            return False
    return True


def template(descriptor: Any) -> Any:
    """A host tensor descriptor made a template for :func:`descriptor_like`: it keeps its
    shape, strides, block and layout, and lets its tensor go."""
    descriptor.base = None
    return descriptor


def descriptor_like(template: Any, t: torch.Tensor) -> Any:
    """A copy of the host tensor descriptor ``template`` over ``t``'s data. The shape,
    strides and block were checked when the template was made; ``t`` has the same ones and
    a 16-byte aligned base (the caller checked), so the dataclass checks are not redone."""
    d = object.__new__(type(template))
    d.__dict__.update(template.__dict__)
    d.base = t
    return d
