"""Every column of every table, one corrupt cell at a time: each reader skips the rows the
cell spoils, with a warning naming the database and the row, and never fails.

The columns come from the SQLAlchemy metadata, so a column or table added later is covered
without touching this file. Each cell gets values wrong for its column's type (text in a
number, a number out of its set, bytes in text, control characters, broken JSON, a NULL);
values SQLite itself refuses (NOT NULL, a foreign key, an integer primary key) are not
cases. Readers: the storage (results, misses, the dispatcher's table), the sweep board,
the dispatcher's user layer and the report's reading, on every value; the commands
``show``, ``show --misses``, ``export`` and ``info`` on each column's first value, and a
drawn ``report`` once per table (to keep the test quick). None may return anything the
intact database did not hold.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import Boolean, DateTime, Float, Integer, String, Text, TypeDecorator

from flashtune.cli import main
from flashtune.cli.report import collect
from flashtune.db import open_storage
from flashtune.db.claims import Board, tasks_for
from flashtune.db.fingerprint import software_info
from flashtune.db.models import Base
from flashtune.dispatch import _table
from tests.db import _data

FREE_TEXT = {"ft_sweep_claims.note"}  # any text is a valid note (an error message)
COLUMNS = [f"{t.name}.{c.name}" for t in Base.metadata.sorted_tables for c in t.columns]


def bad_values(table: str, column: str) -> list[Any]:
    col = Base.metadata.tables[table].c[column]
    kind = col.type.impl if isinstance(col.type, TypeDecorator) else col.type
    values: list[Any] = [] if col.nullable else [None]  # NULL is a value where allowed
    if isinstance(kind, Boolean):
        values += ["garbage", 7]
    elif isinstance(kind, DateTime):
        values += ["yesterday", 12345]
    elif isinstance(kind, Integer):
        values += ["garbage", 1.5]
    elif isinstance(kind, Float):
        values += ["garbage", b"\x00\xff"]
    elif isinstance(kind, (String, Text)):
        values += [b"\x00\xff"]
        if f"{table}.{column}" not in FREE_TEXT:
            values += ["\x1b[31mred"]
        if column.endswith("_json"):
            values += ["{not json", "[]", "12"]
    else:  # a new column type: teach this test what is wrong for it
        raise AssertionError(f"{table}.{column}: no bad values for {kind!r}")
    return values


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database with results on two devices (one problem shared), a miss and a sweep."""
    db = tmp_path_factory.mktemp("base") / "base.db"
    sw = software_info()  # fresh, so the dispatcher serves them
    rs = _data.results(5, 4, devices=(_data.H200, _data.A100), software=(sw,))
    rng = random.Random(3)
    with open_storage(str(db)) as s:
        s.put_results(rs)
        p = _data.problem(rng)
        s.record_misses(_data.H200, sw, {p.key("fwd"): (3, p)})
    board = Board(str(db))
    board.create(_data.H200, sw, tasks_for([_data.problem(rng) for _ in range(2)], ["fwd"]), 5)
    board.close()
    return db


def reads(db: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What every reader returns (comparable values), by reader name."""
    sw = software_info()
    out: dict[str, Any] = {}
    with open_storage(str(db), read_only=True) as s:
        out["results"] = s.results()
        out["misses"] = s.misses()
        for dev in (_data.H200, _data.A100):
            out[f"table {dev.name}"] = s.load_table(dev, sw)
    board = Board(str(db))
    out["tasks"] = [t for sid in board.sweep_ids() for t in board.tasks(sid)]
    board.close()
    monkeypatch.setenv("FLASHTUNE_DB", str(db))
    url, user, _failed, error = _table.read_user(_data.H200, sw)
    assert error is None, error
    out["dispatcher"] = user
    return out


def cli(args: list[str], db: Path) -> Any:
    res = CliRunner().invoke(main, [*args, "--db", str(db)])
    assert res.exit_code == 0 and res.exception is None, (args, res.output)
    assert "Traceback" not in res.output
    return res.stdout


def commands(db: Path, run: bool, out: Path | None) -> dict[str, Any]:
    """What the commands print (counts): ``run`` runs them, ``out`` runs ``report`` too. The
    report's reading runs always (its drawing, about a second, reads nothing more)."""
    got: dict[str, Any] = {}
    if run:
        got["show"] = len(json.loads(cli(["show", "--json", "--stale"], db)))
        got["show --misses"] = len(json.loads(cli(["show", "--misses", "--json"], db)))
        got["export"] = len(json.loads(cli(["export", "-"], db))["entries"])
        got["info"] = json.loads(cli(["info", "--json"], db))["entries"]
    if out is not None:
        cli(["report", "--out", str(out), "--device", "H200"], db)
        got["report"] = (out / "report.html").read_text().count("<tr class=\"entry\">")
    got["report data"] = len(collect(str(db), device="H200").results)
    return got


_DRAWN: set[str] = set()  # tables whose corruption a full `report` run has met


def corrupt(db: Path, table: str, column: str, value: Any) -> int | None:
    """Set one cell of the table's first row; its row id, or None if SQLite refuses."""
    con = sqlite3.connect(db)
    con.execute("PRAGMA foreign_keys = ON")
    try:
        with con:
            rowid = con.execute(f"SELECT min(rowid) FROM {table}").fetchone()[0]
            con.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (value, rowid))
    except sqlite3.IntegrityError:
        return None
    finally:
        con.close()
    return int(rowid)


@pytest.fixture(scope="module")
def intact(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    with pytest.MonkeyPatch.context() as mp:
        return reads(base, mp), commands(base, True, tmp_path_factory.mktemp("report"))


def test_the_intact_database_is_read_whole(intact: tuple[Any, Any]) -> None:
    got, counts = intact
    assert len(got["results"]) == 4 and len(got["misses"]) == 1 and len(got["tasks"]) == 2
    assert got["dispatcher"] and counts["show"] == counts["export"] == 4
    assert counts["report"] >= 1  # the H200 results are listed


@pytest.mark.parametrize("where", COLUMNS)
def test_a_corrupt_cell_costs_its_rows_not_the_read(
        where: str, base: Path, intact: tuple[Any, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    table, column = where.split(".")
    good, good_counts = intact
    commands_run = False
    for value in bad_values(table, column):
        db = tmp_path / f"{len(list(tmp_path.iterdir()))}.db"
        shutil.copy(base, db)
        row = corrupt(db, table, column, value)
        if row is None:
            continue
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            got = reads(db, monkeypatch)
            # The reads on every value; the commands on the column's first, and the drawn
            # report on the first column of each table.
            draw = table not in _DRAWN
            _DRAWN.add(table)
            counts = commands(db, not commands_run, tmp_path / "report" if draw else None)
            commands_run = True
        notes = [r.getMessage() for r in caplog.records
                 if r.levelno >= logging.WARNING and r.name.startswith("flashtune")]
        lost = False
        for name, seen in got.items():
            before = good[name]
            items = list(seen.values()) if isinstance(seen, dict) else seen
            kept = list(before.values()) if isinstance(before, dict) else before
            assert all(x in kept for x in items), (where, value, name, "changed rows served")
            lost |= len(items) < len(kept)
        for name, n in counts.items():  # rows the commands show
            assert n <= good_counts[name], (where, value, name)
            lost |= n < good_counts[name]
        assert all(str(db) in m and " row " in m for m in notes), (where, value, notes)
        if lost:
            assert notes, (where, value, "rows skipped without a warning")
