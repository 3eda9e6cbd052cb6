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
    """One launch of ``kernel`` with everything but the pointer arguments fixed.

    ``args`` are the kernel's positional arguments, with placeholders (any value) at the
    indices ``slots``; ``kwargs`` its constexprs and launch options. Calling it with one
    value per slot (tensors, or host tensor descriptors) launches on the current stream.
    """

    __slots__ = ("kernel", "grid", "args", "kwargs", "slots", "tensor_slots", "full",
                 "bound", "rt")

    def __init__(self, kernel: Any, grid: Sequence[int], args: Sequence[Any],
                 kwargs: dict[str, Any], slots: Sequence[int]) -> None:
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.args = list(args)
        self.kwargs = kwargs
        self.slots = tuple(slots)
        self.tensor_slots: tuple[bool, ...] = ()
        self.bound: dict[int, tuple[Any, Any, Any]] = {}
        self.rt = None if interpreting() else _runtime_knobs()
        self.full = self._full_args() if self.rt is not None else None

    def _full_args(self) -> list[Any] | None:
        """Every parameter's value in declaration order, constexprs included: what
        ``JITFunction.run`` passes the launcher. None if the parameters cannot be listed."""
        names = getattr(self.kernel, "arg_names", None)
        n = len(self.args)
        if not isinstance(names, list) or len(names) < n:
            return None
        rest = names[n:]
        if set(rest) - set(self.kwargs):
            return None
        return self.args + [self.kwargs[name] for name in rest]

    def __call__(self, *values: Any) -> None:
        full = self.full
        if full is not None and self.bound and not _hooked(self.rt):
            device = _Driver.device()
            bound = self.bound.get(device)
            if bound is not None and self._aligned(values):
                args = full.copy()
                for i, x, is_tensor in zip(self.slots, values, self.tensor_slots, strict=True):
                    args[i] = x.data_ptr() if is_tensor else x
                run, function, metadata = bound
                counts["bound"] += 1
                run(*self.grid, _Driver.stream(device), function, metadata, None, None, None,
                    *args)
                return
        self._jit(values)

    def _aligned(self, values: Sequence[Any]) -> bool:
        for x, is_tensor in zip(values, self.tensor_slots, strict=True):
            if is_tensor and x.data_ptr() % ALIGN:
                return False
        return True

    def _jit(self, values: Sequence[Any]) -> None:
        args = self.args.copy()
        for i, x in zip(self.slots, values, strict=True):
            args[i] = x
        counts["jit"] += 1
        compiled = self.kernel[self.grid](*args, **self.kwargs)
        if self.full is None:
            return
        self.tensor_slots = tuple(isinstance(x, torch.Tensor) for x in values)
        run = getattr(compiled, "run", None)
        function = getattr(compiled, "function", None)
        metadata = getattr(compiled, "packed_metadata", None)
        if run is None or function is None or metadata is None or not self._aligned(values):
            return
        if _Driver.device is None:
            _Driver.load()
        self.bound[_Driver.device()] = (run, function, metadata)
        counts["bind"] += 1


def aligned(*ts: torch.Tensor) -> bool:
    """True when every tensor's data is 16-byte aligned: the pointer class a prepared launch
    (``FwdLaunch``, ``BwdLaunch``, ``HopperLaunch``) serves."""
    return not any(t.data_ptr() % ALIGN for t in ts)


def descriptor_like(template: Any, t: torch.Tensor) -> Any:
    """A copy of the host tensor descriptor ``template`` over ``t``'s data. The shape,
    strides and block were checked when the template was made; ``t`` has the same ones and
    a 16-byte aligned base (the caller checked), so the dataclass checks are not redone."""
    d = object.__new__(type(template))
    d.__dict__.update(template.__dict__)
    d.base = t
    return d
