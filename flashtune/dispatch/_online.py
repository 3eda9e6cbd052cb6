"""Online tuning on a miss (``FLASHTUNE_TUNE_ON_MISS=1``): a small tune, rank 0 only."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from flashtune._env import database_url, number
from flashtune.db.fingerprint import DeviceInfo, software_info
from flashtune.dispatch._distributed import (
    decode_results,
    dist_group,
    encode_results,
    exchange,
    store_key,
)
from flashtune.dispatch._state import counters, warn_once
from flashtune.dispatch._table import Table, log, parse
from flashtune.kernels.config import config_to_dict
from flashtune.problem import Problem

if TYPE_CHECKING:
    from flashtune.db.storage import Result


def tune_on_miss(problem: Problem, direction: str, table: Table) -> Result | None:
    """Tune ``problem`` (rank 0 only under torch.distributed) and add the result to ``table``."""
    d = dist_group()
    run = lambda: run_tuner(problem, direction, table)  # noqa: E731
    if d is None:
        result = run()
    else:
        name = store_key("tuned", table.device.fingerprint, problem.key(direction))
        try:
            result = exchange(
                d, name, run,
                lambda r: None if r is None else encode_results([(r, "user")]),
                lambda doc: None if doc is None else decode_results(doc)[0][0])
        except Exception as e:
            warn_once(f"dist-tune:{name}", f"flashtune: rank {d.rank} got no online-tuning "
                       f"result from rank 0 ({type(e).__name__}: {e}); deciding locally")
            return None
    if result is None:
        return None
    entry = parse(result, "user")
    if entry is None:
        return None
    table.add(entry)
    return result


def run_tuner(problem: Problem, direction: str, table: Table) -> Result | None:
    trials = max(1, int(number("FLASHTUNE_TUNE_TRIALS", 8)))
    budget = number("FLASHTUNE_TUNE_SECONDS", 120.0)
    counters["tunes"] += 1
    t0 = time.perf_counter()
    try:
        from flashtune.autotune import tune

        # A broken user database still gets a tune; its result lives in this process only.
        where: Any = database_url() if table.error is None else "sqlite://"
        out = tune(problem, direction=direction, trials=trials, time_budget=budget,
                   storage=where, store=table.error is None)
    except Exception as e:  # online tuning is best effort: never the reason a run fails
        warn_once(f"tune:{type(e).__name__}", f"flashtune: online tuning failed "
                   f"({type(e).__name__}: {e}); falling back to the stored/heuristic configs")
        return None
    result = as_result(out, table.device)
    if result is not None:
        log.info("flashtune: tuned %s %s in %.1f s: %s", direction, result.key.short(),
                 time.perf_counter() - t0, result.config)
    return result


def as_result(out: Any, device: DeviceInfo) -> Result | None:
    """The tuner's answer (a TuneResult: config, key and timings) as a database Result."""
    from flashtune.db import Result, provenance

    if isinstance(out, Result) or out is None:
        return out
    try:
        host, created_at, version = provenance()
        return Result(device=device, software=software_info().for_direction(out.key.direction),
                      key=out.key,
                      problem=out.problem, config=config_to_dict(out.config),
                      median_ms=out.median_ms, p20_ms=out.p20_ms, p80_ms=out.p80_ms,
                      tflops=out.tflops, max_error=out.max_error, trials=out.trials,
                      search_seconds=out.search_seconds, host=host, created_at=created_at,
                      flashtune_version=version)
    except (AttributeError, TypeError) as e:
        warn_once("tune-result", f"flashtune: cannot use the tuner's result ({e})")
        return None
