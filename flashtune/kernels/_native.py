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
launcher convention the node reproduces (:data:`LAUNCHER_VERSIONS`), for the bound portable
kernels and for the Hopper backward (:func:`_add_hopper_program`: its scratch, zeroing,
tensor descriptors, KV-head partial sums and split side stream), never for launches with
launch attributes or Triton scratch. The same module also
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


# A placeholder's value in a program: (slot, byte offset, descriptor template or None). A
# slot indexes SLOTS, then the program's buffers; with a template (``_bound.template``),
# the placeholder is a host tensor descriptor over that data, encoded per call.
Arg = tuple[int, int, Any]


def _args(slots: tuple[str, ...]) -> list[Arg]:
    return [(SLOTS.index(name), 0, None) for name in slots]


def _tma_types() -> dict[int, int]:
    """Triton's map from a descriptor's element type in its metadata to the driver's."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    return dict(TMA_DTYPE_DEVICE_TO_HOST)


def describe(launch: Any, args: list[Arg], device: int) -> tuple[Any, ...] | None:
    """A :class:`~flashtune.kernels._bound.BoundLaunch` bound on ``device`` as the node's
    kernel description ``(function, grid, threads, shared, params, maps)``; ``args`` says
    what each of its placeholders is (:data:`Arg`). Pointers are passed as Triton's
    launcher passes them; a tensor descriptor as the launcher expands it (its encoded map,
    then its shape as i32 and strides as i64), the map described for
    ``cuTensorMapEncodeTiled`` with the arguments the launcher gives it. None when the node
    cannot launch it as Triton would (not bound, another launcher, launch attributes,
    scratch, a descriptor without TMA metadata)."""
    bound = launch.bound.get(device)
    compiled = getattr(launch, "compiled", {}).get(device)
    if bound is None or compiled is None or launch.tail is None:
        return None
    md = compiled.metadata
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False)
            or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0)):
        return None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict):
        return None
    metas = list(getattr(md, "tensordesc_meta", None) or [])
    types = list(signature.values())
    values = [None] * launch.n_dynamic + list(launch.tail)
    if len(types) != len(values) or len(args) != launch.n_dynamic:
        return None
    params: list[tuple[int, int, int]] = []
    maps: list[tuple[Any, ...]] = []
    for i, (ty, value) in enumerate(zip(types, values, strict=True)):
        if not isinstance(ty, str):
            return None  # a tuple argument
        if ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            if i >= launch.n_dynamic or len(maps) >= len(metas):
                return None
            slot, offset, t = args[i]
            meta = metas[len(maps)]
            if t is None or not isinstance(meta, dict) or meta.get("fp4_padded") \
                    or meta.get("is_im2col"):
                return None
            maps.append((slot, offset, _tma_types()[meta["elem_type"]], int(meta["swizzle"]),
                         int(t.padding == "nan"), int(meta["elem_size"]),
                         [int(x) for x in t.shape], [int(x) for x in t.strides],
                         [int(x) for x in meta["block_size"]]))
            params.append((-2, len(maps) - 1, 128))
            params += [(-1, *_immediate("i32", x)) for x in t.shape]  # type: ignore[misc]
            params += [(-1, *_immediate("i64", x)) for x in t.strides]  # type: ignore[misc]
            continue
        if ty.startswith("*"):
            if i >= launch.n_dynamic or args[i][2] is not None:
                return None
            params.append((args[i][0], args[i][1], 8))
            continue
        if i < launch.n_dynamic:
            return None  # a placeholder that is neither a pointer nor a descriptor
        packed = _immediate(ty, value)
        if packed is None:
            return None
        params.append((-1, *packed))
    if len(maps) != len(metas):
        return None
    function = bound[1]
    return (int(function), list(launch.grid), 32 * int(md.num_warps), int(md.shared), params,
            maps)


def add_program(native: Any, bwd: Any, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> bool:
    """Give the node the program of :class:`~flashtune.kernels.attn_bwd.BwdLaunch` ``bwd``
    (which has launched on these tensors' device), for backwards with ``do`` and ``o``'s
    layouts. False when it has none: not a bound variant, or a launch the node cannot
    make."""
    if getattr(bwd, "hopper", None) is not None:
        return _add_hopper_program(native, bwd.hopper, do, q, k, v, o, lse)
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
        described = describe(launch, _args(tuple(slots)), do.device.index)
        if described is None:
            return False
        kernels.append(described)
    native.add(do, o, not bwd.fused, kernels)
    return True


_NO_VIEW: tuple[int, int, list[int], list[int]] = (-1, 0, [], [])
LAUNCH, ZERO, SUM = 0, 1, 2  # the node's step kinds
F32, I32, LIKE_Q = 0, 1, 2  # the node's buffer dtypes


def _contiguous(shape: list[int]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def _add_hopper_program(native: Any, hop: Any, do: torch.Tensor, q: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor) -> bool:
    """The program of a prepared Hopper backward
    (:class:`~flashtune.kernels.attn_bwd_hopper.HopperBwdLaunch`, or a
    ``SplitHopperBwdLaunch`` of two): what each part's ``run`` does, in its order - the fp32
    dQ accumulator zeroed (whole, or the blocks no key tile visits), the delta preprocess,
    the semaphores zeroed, the main kernel (its tensor descriptors encoded per call), the
    KV-head partials summed into dK and dV, the dQ cast - over the part's views of the
    call's tensors (a byte offset into each), with its scratch allocated per call. The
    second part of a split runs on the node's side stream, forked from the current stream
    and joined back into it, as ``SplitHopperBwdLaunch.run`` does. False where the node
    cannot make it (no tensor-map encoder, an unbound launch, a view off 16 bytes)."""
    ext = _State.module
    if ext is None or not launcher_supported() or not ext.tma_ok() or not do.is_cuda:
        return False
    lse = lse.contiguous()  # the node serves only a contiguous LSE
    whole = dict(q=q, k=k, v=v, o=o, do=do, lse=lse, delta=torch.empty_like(lse),
                 dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
    parts = list(getattr(hop, "parts", [hop]))
    slices = list(getattr(hop, "plan", [None]))
    side = len(parts) > 1 and getattr(hop, "side", None) is not None
    buffers: list[tuple[list[int], int]] = []
    steps: list[tuple[Any, ...]] = []
    kernels: list[tuple[Any, ...]] = []
    device = do.device.index

    def buffer(shape: Any, dtype: int) -> int:
        buffers.append(([int(x) for x in shape], dtype))
        return len(SLOTS) + len(buffers) - 1

    def launch(bound: Any, args: list[Arg], stream: int) -> bool:
        described = describe(bound, args, device)
        if described is None:
            return False
        kernels.append(described)
        steps.append((LAUNCH, stream, len(kernels) - 1, _NO_VIEW, _NO_VIEW))
        return True

    def zero(slot: int, shape: list[int], offset: int = 0, sizes: list[int] | None = None,
             stream: int = 0) -> None:
        strides = _contiguous(shape)
        steps.append((ZERO, stream, -1, (slot, offset, sizes or shape, strides), _NO_VIEW))

    for i, (part, sl) in enumerate(zip(parts, slices, strict=True)):
        stream = 1 if side and i > 0 else 0
        views = dict(whole)
        if sl is not None:
            bs, hs_q, _ = sl
            views.update(zip(("do", "q", "k", "v", "o"), hop._views(sl, do, q, k, v, o),
                             strict=True))
            views.update(zip(("dq", "dk", "dv"), hop._grads(sl, whole["dq"], whole["dk"],
                                                            whole["dv"]), strict=True))
            views["lse"], views["delta"] = lse[bs, hs_q], whole["delta"][bs, hs_q]
        at = {name: (SLOTS.index(name), t.data_ptr() - whole[name].data_ptr())
              for name, t in views.items()}
        if any(offset % 16 for _, offset in at.values()):
            return False
        acc_shape = list(part.acc_shape)
        acc = buffer(acc_shape, F32)
        sem = buffer(part.sem_shape, I32) if part.turns else acc
        if part.frag:
            if part.zero_blocks is None:
                zero(acc, acc_shape, stream=stream)
            else:
                step = _contiguous(acc_shape)[1]
                for a, z in part.zero_blocks:
                    zero(acc, acc_shape, a * step, [acc_shape[0], z - a, *acc_shape[2:]],
                         stream)
        if not launch(part.pre, [(*at["o"], None), (*at["do"], None), (*at["delta"], None),
                                 (acc, 0, None)], stream):
            return False
        if part.turns:
            zero(sem, list(part.sem_shape), stream=stream)
        tq, tdo, tk, tv, tacc = part.templates
        dkdv = part.dkdv or (None, None)
        if part.kv_rep > 1:
            b, hk, sk, d = views["dk"].shape
            partial = [b, hk * part.kv_rep, sk, d]
            grads = [(buffer(partial, LIKE_Q), 0, dkdv[0]), (buffer(partial, LIKE_Q), 0, dkdv[1])]
        else:
            grads = [(*at["dk"], dkdv[0]), (*at["dv"], dkdv[1])]
        if not launch(part.main, [(*at["q"], tq), (*at["do"], tdo), (*at["k"], tk),
                                  (*at["v"], tv), (*at["lse"], part.rows),
                                  (*at["delta"], part.rows), (acc, 0, tacc), *grads,
                                  (sem, 0, None)], stream):
            return False
        if part.kv_rep > 1:
            for name, (slot, _, _) in zip(("dk", "dv"), grads, strict=True):
                t = views[name]
                b, hk, sk, d = t.shape
                into = (at[name][0], at[name][1] // t.element_size(), list(t.shape),
                        list(t.stride()))
                shape = [b, hk, part.kv_rep, sk, d]
                steps.append((SUM, stream, -1, into, (slot, 0, shape, _contiguous(shape))))
        if not launch(part.finish, [(acc, 0, None), (*at["dq"], None)], stream):
            return False
    try:
        native.add(do, o, True, kernels, buffers, steps, side)
    except (ValueError, RuntimeError) as e:  # the backward itself has run: keep it serving
        warnings.warn(f"flashtune: the C++ node refused a Hopper backward program ({e}); "
                      "the Python path serves these calls", RuntimeWarning, stacklevel=2)
        return False
    return True


def forward_program(ext: Any, fwd: Any, q: torch.Tensor, packed: bool) -> Any:
    """The node's program of :class:`~flashtune.kernels.attn_fwd.FwdLaunch` ``fwd`` (which
    has launched on ``q``'s device), or None: the Hopper kernel, K/V through tensor
    descriptors, or a launch the node cannot make. Its pointers, as ``FwdLaunch`` hands
    them over: q, k, v, O, the LSE, K and V again, the prefix sums (q twice when dense)."""
    if fwd.hopper is not None or fwd.descriptors is not None or not launcher_supported():
        return None
    cu = ("cu_q", "cu_k") if packed else ("q", "q")
    described = describe(fwd.launch, _args(("q", "k", "v", "o", "lse", "k", "v", *cu)),
                         q.device.index)
    if described is None:
        return None
    return ext.forward_program(q, [described], list(fwd.lse_shape), fwd.scratch)
