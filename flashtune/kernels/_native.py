"""The eager backward node in C++ (``_native_node.cpp``): its build, its loading, and the
programs it runs.

Why: at tiny shapes a training step is host-bound, and a Python autograd node makes the
autograd engine's device thread take the GIL and run the interpreter for every backward.
The C++ node runs a plan's backward without Python once that plan's launches are bound:
the first backward of a call signature runs :meth:`Plan.backward` (through the GIL, as the
Python node did), and :func:`add_program` then hands the node the bound launches as a
*program* (kernel handles, grids, immediates and which tensor each pointer is).

The extension is compiled once per torch build (its headers are the ABI) into flashtune's
cache folder (``FLASHTUNE_NATIVE_DIR`` names another), with the system C++ compiler and
torch's headers; no CUDA toolkit is needed. Compiling takes 20-60 s. ``FLASHTUNE_NATIVE``
says when:

- ``auto`` (unset): use a build already in the cache; if there is none, build it in a
  background thread on the first CUDA call, and serve the Python node and launches until it
  is ready;
- ``1``: build (or load) on the first call that needs it, and wait for it;
- ``0``: never; the Python node only.

Anything that fails (no compiler, no headers, a compile error) leaves the Python node in
place, with the reason in :func:`status`. Programs are made only for Triton releases whose
launcher convention the node reproduces (:data:`LAUNCHER_VERSIONS`), and only for the
bound portable kernels (no tensor descriptors, no launch attributes). The same module also
runs a plan's bound portable forward (:func:`forward_program`): O and the LSE allocated and
the kernel launched in C++, instead of through Triton's Python launcher.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from flashtune._env import cache_home

SOURCE = Path(__file__).with_name("_native_node.cpp")
MODULE = "flashtune_native"
ENV = "FLASHTUNE_NATIVE"
DIR_ENV = "FLASHTUNE_NATIVE_DIR"  # the builds' folder (default: flashtune's cache folder)
# Triton releases whose CUDA launcher passes the non-constexpr arguments in order, then a
# global and a profile scratch pointer, through cuLaunchKernelEx (3.6's driver.py).
LAUNCHER_VERSIONS = ("3.6.",)
# The tensors a program's pointers may name, in the node's slot order.
SLOTS = ("q", "k", "v", "o", "do", "lse", "delta", "dq", "dk", "dv", "cu_q", "cu_k")


class _State:
    module: Any = None
    error: str | None = None
    building: threading.Thread | None = None
    loaded: dict[str, Any] = {}
    path: Path | None = None
    lock = threading.Lock()


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value in ("1", "true", "yes", "on", "sync"):
        return "sync"
    return "auto"


def build_dir() -> Path:
    """Where the build lives: one folder per (source, torch, Python, platform)."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode(),
                 sysconfig.get_platform().encode(), str(Path(torch.__file__).parent).encode()):
        h.update(part)
        h.update(b"\0")
    root = os.environ.get(DIR_ENV) or os.path.join(cache_home(), "flashtune", "native")
    return Path(root) / h.hexdigest()[:16]


def _library() -> Path:
    """The library's path (hashing the source: computed once, until :func:`reset`)."""
    if _State.path is None:
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        _State.path = build_dir() / f"{MODULE}{suffix}"
    return _State.path


def compile_command(output: Path) -> list[str]:
    """The compiler invocation: one translation unit against torch's headers and libraries,
    with the ABI flags torch's own extension builder uses."""
    from torch.utils import cpp_extension as ext

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++ on PATH, or CXX)")
    flags = ["-O2", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden",
             f"-DTORCH_EXTENSION_NAME={MODULE}",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for private in ("_get_pybind11_abi_build_flags", "_get_glibcxx_abi_build_flags"):
        fn = getattr(ext, private, None)  # how torch's builder matches torch's ABI
        if fn is not None:
            with warnings.catch_warnings():  # deprecated (and empty) in newer torch
                warnings.simplefilter("ignore", DeprecationWarning)
                flags += list(fn())
    includes = [f"-I{p}" for p in (*ext.include_paths(), sysconfig.get_paths()["include"])]
    libs = [f"-L{p}" for p in ext.library_paths()] + \
        ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    return [compiler, *flags, *includes, str(SOURCE), "-o", str(output), *libs]


def _build_prefix(pid: int) -> str:
    """The temporary output's name prefix: host and process, so that a later build can
    tell a dead build's leftover from a running one's output (see :func:`_remove_leftovers`)."""
    return f".build-{socket.gethostname()}-{pid}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_leftovers(folder: Path) -> list[Path]:
    """Remove the temporary outputs of builds on this host whose process is gone (an
    interpreter that exited during a background build leaves the compiler writing one);
    the paths removed. A running build's output, and another host's (a shared home
    folder), are left alone."""
    mine = _build_prefix(0)[:-2]  # ".build-HOST-"
    removed = []
    for path in folder.glob(f"{mine}*.so"):
        pid = path.name[len(mine):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):  # a concurrent build removed it first
                path.unlink()
                removed.append(path)
    return removed


def build() -> Path:
    """Compile the extension into :func:`build_dir` (atomically: a concurrent build or a
    killed one never leaves a half-written library; the next build removes what a dead
    one left). Returns the library's path."""
    target = _library()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(target.parent)
    fd, tmp = tempfile.mkstemp(prefix=_build_prefix(os.getpid()), suffix=".so",
                               dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(compile_command(Path(tmp)), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> Any:
    if str(path) in _State.loaded:  # an extension loads once per process
        return _State.loaded[str(path)]
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    _State.loaded[str(path)] = module
    return module


def _build_and_load() -> None:
    try:
        module = _load(build())
    except Exception as e:  # the Python node stays; say why
        _State.error = f"{type(e).__name__}: {e}"
        return
    _State.module = module


def module(wait: bool | None = None) -> Any:
    """The loaded extension, or None (not built yet, switched off, or failed: :func:`status`
    says which). ``wait``: build now if needed and wait (default: by ``FLASHTUNE_NATIVE``)."""
    if _State.module is not None or _State.error is not None:
        return _State.module
    how = mode()
    if how == "off":
        return None
    if wait is None:
        wait = how == "sync"
    with _State.lock:
        if _State.module is not None or _State.error is not None:
            return _State.module
        if _library().exists() or wait:
            if _State.building is not None:
                _State.building.join()
            else:
                _build_and_load()
            return _State.module
        if _State.building is None:
            _State.building = threading.Thread(target=_build_and_load, daemon=True,
                                               name="flashtune-native-build")
            _State.building.start()
    return None


def settled() -> bool:
    """True when :func:`module` will stay None: switched off, or the build failed."""
    return _State.module is None and (_State.error is not None or mode() == "off")


def status() -> dict[str, Any]:
    """What :func:`module` has: loaded, building, failed (with the reason) or not tried."""
    if _State.module is not None:
        state = "loaded"
    elif _State.error is not None:
        state = "failed"
    elif _State.building is not None and _State.building.is_alive():
        state = "building"
    else:
        state = "off" if mode() == "off" else "not loaded"
    return {"state": state, "mode": mode(), "error": _State.error,
            "library": str(_library())}


def reset() -> None:
    """Forget the loaded module and any failure (tests); a loaded library stays mapped."""
    with _State.lock:
        if _State.building is not None:
            _State.building.join()
        _State.module = _State.error = _State.building = _State.path = None


# ----------------------------------------------------------------------------- programs


def launcher_supported() -> bool:
    import triton

    return triton.__version__.startswith(LAUNCHER_VERSIONS)


def _immediate(ty: str, value: Any) -> tuple[int, int] | None:
    """(bits, size) of a scalar argument of Triton type ``ty``, as Triton's launcher packs
    it; None for a type the node does not pass."""
    import struct

    ints = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4,
            "i64": 8, "u64": 8}
    if ty in ints:
        size = ints[ty]
        return int(value) & ((1 << (8 * size)) - 1), size
    if ty in ("fp32", "f32"):
        return struct.unpack("<I", struct.pack("<f", float(value)))[0], 4
    if ty == "fp64":
        return struct.unpack("<Q", struct.pack("<d", float(value)))[0], 8
    return None


def describe(launch: Any, slots: tuple[str, ...], device: int) -> tuple[Any, ...] | None:
    """A :class:`~flashtune.kernels._bound.BoundLaunch` bound on ``device`` as the node's
    kernel description ``(function, grid, threads, shared, params)``; ``slots`` names the
    tensor behind each of its placeholders. None when the node cannot launch it as Triton
    would (not bound, another launcher, tensor descriptors, launch attributes, scratch)."""
    bound = launch.bound.get(device)
    compiled = getattr(launch, "compiled", {}).get(device)
    if bound is None or compiled is None or launch.tail is None:
        return None
    md = compiled.metadata
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False)
            or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0)
            or getattr(md, "tensordesc_meta", None)):
        return None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict):
        return None
    types = list(signature.values())
    values = [None] * launch.n_dynamic + list(launch.tail)
    if len(types) != len(values) or len(slots) != launch.n_dynamic:
        return None
    params = []
    for i, (ty, value) in enumerate(zip(types, values, strict=True)):
        if not isinstance(ty, str):
            return None  # a tuple argument
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            if i >= launch.n_dynamic:
                return None
            params.append((SLOTS.index(slots[i]), 0, 8))
            continue
        if i < launch.n_dynamic:
            return None  # a placeholder that is not a pointer (a tensor descriptor)
        packed = _immediate(ty, value)
        if packed is None:
            return None
        params.append((-1, *packed))
    function = bound[1]
    return (int(function), list(launch.grid), 32 * int(md.num_warps), int(md.shared), params)


def add_program(native: Any, bwd: Any, do: torch.Tensor, o: torch.Tensor) -> bool:
    """Give the node the program of :class:`~flashtune.kernels.attn_bwd.BwdLaunch` ``bwd``
    (which has launched on ``do``'s device), for backwards with ``do`` and ``o``'s layouts.
    False when it has none: not a bound variant, or a launch the node cannot make."""
    from flashtune.kernels import attn_bwd

    if not getattr(bwd, "bound", False) or not bwd.launches or not launcher_supported():
        return False
    packed = bwd.maxlen is not None
    # The pointers of each step as BwdLaunch hands them over: the fused variant reads the
    # LSE where the others read delta, the deterministic variants have no dQ accumulator.
    delta = "lse" if bwd.fused else "delta"
    kernels = []
    pointers: Any = attn_bwd._pointers  # called with slot names where it takes tensors
    for name, launch in bwd.launches:
        slots = pointers(name, "q", "k", "v", "o", "do", "lse", delta, delta, delta,
                         "dq", "dk", "dv", ("cu_q", "cu_k") if packed else ("q", "q"))
        described = describe(launch, tuple(slots), do.device.index)
        if described is None:
            return False
        kernels.append(described)
    native.add(do, o, not bwd.fused, kernels)
    return True


def forward_program(ext: Any, fwd: Any, q: torch.Tensor, packed: bool) -> Any:
    """The node's program of :class:`~flashtune.kernels.attn_fwd.FwdLaunch` ``fwd`` (which
    has launched on ``q``'s device), or None: the Hopper kernel, K/V through tensor
    descriptors, or a launch the node cannot make. Its pointers, as ``FwdLaunch`` hands
    them over: q, k, v, O, the LSE, K and V again, the prefix sums (q twice when dense)."""
    if fwd.hopper is not None or fwd.descriptors is not None or not launcher_supported():
        return None
    cu = ("cu_q", "cu_k") if packed else ("q", "q")
    described = describe(fwd.launch, ("q", "k", "v", "o", "lse", "k", "v", *cu),
                         q.device.index)
    if described is None:
        return None
    return ext.forward_program(q, [described], list(fwd.lse_shape), fwd.scratch)
