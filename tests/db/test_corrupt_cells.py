"""One bad cell costs its row, not the read: every column of the results table, corrupted in
a real SQLite file (SQLite stores any value in any column), leaves `show`, `export`, `info`
and the dispatcher's table working on the other rows, with a warning naming the database
and the row."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashtune.cli import main
from flashtune.db import open_storage
from tests.db import _data

BAD = {
    "median_ms": ["fast", -1.0, 1e300], "p20_ms": ["x", -5.0], "p80_ms": ["slow", -1.0],
    "tflops": ["many", -3.0], "max_error": ["tiny", -1.0], "trials": ["lots", -7],
    "search_seconds": ["long", -1.0], "host": ["x" * 300, "bell\x07"],
    "flashtune_version": ["v" * 100, "\x1b[31m"],
    "config_json": ["{not json", "[]", '{"block_m": 7}', '{"colour": 1}', "null"],
    "example_json": ["{not json", "[]", '{"batch": -1}'],
    "torch": ["t" * 200, "\x1b[31m"], "cuda": ["", "\x9b"],
    "origin": ["stolen", 3], "verify": ["maybe", ""],
    "verified_at": ["yesterday", 7, "2026-11-23T10:00:00"],
}


@pytest.mark.parametrize("column, value", [(c, v) for c, vs in BAD.items() for v in vs])
def test_a_corrupt_cell_skips_its_row(tmp_path: Path, column: str, value: object,
                                      caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "t.db"
    rs = _data.results(11, 3)
    with open_storage(str(db)) as s:
        s.put_results(rs)
    con = sqlite3.connect(db)
    with con:
        con.execute(f"UPDATE ft_results SET {column} = ? WHERE id = 2", (value,))
    con.close()
    with caplog.at_level(logging.WARNING), open_storage(str(db), read_only=True) as s:
        assert len(s.results()) == 2
        for r in rs:
            s.load_table(r.device, r.software)  # the dispatcher's read
    assert any("row 2" in r.getMessage() and str(db) in r.getMessage()
               for r in caplog.records)
    for args in (["show", "--stale"], ["show", "--json", "--stale"], ["export", "-"], ["info"]):
        res = CliRunner().invoke(main, [*args, "--db", str(db)])
        assert res.exit_code == 0 and res.exception is None, (args, res.output)
    doc = json.loads(CliRunner().invoke(main, ["export", "-", "--db", str(db)]).stdout)
    assert len(doc["entries"]) == 2
