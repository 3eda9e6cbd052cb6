"""Device and software fingerprints: what a tuned result is valid for.

A result is stored under (device fingerprint, software fingerprint, problem key). The
device fingerprint decides *where* a config may be served; the software fingerprint
decides whether it is fresh. It covers what changes the generated code: the kernel
sources (a hash of their files, less the host-only wiring: :data:`HOST_ONLY_MODULES`),
the Triton version and the version of the ptxas that
Triton runs. A forward result is stored under the hash of the forward's sources alone
(every hashed module but the backward's own, :data:`BWD_ONLY_MODULES`), so a change to
the backward kernels leaves the forward's results fresh; a backward result, whose kernels
import the forward's, under the hash of them all. A result made under other ones is
stale (kept, used as a warm-start seed, never served as tuned); :func:`stale_fields`
names the fields that differ. The torch and CUDA runtime versions are kept with each
result as provenance only.

A ptxas version of ``""`` means *not recorded* (results of flashtune <= 0.1, before the
database kept it): such a result is judged by the other fields, since Triton runs the
ptxas bundled with its release unless ``TRITON_PTXAS_PATH`` says otherwise.

This module is imported on the dispatch path, so it must stay cheap: no sqlalchemy,
torch only inside the functions, and both lookups cached per process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import subprocess
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from flashtune._env import interpreting

CPU_INTERPRETER = "cpu-interpreter"
_KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"


def _digest(*parts: object) -> str:
    """A short stable id: 16 hex digits of sha256 over the parts, NUL-separated."""
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DeviceInfo:
    """One kind of accelerator. Mirrors the ``ft_devices`` table's unique columns."""

    name: str
    capability: str
    sm_count: int
    memory_gb: int

    @property
    def fingerprint(self) -> str:
        return _digest(self.name, self.capability, self.sm_count, self.memory_gb)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def matches(self, text: str) -> bool:
        """True if ``text`` is this device's fingerprint or part of its name (any case)."""
        return text == self.fingerprint or text.lower() in self.name.lower()


UNRECORDED = ""
"""The ptxas version of a result stored before the database recorded it."""
CODE_FIELDS = ("kernels_hash", "triton", "ptxas")
"""The software fields that decide freshness, in the order :func:`stale_fields` names them."""


@dataclass(frozen=True)
class SoftwareInfo:
    """The software a result was tuned under. ``triton``, ``ptxas`` and ``kernels_hash``
    (the ``ft_software`` table) make the fingerprint; ``torch`` and ``cuda`` are provenance,
    kept per result.

    ``fwd_kernels_hash`` is set on the running process's software only
    (:func:`software_info`): the hash of the sources a forward result depends on.
    :meth:`for_direction` gives the software a result of one direction is stored under."""

    torch: str
    triton: str
    cuda: str
    kernels_hash: str
    ptxas: str = UNRECORDED
    fwd_kernels_hash: str = field(default="", compare=False)

    @property
    def fingerprint(self) -> str:
        return _digest(self.triton, self.ptxas, self.kernels_hash)

    def for_direction(self, direction: str) -> SoftwareInfo:
        """The software a ``direction`` result measured under this one is stored under:
        for the forward, ``kernels_hash`` is the forward's own where known."""
        if direction == "fwd" and self.fwd_kernels_hash:
            return replace(self, kernels_hash=self.fwd_kernels_hash, fwd_kernels_hash="")
        return replace(self, fwd_kernels_hash="") if self.fwd_kernels_hash else self

    def fresh_hashes(self, direction: str | None = None) -> list[str]:
        """The stored ``kernels_hash`` values that are fresh under this software for a
        result of ``direction`` (None: either): all the sources' hash, and for the forward
        its own (a forward result stored before forward hashes, or by an older flashtune,
        carries the whole hash, which still says whether its sources are unchanged)."""
        own = [self.fwd_kernels_hash] if self.fwd_kernels_hash and direction != "bwd" else []
        return [self.kernels_hash, *own]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.fwd_kernels_hash:
            del d["fwd_kernels_hash"]
        return d


def stale_fields(stored: SoftwareInfo, current: SoftwareInfo,
                 direction: str | None = None) -> list[str]:
    """The code fields in which ``stored``, the software of a result of ``direction``,
    differs from ``current`` (empty: fresh). An unrecorded ptxas (:data:`UNRECORDED`)
    matches any; the kernels hash matches any of ``current.fresh_hashes(direction)``."""
    out = []
    for f in CODE_FIELDS:
        if f == "kernels_hash":
            # Without a direction, only the whole hash says the sources are unchanged.
            fresh = current.fresh_hashes(direction) if direction else [current.kernels_hash]
            if stored.kernels_hash not in fresh:
                out.append(f)
        elif getattr(stored, f) != getattr(current, f) \
                and not (f == "ptxas" and UNRECORDED in (stored.ptxas, current.ptxas)):
            out.append(f)
    return out


@functools.cache
def _cuda_device_info(index: int) -> DeviceInfo:
    import torch

    p = torch.cuda.get_device_properties(index)
    return DeviceInfo(name=p.name, capability=f"{p.major}.{p.minor}",
                      sm_count=p.multi_processor_count,
                      memory_gb=round(p.total_memory / 2**30))


def device_info(device: Any = None) -> DeviceInfo:
    """The fingerprint of ``device`` (default: the current CUDA device).

    Under Triton's interpreter (``TRITON_INTERPRET=1``) or without CUDA the device is
    the CPU interpreter, one device of its own whatever the host CPU is.
    """
    cpu = DeviceInfo(name=CPU_INTERPRETER, capability="cpu", sm_count=0, memory_gb=0)
    if interpreting():
        return cpu
    import torch

    if not torch.cuda.is_available():
        return cpu
    if device is None:
        index = torch.cuda.current_device()
    else:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            return cpu
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _cuda_device_info(index)


HOST_ONLY_MODULES = frozenset({"__init__.py", "_autograd.py", "_plans.py", "_bound.py",
                               "_native.py", "attention.py", "varlen.py", "reference.py"})
"""The kernel package's modules that hold no kernel and decide nothing of a launch: the
public entry points and their validation (``attention.py``, ``varlen.py``), the autograd
and custom-op wiring, the per-signature plans, the binding of compiled kernels, the C++
backward node that replays bound launches as they were prepared (``_native.py``), and the
correctness gate's fp32 reference in PyTorch (``reference.py``: it judges a config's
outputs and is imported by no kernel module, so an edit there, such as a tighter error
floor for the tests, changes no config's code or launch). What a
config compiles to (the jit sources, their constexprs and launch options) and how it is
launched (grids, scalars, buffers) are decided in the other modules, so a change here
cannot change a tuned result's code or its launch (only the host time around it), and
leaves it fresh. Every other module, and any new one, is hashed;
``tests/db/test_fingerprint.py`` checks that none of these defines a kernel or builds a
launch."""


BWD_ONLY_MODULES = frozenset({"attn_bwd.py", "attn_bwd_hopper.py", "_bwd_common.py"})
"""The backward's own modules: no module of the forward (its kernels, their launch, the
config rules, the masking helpers) imports them, so the forward's generated code and
launches cannot depend on them, and a forward result's freshness ignores them
(``tests/db/test_fingerprint.py`` checks the imports). The backward imports the forward's
modules, so a backward result's hash covers everything."""


def kernels_hash(root: Path = _KERNELS_DIR, direction: str | None = None) -> str:
    """sha256 over the kernel package's ``*.py`` files but :data:`HOST_ONLY_MODULES`
    (top level), and for ``direction="fwd"`` but :data:`BWD_ONLY_MODULES` too: relative
    path and bytes, sorted."""
    skip = HOST_ONLY_MODULES | (BWD_ONLY_MODULES if direction == "fwd" else frozenset())
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if rel in skip:
            continue
        data = path.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def _tool_version(path: str) -> str | None:
    """``release X.Y, VX.Y.Z`` of an NVIDIA tool's ``--version`` as ``X.Y.Z``; None if it
    cannot run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release [\d.]+, V([\d.]+)", out) or re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else None


def ptxas_version() -> str:
    """The version of the ptxas Triton runs (``TRITON_PTXAS_PATH``, else the one bundled
    with Triton), plus ``/bw`` and the Blackwell ptxas's where Triton ships a second one;
    ``"none"`` where there is none. Triton is located, not imported."""
    spec = importlib.util.find_spec("triton")
    root = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations \
        else None
    bundled = os.path.join(root, "backends", "nvidia", "bin") if root else None
    out: list[str] = []
    for name, env in (("ptxas", "TRITON_PTXAS_PATH"),
                      ("ptxas-blackwell", "TRITON_PTXAS_BLACKWELL_PATH")):
        paths = [p for p in (os.environ.get(env), bundled and os.path.join(bundled, name)) if p]
        found = next((v for v in map(_tool_version, paths) if v), None)
        if found:
            out.append(found if not out else f"bw{found}")
    return "/".join(out) or "none"


@functools.lru_cache(maxsize=1)
def software_info() -> SoftwareInfo:
    """torch, triton, CUDA and ptxas versions and the kernel-source hash, cached per
    process."""
    import torch

    triton = _version("triton")
    if triton == "none":
        triton = _version("pytorch-triton")
    return SoftwareInfo(torch=str(torch.__version__), triton=triton,
                        cuda=str(torch.version.cuda or "none"), kernels_hash=kernels_hash(),
                        ptxas=ptxas_version(), fwd_kernels_hash=kernels_hash(direction="fwd"))
