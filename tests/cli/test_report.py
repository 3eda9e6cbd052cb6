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
    assert "<th>train fwd vs default</th>" in text and "<th>geomean</th>" in text
    assert "Searches (1)" in text and "<tr><td>fwd 1x2x64x32 fp16</td><td>2</td>" in text
    assert "interpreter" in text and "re-timed" in text  # the caption
    assert text.count('<tr class="entry">') == 1 and "block_m=" in text  # the winning config


def test_report_without_bench_is_about_this_device(tuned: tuple[str, str],
                                                   tmp_path: Path) -> None:
    db, _ = tuned
    res = CliRunner().invoke(main, ["report", "--db", db, "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "report.html").read_text()
    assert "device cpu-interpreter" in text  # no GPU here: the interpreter is this device
    assert "fwd fp16 d32 full g1 bh2 sq64 sk64" in text
    other = CliRunner().invoke(main, ["report", "--db", db, "--device", "H200", "--out",
                                      str(tmp_path / "h200")])
    assert other.exit_code == 0, other.output
    assert '<tr class="entry">' not in (tmp_path / "h200" / "report.html").read_text()


def test_report_refuses_a_bench_file_of_another_device(tuned: tuple[str, str],
                                                       tmp_path: Path) -> None:
    db, bench = tuned
    res = CliRunner().invoke(main, ["report", "--db", db, "--bench", bench, "--device", "H200",
                                    "--out", str(tmp_path)])
    assert res.exit_code == 1 and "measured on 'cpu-interpreter'" in res.stderr


def test_report_at_30_shapes_reads_well(tmp_path: Path) -> None:
    """The standard matrix tuned on the H200 (the repository's data): one row per problem in
    the ratio view, geomeans that are those of the bench numbers, a figure of a sane size,
    and every winning config listed. Hostile labels are escaped."""
    from PIL import Image

    from flashtune.db import DeviceInfo
    from flashtune.timing import geomean
    from tests.cli import _report_data

    dev = DeviceInfo(name="H200 <b>$\\frac{1}{2}$</b>", capability="9.0", sm_count=132,
                     memory_gb=140)
    url, doc = _report_data.build(tmp_path, device=dev, max_trials=6)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(doc))
    res = CliRunner().invoke(main, ["report", "--db", url, "--bench", str(bench), "--out",
                                    str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    w, h = Image.open(tmp_path / "r" / "report.png").size
    assert 1000 <= w <= 1600 and 1200 <= h <= 2400, (w, h)  # readable at 100 dpi, no scroll
    text = (tmp_path / "r" / "report.html").read_text()
    # S=1000 and S=1024 share a key: 28 winning configs per direction for 30 shapes.
    assert text.count('<tr class="entry">') == 56 and "<b>" not in text
    rows = [r for r in doc["rows"] if r["timing"] == "fwd"]
    assert len(rows) == 30
    def geo(anchor: str) -> str:
        return f"<td>{geomean([r['tflops']['tuned'] / r['tflops'][anchor] for r in rows]):.3g}"

    assert f"<th>geomean</th>{geo('default')}</td>{geo('cudnn')}</td>{geo('fa2')}</td>" in text
    assert text.count("speed-up over default") == 1 and text.count("<tr><td>fwd ") == 30


def test_report_rejects_a_file_that_is_not_bench_output(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    res = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "t.db"), "--bench",
                                    str(bad), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "not `autotune bench --json` output" in res.stderr
    assert not (tmp_path / "o" / "report.png").exists()


def test_report_writes_nothing_into_the_database(tuned: tuple[str, str], tmp_path: Path) -> None:
    """Reading studies must not create Optuna's tables, a missing database, or write into a
    read-only one (Optuna ignores SQLite's mode=ro)."""
    import hashlib
    import shutil
    import sqlite3

    from flashtune.db import open_storage

    plain = tmp_path / "plain.db"
    open_storage(str(plain)).close()  # flashtune's tables only, no studies yet
    studied = tmp_path / "studied.db"
    with sqlite3.connect(tuned[0]) as con:  # the studies may sit in the WAL file
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    shutil.copy(tuned[0], studied)
    for db in (plain, studied):
        before = hashlib.sha256(db.read_bytes()).hexdigest()
        res = CliRunner().invoke(main, ["report", "--db", f"sqlite:///{db}?mode=ro", "--out",
                                        str(tmp_path / "r")])
        assert res.exit_code == 0, res.output
        assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert "Searches (1)" in (tmp_path / "r" / "report.html").read_text()
    res = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "none.db"), "--out",
                                    str(tmp_path / "r")])
    assert res.exit_code == 0 and not (tmp_path / "none.db").exists()
