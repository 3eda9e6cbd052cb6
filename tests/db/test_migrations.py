"""Alembic migrations: the models equal the newest migration, old database files
upgrade, and Optuna's tables live beside ours.

``assets/tuning_v0001.db`` is a database of the first schema (revision 0001), written
by flashtune 0.1.0 and kept as it was; ``assets/tuning_v0001.json`` is its export.
Every later schema must open it, upgrade it and export the same content.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from flashtune.db import open_storage
from flashtune.db.exchange import export_json
from flashtune.db.models import SCHEMA_REVISION, VERSION_TABLE, Base
from flashtune.db.rdb import _alembic_config, _scripts
from flashtune.exceptions import SchemaError, SchemaOutdatedError
from tests.db._data import H200, SW, results
from tests.db.conftest import FILE_BACKENDS

ASSETS = Path(__file__).parent / "assets"


def revision(storage: Any) -> str | None:
    with storage.engine.connect() as conn:
        return MigrationContext.configure(
            conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


@pytest.mark.parametrize("db_url", FILE_BACKENDS, indirect=True)
def test_models_equal_the_newest_migration(db_url: str) -> None:
    with open_storage(db_url) as s, s.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        assert compare_metadata(ctx, Base.metadata) == []
        assert revision(s) == _scripts().get_current_head() == SCHEMA_REVISION


def test_first_schema_file_upgrades_and_keeps_its_content(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    shutil.copy(ASSETS / "tuning_v0001.db", db)
    with sqlite3.connect(db) as conn:
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [("0001",)]
    with open_storage(str(db)) as s:
        assert revision(s) == _scripts().get_current_head()
        assert export_json(s) == (ASSETS / "tuning_v0001.json").read_bytes()
        assert [(k.direction, n) for k, n, _ in s.misses()] == [("fwd", 5), ("bwd", 2)]
        assert s.put_results(results(99, 1, devices=(H200,), software=(SW,))) == ["added"]


def test_downgrade_to_nothing_and_back(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cycle.db'}"
    open_storage(url).close()
    cfg = _alembic_config()
    s = open_storage(url)
    with s.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "base")
    assert not [t for t in inspect(s.engine).get_table_names() if t.startswith("ft_")]
    s.close()
    with open_storage(url) as again:  # opening upgrades from nothing
        assert {"ft_devices", "ft_software", "ft_problems", "ft_results", "ft_misses"} <= \
            set(inspect(again.engine).get_table_names())


def test_read_only_database_without_our_tables(tmp_path: Path) -> None:
    db = tmp_path / "empty.db"
    sqlite3.connect(db).execute("CREATE TABLE other (x)").connection.close()
    with pytest.raises(SchemaError, match="has no flashtune tables"):
        open_storage(str(db), read_only=True)


@pytest.mark.parametrize("db_url", FILE_BACKENDS, indirect=True)
def test_optuna_studies_share_the_database(db_url: str) -> None:
    optuna = pytest.importorskip("optuna")
    from flashtune.db import resolve_url

    url = resolve_url(db_url)
    with open_storage(url) as s:
        s.put_results(results(41, 3))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name="fwd-search")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    with open_storage(url) as s:  # our migration check ignores optuna's tables
        assert len(s.results()) == 3
        s.put_results(results(42, 2, devices=(H200,)))
        tables = set(inspect(s.engine).get_table_names())
    assert {"alembic_version", VERSION_TABLE, "studies", "ft_results"} <= tables
    assert len(optuna.load_study(study_name="fwd-search", storage=url).trials) == 2


def test_a_current_database_opens_without_alembic(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with open_storage(str(db)) as s:
        s.put_results(results(43, 4, devices=(H200,), software=(SW,)))
    code = ("import sys; from flashtune.db import open_storage; "
            "from tests.db._data import H200, SW; "
            f"s = open_storage({str(db)!r}, read_only=True); "
            "assert len(s.load_table(H200, SW)) == 4; "
            "assert 'alembic' not in sys.modules, 'alembic was imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).parents[2])
    assert p.returncode == 0, p.stderr


def _sweep_tables_of_flashtune_0_1_0() -> Any:
    """The sweep tables as flashtune 0.1.0 made them: their own MetaData and create_all."""
    from sqlalchemy import (
        Column,
        Float,
        Index,
        Integer,
        MetaData,
        String,
        Table,
        Text,
        UniqueConstraint,
    )

    md = MetaData()
    Table("ft_sweeps", md, Column("id", String(32), primary_key=True),
          Column("device_json", Text, nullable=False),
          Column("software_fingerprint", String(32), nullable=False),
          Column("trials", Integer, nullable=True), Column("total", Integer, nullable=False),
          Column("created_at", Float, nullable=False))
    Table("ft_sweep_claims", md, Column("id", Integer, primary_key=True, autoincrement=True),
          *(Column(c, String(32), nullable=False) for c in ("sweep_id", "task")),
          Column("seq", Integer, nullable=False), Column("direction", String(3), nullable=False),
          *(Column(c, Text, nullable=False) for c in ("key_json", "problem_json")),
          Column("state", String(8), nullable=False),
          *(Column(c, String(200), nullable=True) for c in ("worker", "host")),
          Column("pid", Integer, nullable=True), Column("lease_expires", Float, nullable=True),
          Column("attempts", Integer, nullable=False), Column("trials", Integer, nullable=True),
          *(Column(c, Float, nullable=True) for c in ("best_tflops", "median_ms")),
          Column("note", Text, nullable=True),
          *(Column(c, Float, nullable=True) for c in ("started_at", "finished_at")),
          UniqueConstraint("sweep_id", "task", name="uq_ft_sweep_claims_task"),
          Index("ix_ft_sweep_claims_state", "sweep_id", "state", "seq"))
    return md


def _schema_diff(s: Any) -> list[Any]:
    with s.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return list(compare_metadata(ctx, Base.metadata))


def test_first_schema_file_gets_the_sweep_tables(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    shutil.copy(ASSETS / "tuning_v0001.db", db)
    with sqlite3.connect(db) as conn:
        assert not conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'ft_sweep%'"
                                ).fetchall()
    with open_storage(str(db)) as s:
        assert revision(s) == SCHEMA_REVISION
        assert {"ft_sweeps", "ft_sweep_claims"} <= set(inspect(s.engine).get_table_names())
        assert _schema_diff(s) == []


def test_sweep_tables_made_by_create_all_are_kept(tmp_path: Path) -> None:
    from sqlalchemy import create_engine, text

    db = tmp_path / "swept.db"
    shutil.copy(ASSETS / "tuning_v0001.db", db)
    engine = create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:  # what `autotune sweep` of flashtune 0.1.0 left behind
        _sweep_tables_of_flashtune_0_1_0().create_all(conn)
        conn.execute(text("INSERT INTO ft_sweeps VALUES ('s1', '{}', 'sw', NULL, 1, 1.5)"))
        conn.execute(text(
            "INSERT INTO ft_sweep_claims (sweep_id, task, seq, direction, key_json, "
            "problem_json, state, attempts) VALUES ('s1', 't1', 0, 'fwd', '{}', '{}', "
            "'done', 1)"))
    engine.dispose()
    with open_storage(str(db)) as s:
        assert revision(s) == SCHEMA_REVISION
        assert _schema_diff(s) == []
        with s.engine.connect() as conn:
            assert conn.execute(text("SELECT sweep_id, task, state FROM ft_sweep_claims")
                                ).all() == [("s1", "t1", "done")]
        assert export_json(s) == (ASSETS / "tuning_v0001.json").read_bytes()


def test_an_older_schema_file_is_refused_read_only_with_the_way_out(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    shutil.copy(ASSETS / "tuning_v0001.db", db)
    before = db.read_bytes()
    with pytest.raises(SchemaOutdatedError, match="'0001', older than .*autotune info"):
        open_storage(str(db), read_only=True)
    assert db.read_bytes() == before  # a read-only open changed nothing


# The 0003 upgrade, on a database flashtune wrote at 0002 (``assets/make_v0002.py``): on
# the H200, one forward problem tuned twice under one Triton and kernel sources but two
# torch/CUDA versions (0.5 ms and 0.4 ms), a backward problem, a forward one under an old
# Triton, a packed batch and a dense one that shared a key, an A100 entry, and two
# recorded misses (one of a packed batch).
V2_CODE = dict(triton="3.9.0", kernels_hash="c" * 64)


def _v0002_database(db_url: str, tmp_path: Path) -> str:
    """The 0002 asset as a database of ``db_url``'s backend: the file itself for SQLite; for
    PostgreSQL, the 0002 schema made by the migrations and every row of the asset copied."""
    from sqlalchemy import MetaData, create_engine

    from flashtune.db import resolve_url

    if "://" not in db_url:
        shutil.copy(ASSETS / "tuning_v0002.db", db_url)
        return db_url
    url = resolve_url(db_url)
    engine = create_engine(url)
    cfg = _alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0002")
    src = create_engine(f"sqlite:///{ASSETS / 'tuning_v0002.db'}")
    md = MetaData()
    md.reflect(src)
    with src.connect() as s, engine.begin() as d:
        for t in md.sorted_tables:
            if t.name.startswith("ft_"):
                rows = [dict(r._mapping) for r in s.execute(t.select())]
                if rows:
                    d.execute(t.insert(), rows)
        for t in ("ft_devices", "ft_software", "ft_problems", "ft_results", "ft_misses"):
            d.exec_driver_sql(f"SELECT setval(pg_get_serial_sequence('{t}', 'id'), "
                              f"(SELECT max(id) FROM {t}))")
    src.dispose()
    engine.dispose()
    return url


@pytest.mark.parametrize("db_url", FILE_BACKENDS, indirect=True)
def test_schema_0002_database_upgrades_keeps_rows_and_rejudges_them(db_url: str,
                                                                     tmp_path: Path) -> None:
    from dataclasses import replace

    from sqlalchemy import create_engine, text

    from flashtune.db.fingerprint import SoftwareInfo
    from flashtune.problem import Problem

    url = _v0002_database(db_url, tmp_path)
    engine = create_engine(url if "://" in url else f"sqlite:///{url}")
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).all() == [
            ("0002",)]
        assert conn.execute(text("SELECT count(*) FROM ft_results")).scalar() == 7
    engine.dispose()
    with open_storage(url) as s:
        assert revision(s) == SCHEMA_REVISION and _schema_diff(s) == []
        # Today's torch and CUDA differ from both stored ones, and ptxas is recorded now:
        # the results made under this Triton and these kernel sources are fresh again.
        now = SoftwareInfo(torch="2.14.0", triton=V2_CODE["triton"], cuda="13.0",
                           kernels_hash=V2_CODE["kernels_hash"], ptxas="12.9.86")
        everything = s.results(software=now)
        # The two torch versions' rows became one software row: the faster result stayed.
        assert len(everything) == 6
        table = s.load_table(H200, now)
        p1 = Problem(batch=2, heads_q=16, heads_kv=16, seqlen_q=1024, seqlen_k=1024,
                     head_dim=128)
        fwd = table[p1.key("fwd")]
        assert (fwd.median_ms, fwd.host) == (0.4, "node-b")
        assert (fwd.software.torch, fwd.software.cuda, fwd.software.ptxas) == (
            "2.13.0", "12.8", "")  # provenance kept per result; ptxas not recorded then
        assert len(table) == 4 and all(k.deterministic for k in table)
        # The packed batch moved to a key of its own; the dense one kept the old key.
        packed = [r for r in table.values() if r.key.packed]
        assert [(r.key.tokens_bucket, r.problem.total_q, r.median_ms) for r in packed] == [
            (8192, 6000, 1.5)]
        dense = packed[0].key.__class__(**{**packed[0].key.as_dict(), "packed": False,
                                           "tokens_bucket": 0})
        assert table[dense].median_ms == 2.5 and not table[dense].problem.packed
        stale = [r for r in everything if r.stale]
        assert [r.software.triton for r in stale] == ["3.6.0"]  # other Triton: stale still
        # Origin: flashtune <= 0.1 did not record it; a measurement here replaces such a row.
        assert {r.origin for r in everything} == {"unknown"}
        assert all(r.verify == "unverified" and r.verified_at is None for r in everything)
        slower = replace(fwd, software=now, median_ms=0.6, p20_ms=0.6, p80_ms=0.6,
                         tflops=fwd.tflops * 0.4 / 0.6, origin="local")
        assert s.put_results([slower]) == ["added"]  # now a software row with ptxas
        # ... and two fresh results hold the key: the one measured here is served.
        assert s.load_table(H200, now)[p1.key("fwd")].median_ms == 0.6
        assert [(k.direction, k.packed, n) for k, n, _ in s.misses()] == [
            ("bwd", False, 3), ("bwd", True, 2)]
    if "://" not in url:
        with sqlite3.connect(url) as conn:  # no row lost its references
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []


def test_the_dispatcher_upgrades_an_older_database_once(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from flashtune.db.fingerprint import SoftwareInfo
    from flashtune.dispatch import _table

    db = tmp_path / "v2.db"
    shutil.copy(ASSETS / "tuning_v0002.db", db)
    monkeypatch.setenv("FLASHTUNE_DB", str(db))
    now = SoftwareInfo(torch="2.14.0", cuda="13.0", ptxas="12.9.86", **V2_CODE)
    where, user, failed, error = _table.read_user(H200, now)
    assert error is None and len(user) == 4 and failed == {}
    with open_storage(str(db), read_only=True) as s:
        assert revision(s) == SCHEMA_REVISION
