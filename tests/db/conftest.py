"""Backends for the storage contract suite: SQLite in memory, SQLite on file and
PostgreSQL (a fresh database per test on the server named by FLASHTUNE_TEST_PG_URL)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from flashtune.db import Storage, open_storage


@pytest.fixture
def pg_url() -> Iterator[str]:
    base = os.environ.get("FLASHTUNE_TEST_PG_URL")
    if not base:
        pytest.skip("needs FLASHTUNE_TEST_PG_URL")
    name = f"ft_test_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


BACKENDS = ["memory", "file", pytest.param("postgres", marks=pytest.mark.postgres)]
FILE_BACKENDS = ["file", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> str:
    """A URL of a new, empty database of the backend the test is parametrized with."""
    backend = getattr(request, "param", "file")
    if backend == "memory":
        return "sqlite://"
    if backend == "file":
        return os.path.join(tmp_path, "tuning.db")
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def storage(db_url: str) -> Iterator[Storage]:
    s = open_storage(db_url)
    yield s
    s.close()
