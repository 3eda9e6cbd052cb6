"""`autotune verify`: re-gate here the entries this machine serves but did not tune
(:mod:`flashtune.autotune.verify`); a rich table, or ``--json``."""

from __future__ import annotations

import json

import click

from flashtune.cli._common import SECONDS, clean_errors, console, db_option, fmt, kernel_mode


@click.command("verify")
@click.option("--interpret", is_flag=True,
              help="Run under Triton's CPU interpreter (tests and demos; timings meaningless).")
@db_option
@click.option("--no-shipped", is_flag=True, help="Leave out the shipped layer's entries.")
@click.option("--again", is_flag=True, help="Also re-check entries that passed before.")
@click.option("--trial-timeout", type=SECONDS, default=None,
              help="Seconds one entry may take in the measurement worker.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcomes as JSON.")
def verify_cmd(interpret: bool, db_url: str | None, no_shipped: bool, again: bool,
               trial_timeout: float | None, as_json: bool) -> None:
    """Re-run the correctness gate (fresh inputs, the entry's own shape) and a brief timing
    for every entry served on this machine that it did not tune: imported, shipped, or
    from a shared database. A failed entry is never served here. Exit status 1 if any
    failed."""
    interp = kernel_mode("verify", interpret)
    from flashtune.autotune.verify import verify
    from flashtune.db import open_storage

    with clean_errors(), open_storage(db_url) as storage:
        outcomes = verify(storage, shipped=not no_shipped, again=again, interpret=interp,
                          trial_timeout=trial_timeout)
    n_failed = sum(o.outcome == "failed" for o in outcomes)
    if as_json:
        click.echo(json.dumps({"interpreter": interp, "verified": len(outcomes),
                               "failed": n_failed,
                               "entries": [o.as_dict() for o in outcomes]},
                              indent=2, sort_keys=True))
    else:
        _table(outcomes, interp)
    if n_failed:
        raise SystemExit(1)


def _table(outcomes: list, interp: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    out = console()
    if not outcomes:
        out.print("nothing to verify: every entry served here was tuned here or has passed")
        return
    unit = "ms (interpreter)" if interp else "ms"
    t = Table(title=f"autotune verify: {len(outcomes)} entries")
    for col in ("key", "layer", "origin", "host", "outcome", f"claimed {unit}",
                f"measured {unit}", "detail"):
        t.add_column(col, overflow="fold")
    for o in outcomes:
        style = "green" if o.outcome == "passed" else "bold red"
        t.add_row(escape(o.key.short()), o.layer, o.origin, escape(o.host),
                  f"[{style}]{o.outcome}[/]", fmt(o.claimed_ms, ".4g"),
                  fmt(o.median_ms, ".4g"), escape(o.detail))
    out.print(t)
