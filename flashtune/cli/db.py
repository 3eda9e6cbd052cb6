"""`autotune` commands: the database family (export, import, show).

Expected failures (bad file, unreadable database, ...) print one line to stderr and
exit with status 1, never a traceback. ``db_option`` is the shared ``--db`` option and
``search_options`` the shared ``--direction/--trials/--time-budget`` of tune and sweep.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from flashtune.cli._common import clean_errors, db_option, read_input, write_atomically


@click.command("export")
@click.argument("path", type=click.Path(dir_okay=False, allow_dash=True))
@db_option
@click.option("--device", metavar="TEXT", default=None,
              help="Only this device: a fingerprint or part of its name.")
@click.option("--fresh", is_flag=True,
              help="Only results fresh under this machine's software (kernel sources, Triton, "
                   "ptxas): leave out what an upgrade made stale.")
def export(path: str, db_url: str | None, device: str | None, fresh: bool) -> None:
    """Write the database as a JSON export document to PATH ('-' for stdout)."""
    from flashtune.db import open_storage
    from flashtune.db.exchange import export_json

    with clean_errors():
        with open_storage(db_url, read_only=True) as storage:
            data = export_json(storage, device=device, fresh=fresh)
        if path == "-":
            sys.stdout.buffer.write(data)
            return
        write_atomically(Path(path), data)
    n = json.loads(data)["entries"]
    click.echo(f"exported {len(n)} entries to {path}", err=True)


@click.command("import")
@click.argument("path", type=click.Path(dir_okay=False, allow_dash=True))
@db_option
@click.option("--prefer", type=click.Choice(["faster", "ours", "theirs"]), default="faster",
              show_default=True,
              help="On a conflict keep the faster result, the stored one, or the file's.")
def import_(path: str, db_url: str | None, prefer: str) -> None:
    """Validate the export document PATH completely, then merge it into the database."""
    from flashtune.db import open_storage
    from flashtune.db.exchange import import_json, validate_export
    from flashtune.exceptions import ImportValidationError

    with clean_errors():
        data = read_input(path, "an export file")
        try:
            validate_export(data)  # before the database is even opened
        except ImportValidationError as e:
            raise ImportValidationError(f"{path}: {e}") from None
        with open_storage(db_url) as storage:
            report = import_json(storage, data, prefer=prefer)
    click.echo(f"imported {report.total} entries from {path}: {report.added} added, "
               f"{report.replaced} replaced, {report.kept} kept (prefer {prefer})")


def _show_entry(r: Any) -> dict[str, Any]:
    from flashtune.db.exchange import to_entry

    e = to_entry(r)
    e["device"]["fingerprint"] = r.device.fingerprint
    e["software"]["fingerprint"] = r.software.fingerprint
    e["stale"] = r.stale
    e["origin"], e["verify"], e["verified_at"] = r.origin, r.verify, r.verified_at
    return e


def _status(r: Any) -> str:
    """STALE, FAILED (by `autotune verify`: never served), and where a result came from
    when it was not measured into this database."""
    marks = ["STALE" if r.stale else "", "FAILED" if r.verify == "failed" else "",
             "" if r.origin == "local" else r.origin]
    if r.verify == "passed":
        marks.append("verified")
    return " ".join(m for m in marks if m)


def _tflops(r: Any) -> str:
    # Interpreter timings are CPU milliseconds: a TFLOP/s figure of them means nothing.
    if r.device.capability == "cpu":
        return "(interpreter)"
    return f"{r.tflops:.1f}"


def _results_table(results: list[Any]) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="tuned results", title_justify="left")
    for col, right in (("device", False), ("problem key", False), ("median ms", True),
                       ("TFLOP/s", True), ("config", False), ("", False)):
        table.add_column(col, justify="right" if right else "left")
    for r in results:
        cfg = " ".join(f"{k}={v}" for k, v in sorted(r.config.items()))
        # Text, never markup: names come from imported files.
        table.add_row(Text(r.device.name), Text(r.key.short()), f"{r.median_ms:.4g}",
                      _tflops(r), Text(cfg), _status(r))
    return table


def _misses_table(misses: list[Any]) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="dispatcher misses (most frequent first)", title_justify="left")
    for col in ("count", "problem key", "example shape"):
        table.add_column(col, justify="right" if col == "count" else "left")
    for key, count, problem in misses:
        table.add_row(str(count), Text(key.short()), Text(problem.label()))
    return table


@click.command("show")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of entries.")
@click.option("--stale", is_flag=True, help="Include stale results (other software).")
@click.option("--misses", "show_misses", is_flag=True,
              help="List the problems the dispatcher recorded as misses instead.")
def show(db_url: str | None, as_json: bool, stale: bool, show_misses: bool) -> None:
    """List the tuned results of the database (fresh ones unless --stale), or --misses."""
    from flashtune.cli._common import console
    from flashtune.db import open_storage

    with clean_errors(), open_storage(db_url, read_only=True) as storage:
        results = storage.results()
        misses = storage.misses()
    if show_misses:
        if as_json:
            click.echo(json.dumps([{"key": k.as_dict(), "count": n, "problem": p.as_dict()}
                                   for k, n, p in misses], indent=2, sort_keys=True))
        else:
            console().print(_misses_table(misses))
            click.echo(f"{len(misses)} missed problem keys", err=True)
        return
    shown = [r for r in results if stale or not r.stale]
    if as_json:
        click.echo(json.dumps([_show_entry(r) for r in shown], indent=2, sort_keys=True))
        return
    console().print(_results_table(shown))
    n_stale = sum(r.stale for r in results)
    hidden = "" if stale or not n_stale else " (hidden; --stale shows them)"
    click.echo(f"{len(results)} entries, {n_stale} stale{hidden}; "
               f"{len(misses)} missed problem keys (--misses lists them)", err=True)
