"""`autotune report`: PNG + HTML from the database's studies and a bench document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashtune.cli import main

TINY = [{"batch": 1, "heads": 2, "seqlen": 64, "head_dim": 32, "dtype": "fp16"}]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A database with one tuned problem (fwd) and a bench document over it."""
    tmp = tmp_path_factory.mktemp("report")
    shapes = tmp / "shapes.json"
    shapes.write_text(json.dumps(TINY))
    db = str(tmp / "t.db")
    r = CliRunner().invoke(main, ["sweep", "--interpret", "--shapes", str(shapes),
                                  "--direction", "fwd", "--trials", "2", "--db", db])
    assert r.exit_code == 0, r.output
    b = CliRunner().invoke(main, ["bench", "--interpret", "--json", "--shapes", str(shapes),
                                  "--db", db])
    assert b.exit_code == 0, b.output
    bench = tmp / "bench.json"
    bench.write_text(b.stdout)
    return db, str(bench)


def test_report_from_database_and_bench(tuned: tuple[str, str], tmp_path: Path) -> None:
    db, bench = tuned
    out = tmp_path / "rep"
    res = CliRunner().invoke(main, ["report", "--db", db, "--bench", bench, "--out", str(out)])
    assert res.exit_code == 0, res.output
    png, page = out / "report.png", out / "report.html"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    text = page.read_text()
    assert "data:image/png;base64," in text
    assert "<th>tuned</th><th>default</th>" in text  # per-implementation table
    assert "fwd fp16 1x2x64x32" in text  # the tuning study's curve
    assert "interpreter" in text


def test_report_without_bench_uses_tuned_results(tuned: tuple[str, str], tmp_path: Path) -> None:
    db, _ = tuned
    res = CliRunner().invoke(main, ["report", "--db", db, "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "report.html").read_text()
    assert "cpu-interpreter: fwd fp16 d32 full g1 bh2 sq64 sk64" in text


def test_report_rejects_a_file_that_is_not_bench_output(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    res = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "t.db"), "--bench",
                                    str(bad), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "not `autotune bench --json` output" in res.stderr
    assert not (tmp_path / "o" / "report.png").exists()
