"""Processes that open one new tuning database at once all get Optuna's storage: the loser
of Optuna's unlocked table creation retries instead of failing (bare ``tune()`` calls in
parallel, or sweep workers that start together)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from flashtune.db import resolve_url

from .conftest import FILE_BACKENDS

N_PROCS = 6
ROUNDS = 5


def _open_at(args: tuple[str, float]) -> str:
    url, start = args
    from flashtune.autotune.tuner import optuna_storage

    time.sleep(max(0.0, start - time.time()))
    try:
        storage = optuna_storage(url)
        storage.get_all_studies()
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported back to the test
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


@pytest.mark.parametrize("db_url", FILE_BACKENDS, indirect=True)
def test_concurrent_first_open_of_optuna_storage(db_url: str) -> None:
    import optuna
    from sqlalchemy import MetaData, create_engine

    url = resolve_url(db_url)
    ctx = mp.get_context("spawn")
    with ctx.Pool(N_PROCS) as pool:
        # Let every process import optuna first, then open the database at the same moment.
        pool.map(_open_at, [("sqlite://", 0.0)] * N_PROCS)
        # The collision is timing-dependent (it hit about one round in three without the
        # retry), so the new database is made several times over.
        for _ in range(ROUNDS):
            start = time.time() + 1.0
            results = pool.map(_open_at, [(url, start)] * N_PROCS)
            assert results == ["ok"] * N_PROCS, results
            optuna.create_study(study_name="after-race", storage=url)
            assert [s.study_name for s in optuna.get_all_study_summaries(url)] == ["after-race"]
            engine = create_engine(url)
            meta = MetaData()
            meta.reflect(engine)
            meta.drop_all(engine)
            engine.dispose()
