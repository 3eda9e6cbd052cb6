"""Test hooks: make the measurement worker misbehave for chosen configs.

The worker reads ``FLASHTUNE_AUTOTUNE_FAULTS`` at start: a JSON list of rules
``{"when": {config field: value, ...}, "do": ACTION}``. The first rule whose
``when`` matches a candidate's config applies to that candidate:

- ``"corrupt"``: the kernels run, then their outputs are perturbed (a wrong kernel
  variant; the correctness gate must catch it);
- ``"exit"``: ``os._exit(3)`` in the worker;
- ``"segv"``: the worker sends itself SIGSEGV;
- ``"hang"``: the worker sleeps forever (the per-trial timeout must fire);
- ``"raise"``: a RuntimeError from the launcher;
- ``"slow"``: the worker sleeps one second, then measures normally (gives a test
  time to interrupt a tune mid-search).

Nothing here is active unless the variable is set. Tests set it with
:func:`fault_env`; the real worker subprocess does the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

ENV = "FLASHTUNE_AUTOTUNE_FAULTS"
ACTIONS = ("corrupt", "exit", "segv", "hang", "raise", "slow")


def fault_env(*rules: tuple[Mapping[str, Any], str]) -> dict[str, str]:
    """``{ENV: json}`` for rules given as ``(when, action)`` pairs."""
    out = []
    for when, action in rules:
        if action not in ACTIONS:
            raise ValueError(f"fault action must be one of {ACTIONS}, got {action!r}")
        out.append({"when": dict(when), "do": action})
    return {ENV: json.dumps(out)}


def rules_from_env() -> list[dict[str, Any]]:
    text = os.environ.get(ENV, "")
    return json.loads(text) if text else []


def action_for(rules: list[dict[str, Any]], direction: str,
               config: Mapping[str, Any]) -> str | None:
    for r in rules:
        when = r["when"]
        if when.get("direction", direction) != direction:
            continue
        if all(config.get(k) == v for k, v in when.items() if k != "direction"):
            return str(r["do"])
    return None


def crash(action: str) -> None:
    """Carry out a process-level fault (never returns for exit/segv/hang)."""
    if action == "exit":
        os._exit(3)
    if action == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(10)  # the signal is delivered asynchronously
        os._exit(139)
    if action == "slow":
        time.sleep(1.0)
    if action == "hang":
        while True:
            time.sleep(3600)


@contextlib.contextmanager
def kernel_fault(action: str, direction: str) -> Iterator[None]:
    """Swap the direction's launcher for a variant that corrupts its outputs or raises."""
    import flashtune.kernels.attn_bwd as bwd_mod
    import flashtune.kernels.attn_fwd as fwd_mod

    orig_fwd, orig_bwd = fwd_mod.attn_fwd, bwd_mod.attn_bwd

    def bad_fwd(*a: Any, **kw: Any) -> Any:
        if action == "raise":
            raise RuntimeError("injected launcher failure")
        o, lse = orig_fwd(*a, **kw)
        return o * 1.5 + 0.25, lse

    def bad_bwd(*a: Any, **kw: Any) -> Any:
        if action == "raise":
            raise RuntimeError("injected launcher failure")
        dq, dk, dv = orig_bwd(*a, **kw)
        return dq * 1.5 + 0.25, dk, dv

    if direction == "fwd":
        fwd_mod.attn_fwd = bad_fwd  # type: ignore[assignment]
    else:
        bwd_mod.attn_bwd = bad_bwd  # type: ignore[assignment]
    try:
        yield
    finally:
        fwd_mod.attn_fwd, bwd_mod.attn_bwd = orig_fwd, orig_bwd  # type: ignore[assignment]
