"""Does a config's interleaved time depend on what it is interleaved with? (issue 17)

Session 36's fresh-install bench read every long forward 3-10% faster than the figure the
sweep had stored for the same config (backward: 3-6%), and session 34 measured the clock
move with the bench's company: side by side with the slow ``efficient`` backend in the loop
the H200 ran at 1935 MHz, with cuDNN alone at 1770 MHz. The tuner's final re-timing
interleaves only flashtune's own finalists, all of them dense tensor-core work. This
times each key's shipped config, on one set of inputs per loop, in five companies:

- ``tuner``: the tuner's final re-timing (``flashtune.autotune.measure.retime``, five
  rounds) of the shipped config, the heuristic default and up to four other shipped
  configs of the same direction and head dim that run this shape (finalist-like company);
- ``tuner+sdpa``: the same launches interleaved with the three SDPA anchors (cuDNN, FA2,
  efficient; for the backward their forward+backward);
- ``pair+sdpa``: the shipped config and the default with the three SDPA anchors: the
  tuner's anchored timing (``flashtune.autotune.tuner``, step 6), which since this
  script was written gives the stored figure;
- ``bench``: the bench's own side-by-side loop (``three_timings_interleaved`` with tuned,
  default and every anchor, Flex included), the row ``autotune bench`` reports;
- ``bench-noflex``: that loop without Flex.

Each loop's median SM clock is recorded (NVML). Prints a table of ms (and the stored
figure) per key and writes JSON.

    timeout -k 10 400 python3 benchmarks/experiments/retime_neighbours.py --out $OUT/nb.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flashtune.autotune.measure import Bench, retime  # noqa: E402
from flashtune.autotune.tuner import ANCHORED_ROUNDS  # noqa: E402
from flashtune.gpu_clocks import ClockSampler  # noqa: E402
from flashtune.kernels.attention import flash_attention  # noqa: E402
from flashtune.kernels.config import config_from_dict, default_config  # noqa: E402
from flashtune.problem import Problem  # noqa: E402
from flashtune.timing import (  # noqa: E402
    SDPA_ANCHORS,
    anchor_launches,
    anchors,
    three_timings_interleaved,
    time_interleaved,
)

# The session-36 bench's widest forward and backward misses (bench / stored figure).
KEYS = [
    ("fwd", Problem(1, 16, 16, 16384, 16384, 128, "bf16", True)),   # 0.901
    ("fwd", Problem(2, 16, 16, 8192, 8192, 128, "bf16", False)),    # 0.921
    ("fwd", Problem(1, 32, 32, 16384, 16384, 64, "bf16", True)),    # 0.924
    ("fwd", Problem(16, 16, 16, 1024, 1024, 128, "bf16", False)),   # 0.987 (a short control)
    ("bwd", Problem(5, 16, 16, 3000, 3000, 128, "bf16", False)),    # 0.942
    ("bwd", Problem(2, 32, 32, 8192, 8192, 64, "bf16", True)),      # 0.946
]


def shipped(device: str) -> list[dict[str, Any]]:
    path = os.path.join(os.path.dirname(__file__), "..", "..", "flashtune", "data",
                        "shipped.json")
    with open(path) as f:
        return [e for e in json.load(f)["entries"] if e["device"]["name"] == device]


def entry_for(entries: list[dict[str, Any]], direction: str, p: Problem) -> dict[str, Any]:
    key = p.key(direction)
    for e in entries:
        if e["direction"] == direction and all(
                getattr(key, n) == v for n, v in e["problem"].items() if hasattr(key, n)):
            return e
    raise LookupError(f"no shipped {direction} entry for {p.dims()}")


def company(entries: list[dict[str, Any]], direction: str, p: Problem, bench: Bench,
            skip: list[Any], n: int = 4) -> list[Any]:
    """Up to ``n`` other shipped configs (same direction and head dim) that run ``p``."""
    out: list[Any] = []
    for e in entries:
        if len(out) == n:
            break
        if e["direction"] != direction or e["problem"]["head_dim"] != p.head_dim:
            continue
        cfg = config_from_dict(direction, e["config"])
        if cfg in skip or cfg in out:
            continue
        try:
            bench.launch(direction, cfg)()
            torch.cuda.synchronize()
        except Exception:  # noqa: S112 - a config this shape cannot run is no company
            continue
        out.append(cfg)
    return out


def ours(p: Problem, fwd: Any, bwd: Any) -> Any:
    """flashtune's call with both configs forced, as the bench's "tuned" and "default"."""
    kw = dict(causal=p.causal, deterministic=p.deterministic, config=(fwd, bwd))
    return lambda q, k, v: flash_attention(q, k, v, **kw)


def one_key(direction: str, p: Problem, entries: list[dict[str, Any]],
            sampler: ClockSampler) -> dict[str, Any]:
    t0 = time.perf_counter()
    e = entry_for(entries, direction, p)
    cfg = config_from_dict(direction, e["config"])
    dflt = default_config(direction, p)
    bench = Bench(p, "cuda")
    others = company(entries, direction, p, bench, [cfg, dflt])
    ms: dict[str, float] = {}
    clk: dict[str, Any] = {}
    watts: dict[str, Any] = {}

    def record(name: str, t: float, w: Any) -> None:
        ms[name] = t
        s = w.summary() if sampler.available else None
        clk[name] = None if s is None else s["sm_mhz"]["median"]
        watts[name] = None if s is None else s["power_w"]["median"]

    finalists = [cfg, dflt, *others]
    with sampler.window() as w:
        ts = retime(bench, direction, finalists, rounds=5)
    record("tuner", ts[0].median_ms, w)
    launches = [bench.launch(direction, c) for c in finalists]
    sdpa = list(anchor_launches(p, "fwd" if direction == "fwd" else "fwd_bwd").values())
    with sampler.window() as w:
        ts = time_interleaved(launches + sdpa, rounds=5)
    record("tuner+sdpa", ts[0].median_ms, w)
    with sampler.window() as w:  # the tuner's anchored timing, as it runs it
        ts = retime(bench, direction, [cfg, dflt], rounds=ANCHORED_ROUNDS, company=sdpa)
    record("pair+sdpa", ts[0].median_ms, w)
    tuned = {d: cfg if d == direction else config_from_dict(d, entry_for(entries, d, p)["config"])
             for d in ("fwd", "bwd")}
    for name, names in (("bench", ("cudnn", "fa2", "efficient", "flex")),
                        ("bench-noflex", SDPA_ANCHORS)):
        impls = {"tuned": ours(p, tuned["fwd"], tuned["bwd"]),
                 "default": ours(p, default_config("fwd", p), default_config("bwd", p)),
                 **anchors(p, names)}
        with sampler.window() as w:
            tt = three_timings_interleaved(impls, p, "cuda")
        record(name, tt["tuned"][direction].median_ms, w)
    return {"direction": direction, "shape": p.dims(), "causal": p.causal,
            "stored_ms": e["median_ms"], "ms": ms, "sm_mhz": clk, "power_w": watts,
            "company": len(others), "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--keys", default="", help="comma-separated indices into KEYS (all)")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    entries = shipped(device)
    sampler = ClockSampler.for_cuda_device(torch.cuda.current_device()).__enter__()
    picks = [KEYS[int(i)] for i in args.keys.split(",")] if args.keys else KEYS
    rows = []
    for direction, p in picks:
        rows.append(one_key(direction, p, entries, sampler))
        print(json.dumps(rows[-1]), flush=True)
        with open(args.out, "w") as f:  # after every key: a run cut short keeps its rows
            json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
    names = ["tuner", "tuner+sdpa", "pair+sdpa", "bench-noflex", "bench"]
    print(f"{'dir':4} {'shape':20} {'stored':>7} " + " ".join(f"{n:>13}" for n in names))
    for r in rows:
        cells = " ".join(f"{r['ms'][n]:7.4f}/{r['sm_mhz'][n] or 0:>5.0f}" for n in names)
        print(f"{r['direction']:4} {r['shape'] + (' c' if r['causal'] else ''):20} "
              f"{r['stored_ms']:7.4f} {cells}")


if __name__ == "__main__":
    main()
