"""``autotune verify``: re-gate, on this machine, the entries it serves but did not tune.

An entry tuned elsewhere (imported, copied from the shipped layer, or written to a shared
database by another host) carries a claim: this config is correct and this fast for its
problem here. :func:`verify` checks the claim where it will be served:

1. the entry's config must be feasible for the entry's own problem (its stored example,
   else a representative of its key: :func:`representative`);
2. the measurement worker runs it: the correctness gate (2x rule, fresh inputs drawn from
   a new seed) and a brief timing;
3. the outcome is stored with the entry (``verify`` = "passed" with the re-measured times
   and error, or "failed"), and a shipped entry is copied into the database to hold it.
   The dispatcher never serves a failed entry, nor a shipped entry with that config.

Entries measured by this host into this database (``origin="local"``) need no check;
entries already passed are skipped unless ``again``.
"""

from __future__ import annotations

import math
import random
import socket
from dataclasses import dataclass, replace
from typing import Any

from flashtune._env import interpreting, setenv
from flashtune.kernels.config import check, config_from_dict
from flashtune.problem import Problem, ProblemKey

__all__ = ["Outcome", "representative", "targets", "verify"]

# A brief timing: enough to rank the entry against local results, not a benchmark.
GPU_TIMING = {"warmup_ms": 10.0, "rep_ms": 40.0}
CPU_TIMING = {"cpu_reps": 1}


@dataclass(frozen=True)
class Outcome:
    """What verify found for one entry."""

    key: ProblemKey
    layer: str  # "user" (the database) or "shipped"
    origin: str
    host: str
    outcome: str  # "passed" | "failed"
    detail: str
    claimed_ms: float
    median_ms: float | None
    max_error: float | None

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["key"] = self.key.as_dict()
        d["key_short"] = self.key.short()
        return d


def representative(key: ProblemKey) -> Problem:
    """A concrete problem under ``key`` (for an entry stored without its example): every
    bucket at its top, one KV head per GQA group, a window of a quarter of the keys and a
    softcap of 30 where the key has them."""
    heads_q = key.gqa_ratio
    batch = max(key.bh_bucket // heads_q, 1)
    window = (max(key.sk_bucket // 4, 1), 0 if key.causal else max(key.sk_bucket // 4, 1)) \
        if key.window else (-1, -1)
    tokens = min(max(key.tokens_bucket, key.sq_bucket), batch * key.sq_bucket) if key.packed \
        else 0
    return Problem(batch=batch, heads_q=heads_q, heads_kv=1, seqlen_q=key.sq_bucket,
                   seqlen_k=key.sk_bucket, head_dim=key.head_dim, dtype=key.dtype,
                   causal=key.causal, window=window, softcap=30.0 if key.softcap else 0.0,
                   deterministic=key.deterministic,
                   total_q=tokens, total_k=tokens * key.sk_bucket // key.sq_bucket if tokens
                   else 0)


def targets(storage: Any, device: Any, software: Any, *, shipped: bool = True,
            again: bool = False) -> list[tuple[Any, str]]:
    """(entry, layer) pairs to verify: the servable fresh entries of ``device`` that this
    host did not measure into ``storage``, and (``shipped``) the shipped layer's entries
    for ``device`` that the database neither overrides nor failed; without ``again``,
    those not passed already."""
    from flashtune.db.exchange import shipped_results

    here = socket.gethostname()
    user = storage.load_table(device, software)
    failed = storage.failed(device, software)
    out: list[tuple[Any, str]] = []
    for r in user.values():
        if r.origin == "local" and r.host == here:
            continue
        if again or r.verify != "passed":
            out.append((r, "user"))
    if shipped:
        for r in shipped_results(software):
            if r.stale or r.device.fingerprint != device.fingerprint:
                continue
            if r.key in user:
                continue  # the database's entry is served in its place
            held = failed.get(r.key)
            if held is not None and dict(held.config) == dict(r.config):
                continue  # failed here already: never served
            out.append((r, "shipped"))
    return sorted(out, key=lambda t: (t[1], t[0].key))


def _check_one(worker: Any, r: Any, seed: int, timeout: float, timing: dict[str, Any],
               ) -> tuple[str, str, dict[str, Any]]:
    problem = r.problem if r.problem is not None else representative(r.key)
    try:
        cfg = config_from_dict(r.key.direction, r.config)
        check(cfg, problem)
    except ValueError as e:
        return "failed", f"infeasible for its own problem {problem.label()}: {e}", {}
    reply = worker.request({"op": "measure", "problem": problem.as_dict(),
                            "direction": r.key.direction, "config": dict(r.config),
                            "seed": seed, "timing": timing}, timeout=timeout)
    status = reply.get("status")
    if status != "ok":
        what = {"gate": "", "prune": "did not compile: ", "error": "failed to run: ",
                "died": "", "timeout": ""}.get(str(status), f"{status}: ")
        return "failed", f"{what}{reply.get('detail', '')}"[:300], {}
    err = float(reply.get("max_error", math.nan))
    return "passed", f"gate passed ({reply.get('detail', '')})"[:300], {
        "median_ms": float(reply["median_ms"]), "p20_ms": float(reply["p20_ms"]),
        "p80_ms": float(reply["p80_ms"]), "max_error": err if math.isfinite(err) else None}


def verify(storage: Any, *, shipped: bool = True, again: bool = False,
           interpret: bool | None = None, trial_timeout: float | None = None,
           seed: int | None = None, env: dict[str, str] | None = None) -> list[Outcome]:
    """Verify the entries of :func:`targets` on this machine and store each outcome.

    ``interpret`` runs Triton's CPU interpreter (default: ``TRITON_INTERPRET``); the
    inputs are drawn from ``seed`` (default: a fresh one); ``env`` is extra environment
    for the measurement worker. Returns one :class:`Outcome` per entry.
    """
    from flashtune.autotune._isolation import Worker
    from flashtune.db.fingerprint import device_info, software_info

    interp = interpreting() if interpret is None else bool(interpret)
    with setenv("TRITON_INTERPRET", "1" if interp else None):
        device = device_info()
    software = software_info()
    timeout = (300.0 if interp else 120.0) if trial_timeout is None else trial_timeout
    timing = CPU_TIMING if interp else GPU_TIMING
    rng = random.Random(seed)
    out: list[Outcome] = []
    todo = targets(storage, device, software, shipped=shipped, again=again)
    if not todo:
        return out
    worker = Worker(interpret=interp, env=env)
    try:
        for r, layer in todo:
            outcome, detail, measured = _check_one(worker, r, rng.randrange(2**31), timeout,
                                                   timing)
            stored = r if layer == "user" else replace(r, origin="shipped")
            storage.set_verify(stored, outcome, **measured)
            out.append(Outcome(key=r.key, layer=layer, origin=stored.origin, host=r.host,
                               outcome=outcome, detail=detail, claimed_ms=r.median_ms,
                               median_ms=measured.get("median_ms"),
                               max_error=measured.get("max_error")))
    finally:
        worker.close()
    return out
