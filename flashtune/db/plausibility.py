"""Physical plausibility of a tuning result: what no real measurement can claim.

Validation (:mod:`flashtune.db.validation`) checks types and ranges; this checks the
numbers against physics, so an import file cannot plant a 0 ms result that outranks
every real measurement:

- the median is at least :data:`MIN_MS` (no kernel launch completes faster);
- ``p20 <= median <= p80``;
- the TFLOP/s agrees with the median and the problem's FLOPs (the example's when the
  entry has one, else the range its buckets allow);
- neither the claimed nor the implied TFLOP/s exceeds the device's peak;
- the error is within what the correctness gate lets through.

Pure: no database, no torch. :func:`problems` lists every failed rule.
"""

from __future__ import annotations

import math

from flashtune.db.storage import Result
from flashtune.problem import MAX_BUCKET, ProblemKey

# One microsecond: the launch latency of a CUDA kernel alone is several times this.
MIN_MS = 1e-3
# Dense fp16/bf16 tensor-core peak, TFLOP/s, by compute-capability major, with headroom
# (A100 312, L40S 362, H100/H200 989, B200 2250). Other devices (the CPU interpreter,
# unknown GPUs) get the generic ceiling, above any GPU sold as of 2026.
PEAK_TFLOPS = {"7": 200.0, "8": 500.0, "9": 1200.0, "10": 3000.0, "12": 1000.0}
GENERIC_PEAK_TFLOPS = 5000.0
# The gate passes an error of at most twice PyTorch's own low-precision error plus 2e-3
# (:func:`flashtune.kernels.reference.within_rule`) on unit-normal inputs; bf16 rounding of
# outputs and gradients of order 1 stays far below this.
MAX_GATE_ERROR = 1.0
# TFLOP/s and median come from one formula (tuner: flops / median); allow rounding.
RTOL = 0.02


def peak_tflops(capability: str) -> float:
    return PEAK_TFLOPS.get(capability.split(".", 1)[0], GENERIC_PEAK_TFLOPS)


def _bucket_range(b: int) -> tuple[int, float]:
    """The sizes a bucket holds: (b/2, b], or [b, inf) at the top bucket."""
    lo = 1 if b <= 1 else b // 2 + 1
    return lo, (math.inf if b >= MAX_BUCKET else b)


def flops_range(key: ProblemKey) -> tuple[float, float]:
    """The least and most FLOPs a problem under ``key`` can have (house protocol)."""
    lo, hi = 4.0 * key.head_dim, 4.0 * key.head_dim
    for b in (key.bh_bucket, key.sq_bucket, key.sk_bucket):
        a, z = _bucket_range(b)
        lo, hi = lo * a, hi * z
    if key.packed:  # only the longest sequence is sure to be that long: one of them, one head
        lo /= _bucket_range(key.bh_bucket)[0]
    if key.causal:
        lo /= 2
    mult = 2.5 if key.direction == "bwd" else 1.0
    return lo * mult, hi * mult


def problems(r: Result) -> list[tuple[str, str]]:
    """Every plausibility rule ``r`` breaks, as (field, reason); empty when plausible."""
    out: list[tuple[str, str]] = []
    med = r.median_ms
    if not med >= MIN_MS:
        out.append(("median_ms", f"{med!r} ms is below the {MIN_MS:g} ms floor: no kernel "
                                 "launch completes that fast"))
    if not r.p20_ms <= med <= r.p80_ms:
        out.append(("median_ms", f"p20 {r.p20_ms!r} <= median {med!r} <= p80 {r.p80_ms!r} "
                                 "does not hold"))
    if r.problem is not None:
        f = r.problem.flops(r.key.direction)
        flo, fhi = f, f
    else:
        flo, fhi = flops_range(r.key)
    peak = peak_tflops(r.device.capability)
    if med > 0:
        claimed = r.tflops * 1e12 * med * 1e-3  # the FLOPs the claim implies
        if not flo * (1 - RTOL) <= claimed <= fhi * (1 + RTOL):
            want = (f"{flo / (med * 1e9):.4g}" if flo == fhi
                    else f"{flo / (med * 1e9):.4g} to {fhi / (med * 1e9):.4g}")
            out.append(("tflops", f"{r.tflops!r} contradicts the median {med!r} ms and the "
                                  f"problem's FLOPs (expected {want})"))
        if flo / (med * 1e9) > peak:
            out.append(("median_ms", f"{med!r} ms implies at least {flo / (med * 1e9):.4g} "
                                     f"TFLOP/s, above the device's peak ({peak:g})"))
    if r.tflops > peak:
        out.append(("tflops", f"{r.tflops!r} is above the device's peak ({peak:g} TFLOP/s for "
                              f"capability {r.device.capability})"))
    if not r.max_error <= MAX_GATE_ERROR:
        out.append(("max_error", f"{r.max_error!r} is above what the correctness gate passes "
                                 f"({MAX_GATE_ERROR:g})"))
    return out
