"""The tuner's own cost per trial, on the CPU: the search loop with a worker that answers
at once, so what is left is the sampler, the feasibility rule, the candidates and the
tuning database's writes.

    python benchmarks/bench_search_loop.py [--time-budget 12] [--seeds 3] [--db DIR]

Each search tunes one problem of the standard preset over the full space, with a time
budget, into a fresh SQLite file (as a sweep does). The worker's times are a fixed
pseudo-random function of the config (a backward also gets per-launch times), so two
versions of the tuner see the same landscape. On the GPU a trial also compiles, gates
and times; this measures only what the tuner adds to that, and ``trials`` here is how
many candidates the loop could serve in the budget, not how many a GPU search measures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from replay_search import ReplaySession  # the stand-in session (benchmarks/ is on the path)

from flashtune.autotune import tune
from flashtune.problem import Problem

PROBLEMS = [
    ("fwd", Problem(batch=8, heads_q=32, heads_kv=32, seqlen_q=2048, seqlen_k=2048,
                    head_dim=64)),
    ("fwd", Problem(batch=4, heads_q=32, heads_kv=32, seqlen_q=4096, seqlen_k=4096,
                    head_dim=128, causal=True)),
    ("bwd", Problem(batch=8, heads_q=32, heads_kv=32, seqlen_q=2048, seqlen_k=2048,
                    head_dim=64)),
    ("bwd", Problem(batch=4, heads_q=32, heads_kv=32, seqlen_q=4096, seqlen_k=4096,
                    head_dim=128, causal=True)),
]


def _ms(cfg: dict[str, Any], salt: str) -> float:
    h = hashlib.sha256(json.dumps([salt, sorted(cfg.items())]).encode()).digest()
    return 1.0 + int.from_bytes(h[:4], "little") / 2**32


class InstantWorker:
    """Answers every feasible config at once with a fixed pseudo-random time."""

    restarts = 0

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if msg["op"] == "measure":
            cfg = msg["config"]
            parts = {p: _ms(cfg, p) for p in ("pre", "dkdv", "dq")} \
                if msg["direction"] == "bwd" else {}
            ms = sum(parts.values()) if parts else _ms(cfg, "fwd")
            return {"status": "ok", "median_ms": ms, "p20_ms": ms, "p80_ms": ms,
                    "parts_ms": parts, "compile_s": 0.0, "max_error": 0.0, "ratio": 0.0}
        timings = [{"median_ms": _ms(c, "fwd"), "p20_ms": 1.0, "p80_ms": 1.0,
                    "interpreter": False} for c in msg["configs"]]
        return {"status": "ok", "timings": timings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-budget", type=float, default=12.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--db", type=Path, default=None, help="folder for the databases")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    root = args.db or Path(tempfile.mkdtemp(prefix="flashtune-loop-"))
    rows = []
    print(f"{'dir':4} {'problem':32} {'trials':>6} {'infeasible':>10} {'ms/trial':>8}")
    for i, (d, p) in enumerate(PROBLEMS):
        for seed in range(args.seeds):
            db = root / f"loop-{i}-{seed}.db"
            db.unlink(missing_ok=True)
            t0 = time.perf_counter()
            r = tune(p, d, time_budget=args.time_budget, storage=db, seed=seed,
                     session=ReplaySession(InstantWorker(), 14),  # type: ignore[arg-type]
                     store=False, retime_rounds=1)
            wall = time.perf_counter() - t0
            row = {"direction": d, "problem": p.key(d).short(), "seed": seed,
                   "trials": r.trials, "infeasible": r.infeasible, "wall_s": wall,
                   "search_s": r.search_seconds,
                   "ms_per_trial": 1e3 * r.search_seconds / max(r.trials, 1)}
            rows.append(row)
            print(f"{d:4} {row['problem'][:32]:32} {r.trials:>6} {r.infeasible:>10} "
                  f"{row['ms_per_trial']:>8.1f}", flush=True)
    for d in ("fwd", "bwd"):
        sel = [r for r in rows if r["direction"] == d]
        print(f"{d}: median trials in {args.time_budget:g} s: "
              f"{statistics.median(r['trials'] for r in sel):g}, median "
              f"{statistics.median(r['ms_per_trial'] for r in sel):.1f} ms of tuner per trial")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
