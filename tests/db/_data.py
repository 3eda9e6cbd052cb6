"""Test data: devices, software, keys and results, deterministic from a seed."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from flashtune.db import DeviceInfo, Result, SoftwareInfo
from flashtune.kernels.config import CONFIG_TYPES, config_fields
from flashtune.problem import Problem, ProblemKey

H200 = DeviceInfo(name="NVIDIA H200", capability="9.0", sm_count=132, memory_gb=140)
A100 = DeviceInfo(name="NVIDIA A100-SXM4-80GB", capability="8.0", sm_count=108, memory_gb=80)
CPU = DeviceInfo(name="cpu-interpreter", capability="cpu", sm_count=0, memory_gb=0)
SW = SoftwareInfo(torch="2.13.0", triton="3.9.0", cuda="12.8", kernels_hash="a" * 64)
OLD_SW = SoftwareInfo(torch="2.12.0", triton="3.8.0", cuda="12.6", kernels_hash="b" * 64)


def problem(rng: random.Random) -> Problem:
    hkv = rng.choice([1, 2, 8])
    return Problem(batch=rng.choice([1, 2, 4]), heads_q=hkv * rng.choice([1, 4]), heads_kv=hkv,
                   seqlen_q=rng.choice([97, 512, 1000, 4096]),
                   seqlen_k=rng.choice([97, 512, 1000, 4096]),
                   head_dim=rng.choice([64, 80, 128]), dtype=rng.choice(["fp16", "bf16"]),
                   causal=rng.random() < 0.5)


def config(rng: random.Random, direction: str) -> dict[str, Any]:
    """A random config dict; one draw of ``rng`` whatever the number of fields, so that a
    knob added later does not shift the rest of the data a seed makes."""
    own = random.Random(rng.random())
    return {k: own.choice(v) for k, v in config_fields(CONFIG_TYPES[direction]).items()}


def result(rng: random.Random, *, device: DeviceInfo = H200, software: SoftwareInfo = SW,
           direction: str | None = None, p: Problem | None = None, **kw: Any) -> Result:
    direction = direction or rng.choice(["fwd", "bwd"])
    p = p or problem(rng)
    # Plausible timings: at most 300 TFLOP/s, and the TFLOP/s the median implies.
    flops = p.flops(direction)
    median = round(max(rng.uniform(0.01, 50.0), flops / 3e11), 6)
    fields: dict[str, Any] = dict(
        device=device, software=software, key=p.key(direction),
        problem=p if rng.random() < 0.8 else None, config=config(rng, direction),
        median_ms=median, p20_ms=median * 0.95, p80_ms=median * 1.07,
        tflops=flops / (median * 1e9), max_error=rng.uniform(0, 0.01), trials=rng.randint(1, 500),
        search_seconds=rng.uniform(0, 3600), host=rng.choice(["gpu-node-1", "ws"]),
        created_at=f"2026-11-{rng.randint(1, 28):02d}T10:{rng.randint(0, 59):02d}:"
                   f"{rng.randint(0, 59):02d}.{rng.randint(0, 999999):06d}+00:00",
        flashtune_version="0.1.0")
    fields.update(kw)
    return Result(**fields)


def retimed(r: Result, median_ms: float, **kw: Any) -> Result:
    """``r`` with another median (p20/p80 around it) and the TFLOP/s that median implies."""
    return dataclasses.replace(r, median_ms=median_ms, p20_ms=median_ms * 0.9,
                               p80_ms=median_ms * 1.1,
                               tflops=r.tflops * r.median_ms / median_ms, **kw)


def results(seed: int, n: int, devices: tuple[DeviceInfo, ...] = (H200, A100, CPU),
            software: tuple[SoftwareInfo, ...] = (SW, OLD_SW)) -> list[Result]:
    """``n`` results with distinct (device, software, key)."""
    rng = random.Random(seed)
    out: dict[tuple[Any, ...], Result] = {}
    while len(out) < n:
        r = result(rng, device=rng.choice(devices), software=rng.choice(software))
        out.setdefault((r.device, r.software, r.key), r)
    return list(out.values())


def put_kwargs(r: Result) -> dict[str, Any]:
    """The keyword arguments of ``Storage.put_result`` that store ``r``'s measurements."""
    keep = ("median_ms", "p20_ms", "p80_ms", "tflops", "max_error", "trials", "search_seconds")
    return {k: getattr(r, k) for k in keep} | {"problem": r.problem}


def key(direction: str = "fwd", **kw: Any) -> ProblemKey:
    base = Problem(batch=2, heads_q=16, heads_kv=16, seqlen_q=1024, seqlen_k=1024,
                   head_dim=128).key(direction)
    return dataclasses.replace(base, **kw)
