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

from flashtune.cli._common import clean_errors, db_option, write_atomically


@click.command("export")
@click.argument("path", type=click.Path(dir_okay=False, allow_dash=True))
@db_option
@click.option("--device", metavar="TEXT", default=None,
              help="Only this device: a fingerprint or part of its name.")
def export(path: str, db_url: str | None, device: str | None) -> None:
    """Write the database as a JSON export document to PATH ('-' for stdout)."""
    from flashtune.db import open_storage
    from flashtune.db.exchange import export_json

    with clean_errors():
        with open_storage(db_url, read_only=True) as storage:
            data = export_json(storage, device=device)
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
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
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
    return e


@click.command("show")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of entries.")
@click.option("--stale", is_flag=True, help="Include stale results (other software).")
def show(db_url: str | None, as_json: bool, stale: bool) -> None:
    """List the tuned results of the database (fresh ones unless --stale)."""
    from flashtune.db import open_storage

    with clean_errors(), open_storage(db_url, read_only=True) as storage:
        results = storage.results()
        misses = storage.misses()
    shown = [r for r in results if stale or not r.stale]
    if as_json:
        click.echo(json.dumps([_show_entry(r) for r in shown], indent=2, sort_keys=True))
        return
    for r in shown:
        cfg = " ".join(f"{k}={v}" for k, v in sorted(r.config.items()))
        flag = "  STALE" if r.stale else ""
        click.echo(f"{r.device.name:<20} {r.key.short():<52} {r.median_ms:10.4f} ms "
                   f"{r.tflops:8.1f} TFLOP/s  {cfg}{flag}")
    n_stale = sum(r.stale for r in results)
    hidden = "" if stale or not n_stale else " (hidden; --stale shows them)"
    click.echo(f"{len(results)} entries, {n_stale} stale{hidden}; "
               f"{len(misses)} missed problem keys", err=True)
