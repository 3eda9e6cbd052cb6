"""Device and software fingerprints: what a tuned result is valid for.

A result is stored under (device fingerprint, software fingerprint, problem key). The
device fingerprint decides *where* a config may be served; the software fingerprint
decides whether it is fresh: a result tuned under other torch/triton/CUDA versions or
other kernel sources is stale (kept, used as a warm-start seed, never served as tuned).

This module is imported on the dispatch path, so it must stay cheap: no sqlalchemy,
torch only inside the functions, and both lookups cached per process.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class SoftwareInfo:
    """The software a result was tuned under. Mirrors the ``ft_software`` table."""

    torch: str
    triton: str
    cuda: str
    kernels_hash: str

    @property
    def fingerprint(self) -> str:
        return _digest(self.torch, self.triton, self.cuda, self.kernels_hash)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def kernels_hash(root: Path = _KERNELS_DIR) -> str:
    """sha256 over the kernel package's ``*.py`` files: relative path and bytes, sorted."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=1)
def software_info() -> SoftwareInfo:
    """torch, triton and CUDA versions and the kernel-source hash, cached per process."""
    import torch

    triton = _version("triton")
    if triton == "none":
        triton = _version("pytorch-triton")
    return SoftwareInfo(torch=str(torch.__version__), triton=triton,
                        cuda=str(torch.version.cuda or "none"), kernels_hash=kernels_hash())
