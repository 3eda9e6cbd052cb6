"""The GPU clock sampler (`flashtune.gpu_clocks`): the summaries, the windows and their
nesting, a failing read, its absence on a machine without NVML, and on a GPU the real
NVML. The window tests drive the sampling thread with a reader of known values; the NVML
calls themselves are tested only on a GPU."""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch

from flashtune.gpu_clocks import (
    ClockSampler,
    NvmlError,
    Sample,
    _Nvml,
    reason_names,
    summarize,
)


def test_summary_of_samples() -> None:
    mhz = [1980, 1755, 1830, 1980, 1695]
    watts = [402.0, 699.5, 650.25, 380.0, 700.0]
    samples = [Sample(float(i), m, w, 40 + i, r)
               for i, (m, w, r) in enumerate(zip(mhz, watts, [0, 0x4, 0x4, 0, 0x4 | 0x20],
                                                 strict=True))]
    s = summarize(samples)
    assert s is not None
    assert s["samples"] == 5 and s["idle"] == 0
    assert s["sm_mhz"] == {"median": statistics.median(mhz), "min": min(mhz), "max": max(mhz)}
    assert s["power_w"] == {"median": round(statistics.median(watts), 1), "max": max(watts)}
    assert s["temp_c_max"] == 44
    assert s["reasons"] == ["sw_power_cap", "sw_thermal"]
    assert summarize([]) is None


def test_summary_leaves_out_the_idle_samples() -> None:
    """A timing's compiles leave the GPU idle at a low clock: those samples are counted but
    not summarized, unless every sample was idle."""
    samples = [Sample(0.0, 345, 90.0, 30, 0x1), Sample(1.0, 1980, 500.0, 40, 0),
               Sample(2.0, 1830, 690.0, 41, 0x4), Sample(3.0, 345, 95.0, 35, 0x1 | 0x4)]
    s = summarize(samples)
    assert s is not None and s["samples"] == 4 and s["idle"] == 2
    assert s["sm_mhz"] == {"median": statistics.median([1980, 1830]), "min": 1830,
                           "max": 1980}
    assert s["power_w"]["max"] == 690.0
    assert s["reasons"] == ["idle", "sw_power_cap"]
    only_idle = summarize(samples[:1])
    assert only_idle is not None and only_idle["idle"] == 1
    assert only_idle["sm_mhz"]["median"] == 345


def test_reason_names_keep_unknown_bits() -> None:
    assert reason_names(0) == []
    assert reason_names(0x1 | 0x80) == ["idle", "hw_power_brake"]
    assert reason_names(0x4 | 0x10000) == ["sw_power_cap", "0x10000"]


class _Counter:
    """A reader of known values: the n-th sample reads n MHz."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.n = 0
        self.fail_after = fail_after
        self.closed = False
        self.lock = threading.Lock()

    def read(self) -> Sample:
        with self.lock:
            self.n += 1
            if self.fail_after is not None and self.n > self.fail_after:
                raise NvmlError("nvmlDeviceGetClockInfo failed: GPU is lost")
            return Sample(time.perf_counter(), self.n, 100.0, 30, 0)

    def close(self) -> None:
        self.closed = True


def _wait_for(pred, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "the sampling thread made no progress"
        time.sleep(0.001)


def test_windows_see_only_their_own_samples_and_nest() -> None:
    reader = _Counter()
    with ClockSampler(reader, period_s=0.001) as sampler:  # type: ignore[arg-type]
        assert sampler.available
        _wait_for(lambda: reader.n >= 3)  # read while no window was open: dropped
        before_outer = reader.n
        with sampler.window() as outer:
            _wait_for(lambda: reader.n >= before_outer + 3)
            before_inner = reader.n
            with sampler.window() as inner:
                _wait_for(lambda: reader.n >= before_inner + 3)
            after_inner = reader.n
            _wait_for(lambda: reader.n >= after_inner + 3)
        after_outer = reader.n
        _wait_for(lambda: reader.n >= after_outer + 3)  # between windows: dropped
        before_later = reader.n
        with sampler.window() as later:
            _wait_for(lambda: reader.n >= before_later + 2)
        after_later = reader.n
    assert reader.closed
    outer_mhz = [s.sm_mhz for s in outer.samples]
    inner_mhz = [s.sm_mhz for s in inner.samples]
    later_mhz = [s.sm_mhz for s in later.samples]
    # A window holds what was read while it was open: not before, not after.
    assert before_outer < min(outer_mhz) and max(outer_mhz) <= after_outer
    assert before_inner < min(inner_mhz) and max(inner_mhz) <= after_inner
    assert before_later < min(later_mhz) and max(later_mhz) <= after_later
    assert set(inner_mhz) < set(outer_mhz)  # nested: a strict part of the outer one
    assert outer_mhz == sorted(outer_mhz) and len(outer_mhz) >= 6
    summary = outer.summary()
    assert summary is not None
    assert summary["sm_mhz"] == {"median": statistics.median(outer_mhz),
                                 "min": min(outer_mhz), "max": max(outer_mhz)}


def test_a_failing_read_stops_sampling_and_says_why() -> None:
    reader = _Counter(fail_after=2)
    with ClockSampler(reader, period_s=0.001) as sampler:  # type: ignore[arg-type]
        with sampler.window() as w:
            _wait_for(lambda: sampler.error is not None)
    assert "GPU is lost" in (sampler.error or "")
    assert len(w.samples) <= 2


def test_unavailable_sampler_records_nothing() -> None:
    sampler = ClockSampler(None, reason="no driver")
    assert not sampler.available and sampler.reason == "no driver"
    with sampler, sampler.window() as w:
        time.sleep(0.01)
    assert w.samples == [] and w.summary() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_without_a_gpu_the_sampler_is_unavailable_with_a_reason() -> None:
    sampler = ClockSampler.for_cuda_device(0)
    assert not sampler.available
    assert sampler.reason


def _nvml_loadable() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_nvml_loadable(), reason="a machine without the NVIDIA driver")
def test_without_the_driver_nvml_says_what_is_missing() -> None:
    with pytest.raises(NvmlError, match="NVML library is not loadable"):
        _Nvml(None, 0)


@pytest.mark.gpu
def test_on_a_gpu_the_clocks_of_a_busy_loop_are_sampled() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sampler = ClockSampler.for_cuda_device(torch.cuda.current_device(), period_s=0.01)
    assert sampler.available, sampler.reason
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with sampler, sampler.window() as w:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            a @ a
        torch.cuda.synchronize()
    s = w.summary()
    assert s is not None and s["samples"] >= 10, s
    assert 100 <= s["sm_mhz"]["min"] <= s["sm_mhz"]["median"] <= s["sm_mhz"]["max"] <= 5000
    assert s["power_w"]["max"] > 0



_FAKE_NVML = r"""
#include <string.h>
typedef void *dev_t_;
static unsigned reads = 0;
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int s) { return s == 15 ? "GPU is lost" : "Not Found"; }
int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, dev_t_ *h) {
    if (strcmp(bus, "00000000:17:00.0") != 0) return 6;
    *h = (dev_t_)0x1234; return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned i, dev_t_ *h) {
    if (i != 0) return 6;
    *h = (dev_t_)0x1234; return 0;
}
int nvmlDeviceGetClockInfo(dev_t_ h, int type, unsigned *mhz) {
    if (h != (dev_t_)0x1234 || type != 1) return 2;
    if (++reads > FAIL_AFTER) return 15;
    *mhz = 1700 + reads; return 0;
}
int nvmlDeviceGetPowerUsage(dev_t_ h, unsigned *mw) { *mw = 612345; return 0; }
int nvmlDeviceGetCurrentClocksEventReasons(dev_t_ h, unsigned long long *r) {
    *r = 0x4; return 0;
}
"""


def _fake_nvml(tmp_path, fail_after: int = 1000) -> str:
    """A stand-in for the driver's NVML library, built here, with the calls the sampler
    makes (no temperature call: an optional one) and known answers."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    src, lib = tmp_path / "nvml.c", tmp_path / f"libfakenvml{fail_after}.so"
    src.write_text(_FAKE_NVML)
    subprocess.run([cc, "-shared", "-fPIC", f"-DFAIL_AFTER={fail_after}", "-o", str(lib),
                    str(src)], check=True)
    return str(lib)


def test_nvml_calls_through_ctypes(tmp_path) -> None:
    """The ctypes calls' arguments and outputs, against a library of known answers: the
    handle by bus id or index, the clock, power in watts, a missing optional call, the
    reasons, and a failing call's error text."""
    lib = _fake_nvml(tmp_path)
    nvml = _Nvml("00000000:17:00.0", 0, library=lib)
    s = nvml.read()  # the constructor read once already
    assert (s.sm_mhz, s.power_w, s.temp_c, s.reasons) == (1702, 612.345, -1, 0x4)
    nvml.close()
    assert _Nvml(None, 0, library=lib).read().sm_mhz > 1700
    with pytest.raises(NvmlError, match=r"ByPciBusId_v2\(00000000:18:00.0\) failed: Not Found"):
        _Nvml("00000000:18:00.0", 0, library=lib)


def test_a_gpu_lost_mid_run_stops_the_sampler_with_nvmls_words(tmp_path) -> None:
    lib = _fake_nvml(tmp_path, fail_after=200)
    with ClockSampler(_Nvml(None, 0, library=lib), period_s=0.001) as sampler:
        with sampler.window() as w:
            _wait_for(lambda: sampler.error is not None)
    assert sampler.error == "NvmlError: nvmlDeviceGetClockInfo failed: GPU is lost"
    mhz = [x.sm_mhz for x in w.samples]  # reads 2-200 (the constructor's was the first)
    assert mhz and mhz == list(range(mhz[0], mhz[0] + len(mhz)))
    assert 1702 <= mhz[0] and mhz[-1] == 1900  # up to the last read that answered
