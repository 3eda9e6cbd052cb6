"""The GPU's SM clock, power draw and clock-limit reasons, sampled in the background while
something is timed, through NVML (the driver's ``libnvidia-ml.so.1``, called with ctypes).

Why: a kernel's time follows the SM clock, and under a sustained load the clock sags as
the board meets its power limit. Benches that time implementations one after another
read differently from benches that interleave them (BENCHMARKS.md, issue 17, sessions
32-33), and so far that was inferred from the figures alone. With the clocks recorded
beside each timing, a row says what clock it ran at.

Nothing here needs a Python package: the NVML library comes with the NVIDIA driver.
Where it cannot be loaded (no driver, the CPU interpreter, another vendor's GPU),
:class:`ClockSampler` is unavailable and says why; a bench then records no clocks.

ctypes releases the GIL during each NVML call and the sampler sleeps between samples, so
the launching thread is barely disturbed (one sample costs tens of microseconds)."""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0

# Bits of nvmlDeviceGetCurrentClocksEventReasons (nvml.h): why the clock is below its
# maximum. Idle and the applications-clocks setting are not limits a load meets.
REASONS = {
    0x1: "idle",
    0x2: "app_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}


def reason_names(mask: int) -> list[str]:
    """The names of the reason bits set in ``mask`` (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    unknown = mask & ~sum(REASONS)
    if unknown:
        names.append(hex(unknown))
    return names


@dataclass(frozen=True)
class Sample:
    t: float  # time.perf_counter() when read
    sm_mhz: int
    power_w: float
    temp_c: int
    reasons: int  # clock event reason bits (see REASONS)


@dataclass
class Window:
    """The samples taken between a window's start and end (filled in at its end)."""

    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict[str, Any] | None:
        """Median, min and max SM clock and power while busy, the hottest temperature and
        every limit reason seen; None without samples (see :func:`summarize`)."""
        return summarize(self.samples)


IDLE = 0x1


def summarize(samples: Sequence[Sample]) -> dict[str, Any] | None:
    """See :meth:`Window.summary`. The clock and power figures are over the samples taken
    while the GPU was busy (NVML's idle reason not set: a timing's compiles leave it idle,
    and an idle GPU's clock says nothing of the timed launches), or over all where none
    was; ``idle`` counts the others."""
    if not samples:
        return None
    idle = sum(1 for s in samples if s.reasons & IDLE)
    busy = [s for s in samples if not s.reasons & IDLE] or list(samples)
    mhz = [s.sm_mhz for s in busy]
    watts = [s.power_w for s in busy]
    mask = 0
    for s in samples:
        mask |= s.reasons
    return {"samples": len(samples), "idle": idle,
            "sm_mhz": {"median": statistics.median(mhz), "min": min(mhz), "max": max(mhz)},
            "power_w": {"median": round(statistics.median(watts), 1),
                        "max": round(max(watts), 1)},
            "temp_c_max": max(s.temp_c for s in samples),
            "reasons": reason_names(mask)}


class NvmlError(RuntimeError):
    """NVML could not be loaded or did not answer."""


class _Nvml:
    """The few NVML calls the sampler makes, on one device."""

    def __init__(self, pci_bus_id: str | None, index: int,
                 library: str = "libnvidia-ml.so.1") -> None:
        try:
            self.lib = ctypes.CDLL(library)
        except OSError as e:
            raise NvmlError(f"the NVIDIA driver's NVML library is not loadable ({e})") from e
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        try:
            if pci_bus_id is not None:
                self._check(self.lib.nvmlDeviceGetHandleByPciBusId_v2(
                    pci_bus_id.encode(), ctypes.byref(self.handle)),
                    f"nvmlDeviceGetHandleByPciBusId_v2({pci_bus_id})")
            else:
                self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(
                    ctypes.c_uint(index), ctypes.byref(self.handle)),
                    f"nvmlDeviceGetHandleByIndex_v2({index})")
            # Optional calls: a driver without one gives no such figure. Drivers before
            # 535 name the reasons call by throttling.
            self._power = getattr(self.lib, "nvmlDeviceGetPowerUsage", None)
            self._temp = getattr(self.lib, "nvmlDeviceGetTemperature", None)
            self._reasons = (getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
                             or getattr(self.lib, "nvmlDeviceGetCurrentClocksThrottleReasons",
                                        None))
            self.read()  # fails here, not in the sampling thread
        except BaseException:
            self.close()
            raise

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            self.lib.nvmlErrorString.restype = ctypes.c_char_p
            text = self.lib.nvmlErrorString(status)
            raise NvmlError(f"{what} failed: {text.decode() if text else status}")

    def read(self) -> Sample:
        """One sample. The SM clock must answer; power, temperature and the reasons are
        best effort (a board or driver without one reads as -1 W, -1 C, no reasons)."""
        clock, power, temp = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        reasons = ctypes.c_ulonglong()
        h = self.handle
        self._check(self.lib.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM, ctypes.byref(clock)),
                    "nvmlDeviceGetClockInfo")
        watts = (power.value / 1000.0
                 if self._power is not None and self._power(h, ctypes.byref(power)) == 0
                 else -1.0)
        celsius = (temp.value if self._temp is not None and self._temp(
            h, NVML_TEMPERATURE_GPU, ctypes.byref(temp)) == 0 else -1)
        mask = (reasons.value if self._reasons is not None
                and self._reasons(h, ctypes.byref(reasons)) == 0 else 0)
        return Sample(time.perf_counter(), clock.value, watts, celsius, mask)

    def close(self) -> None:
        self.lib.nvmlShutdown()


def cuda_pci_bus_id(index: int) -> str | None:
    """NVML's bus id ("00000000:17:00.0") of CUDA device ``index`` as this process numbers
    it (CUDA_VISIBLE_DEVICES applied), or None where torch does not say."""
    import torch

    props: Any = torch.cuda.get_device_properties(index)  # the PCI fields lack stubs
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:
        return None


class ClockSampler:
    """Reads the device's clocks every ``period_s`` in a daemon thread while started;
    :meth:`window` collects the samples of a block of code.

        with ClockSampler.for_cuda_device(0) as sampler:
            with sampler.window() as w:
                run_timings()
            print(w.summary())

    :meth:`for_cuda_device` returns an unavailable sampler (``available`` False,
    ``reason`` set) where NVML cannot be used; its windows stay empty."""

    def __init__(self, nvml: _Nvml | None, period_s: float = 0.02,
                 reason: str = "") -> None:
        self._nvml = nvml
        self.period_s = period_s
        self.reason = reason
        self._samples: list[Sample] = []
        self._open = 0  # windows open now; samples are kept only while one is
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # set if a read failed mid-run; sampling then stops

    @classmethod
    def for_cuda_device(cls, index: int, period_s: float = 0.02) -> ClockSampler:
        try:
            return cls(_Nvml(cuda_pci_bus_id(index), index), period_s)
        except Exception as e:  # optional: a bench without clocks still runs
            return cls(None, period_s, reason=f"{type(e).__name__}: {e}")

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def __enter__(self) -> ClockSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, name="flashtune-clocks",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def _run(self) -> None:
        assert self._nvml is not None
        while not self._stop.is_set():
            try:
                s = self._nvml.read()
            except Exception as e:  # the windows stay as they are; the bench goes on
                self.error = f"{type(e).__name__}: {e}"
                return
            with self._lock:
                if self._open:
                    self._samples.append(s)
            self._stop.wait(self.period_s)

    @contextmanager
    def window(self) -> Iterator[Window]:
        """The samples read while the block ran. Windows may nest (a shape's, around each
        implementation's); samples read while none is open are not kept."""
        w = Window()
        with self._lock:
            if not self._open:
                self._samples.clear()
            self._open += 1
        t0 = time.perf_counter()
        try:
            yield w
        finally:
            t1 = time.perf_counter()
            with self._lock:
                self._open -= 1
                w.samples = [s for s in self._samples if t0 <= s.t <= t1]
