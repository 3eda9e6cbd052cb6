"""The storage contract (the ``Storage`` docstring), held on every backend."""

from __future__ import annotations

import dataclasses
import os
import random
import sqlite3
import sys
from pathlib import Path

import pytest

from flashtune.db import Storage, open_storage, rdb, resolve_url
from flashtune.exceptions import DatabaseMissingError, SchemaError, StorageError
from flashtune.kernels.config import FwdConfig, config_to_dict
from tests.db import _data
from tests.db._data import A100, H200, OLD_SW, SW, put_kwargs
from tests.db.conftest import BACKENDS, FILE_BACKENDS

contract = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)


def put(storage: Storage, r: _data.Result, prefer: str = "faster") -> bool:
    return storage.put_result(r.device, r.software, r.key, r.config, prefer=prefer,
                              **put_kwargs(r))


@contract
def test_put_then_get_returns_every_field(storage: Storage) -> None:
    rng = random.Random(1)
    r = _data.result(rng)
    assert put(storage, r)
    got = storage.get_result(r.device, r.software, r.key)
    assert got is not None
    # Provenance is filled in by put_result: this host, now, this version.
    assert got.host and got.created_at.endswith("+00:00") and got.flashtune_version
    same = dataclasses.replace(r, host=got.host, created_at=got.created_at,
                               flashtune_version=got.flashtune_version)
    assert got == same and not got.stale
    assert storage.get_result(A100, r.software, r.key) is None


@contract
def test_partial_config_is_stored_in_full(storage: Storage) -> None:
    k = _data.key("fwd")
    storage.put_result(H200, SW, k, {"block_m": 128}, median_ms=1, p20_ms=1, p80_ms=1,
                       tflops=1, max_error=0, trials=1, search_seconds=0)
    got = storage.get_result(H200, SW, k)
    assert got is not None
    # Every knob the config type has, with the defaults filled in (new knobs included).
    assert got.config == {**config_to_dict(FwdConfig()), "block_m": 128}
    assert set(got.config) >= {"block_m", "block_n", "num_warps", "num_stages"}


@contract
@pytest.mark.parametrize("prefer, faster_second, expect_written, expect_ms", [
    ("faster", True, True, 1.0), ("faster", False, False, 2.0),
    ("ours", True, False, 2.0), ("theirs", False, True, 3.0),
])
def test_prefer_settles_conflicts(storage: Storage, prefer: str, faster_second: bool,
                                  expect_written: bool, expect_ms: float) -> None:
    rng = random.Random(2)
    first = _data.result(rng, median_ms=2.0, p20_ms=2.0, p80_ms=2.0)
    ms = 1.0 if faster_second else 3.0
    second = dataclasses.replace(first, median_ms=ms, p20_ms=ms, p80_ms=ms,
                                 config=_data.config(rng, first.key.direction))
    assert put(storage, first)
    assert put(storage, second, prefer=prefer) is expect_written
    got = storage.get_result(first.device, first.software, first.key)
    assert got is not None and got.median_ms == expect_ms
    assert got.config == (second if expect_written else first).config
    assert storage.counts()["entries"] == 1


@contract
def test_equal_times_keep_the_stored_result(storage: Storage) -> None:
    r = _data.result(random.Random(3))
    assert put(storage, r)
    assert not put(storage, r)


@contract
@pytest.mark.parametrize("change, match", [
    ({"config": {"block_m": 48}}, "block_m"),
    ({"config": {"bogus": 1}}, "bogus"),
    ({"p20_ms": 5.0, "median_ms": 1.0}, "p20"),
    ({"median_ms": float("nan")}, "median_ms"),
    ({"trials": -1}, "trials"),
])
def test_invalid_results_raise_and_write_nothing(storage: Storage, change: dict,
                                                 match: str) -> None:
    rng = random.Random(4)
    good = _data.result(rng)
    bad = dataclasses.replace(_data.result(rng), **change)
    with pytest.raises(ValueError, match=match):
        storage.put_results([good, bad])
    assert storage.results() == []


@contract
def test_unknown_prefer_is_rejected(storage: Storage) -> None:
    with pytest.raises(ValueError, match="prefer"):
        storage.put_results([_data.result(random.Random(5))], prefer="newest")


@contract
def test_put_results_reports_each_outcome(storage: Storage) -> None:
    a, b = _data.results(6, 2, devices=(H200,), software=(SW,))
    assert storage.put_results([a]) == ["added"]
    slower = dataclasses.replace(a, median_ms=a.median_ms * 2, p80_ms=a.median_ms * 3)
    faster = dataclasses.replace(a, median_ms=a.p20_ms)
    assert storage.put_results([slower, b]) == ["kept", "added"]
    assert storage.put_results([faster]) == ["replaced"]
    assert storage.put_results([slower], prefer="theirs") == ["replaced"]


@contract
def test_stale_results_are_kept_counted_and_never_served(storage: Storage) -> None:
    rng = random.Random(7)
    old = _data.result(rng, software=OLD_SW, device=H200)
    fresh = _data.result(rng, software=SW, device=H200)
    storage.put_results([old, fresh])
    assert storage.get_result(H200, SW, old.key) is None
    assert storage.get_result(H200, OLD_SW, old.key) == old
    assert set(storage.load_table(H200, SW)) == {fresh.key}
    listed = {r.key: r.stale for r in storage.results(software=SW)}
    assert listed == {old.key: True, fresh.key: False}
    assert [r.key for r in storage.results(software=SW, include_stale=False)] == [fresh.key]
    counts = storage.counts(software=SW)
    assert (counts["entries"], counts["stale"]) == (2, 1)
    assert counts["devices"][H200.fingerprint] == {"name": H200.name, "entries": 2, "stale": 1}


def test_a_backward_change_leaves_the_forward_results_fresh(storage: Storage,
                                                            tmp_path: Path) -> None:
    """Measured under the running software (both hashes known), a forward result is stored
    under the forward's hash and a backward one under the whole; after a change to the
    backward's own modules only the backward's go stale, and an export carries no
    process-only field."""
    from flashtune.db.exchange import export_json, import_json

    rng = random.Random(11)
    now = dataclasses.replace(SW, fwd_kernels_hash="f" * 64)
    fwd = _data.result(rng, direction="fwd")
    bwd = _data.result(rng, direction="bwd")
    for r in (fwd, bwd):
        assert storage.put_result(H200, now, r.key, r.config, **put_kwargs(r))
    stored = {r.key.direction: r.software.kernels_hash for r in storage.results(software=now)}
    assert stored == {"fwd": "f" * 64, "bwd": "a" * 64}
    assert set(storage.load_table(H200, now)) == {fwd.key, bwd.key}
    after = dataclasses.replace(now, kernels_hash="c" * 64)  # attn_bwd.py changed
    assert set(storage.load_table(H200, after)) == {fwd.key}
    assert storage.get_result(H200, after, fwd.key) is not None
    assert storage.get_result(H200, after, bwd.key) is None
    assert {r.key.direction: r.stale for r in storage.results(software=after)} == \
        {"fwd": False, "bwd": True}
    # A legacy forward result (the whole hash) is fresh until anything changes.
    legacy = _data.result(rng, direction="fwd")
    storage.put_results([legacy])
    assert storage.get_result(H200, now, legacy.key) == legacy
    assert storage.get_result(H200, after, legacy.key) is None
    data = export_json(storage)
    assert b"fwd_kernels_hash" not in data and ("f" * 64).encode() in data
    with open_storage(f"sqlite:///{tmp_path / 'copy.db'}") as copy:
        import_json(copy, data)
        assert set(copy.load_table(H200, after)) == {fwd.key}


@contract
def test_load_table_holds_only_this_device_and_software(storage: Storage) -> None:
    rs = _data.results(8, 30)
    storage.put_results(rs)
    table = storage.load_table(H200, SW)
    expect = {r.key: r for r in rs if r.device == H200 and r.software == SW}
    assert table == expect and len(expect) > 3


@contract
def test_results_filter_by_device_fingerprint_or_name(storage: Storage) -> None:
    rs = _data.results(9, 20)
    storage.put_results(rs)
    n_a100 = sum(r.device == A100 for r in rs)
    assert len(storage.results(device="a100")) == n_a100 > 0
    assert len(storage.results(device=A100.fingerprint)) == n_a100
    assert storage.results(device="no-such-gpu") == []
    assert len(storage.results()) == 20


@contract
def test_seeds_offer_stale_other_devices_and_nearest(storage: Storage) -> None:
    k = _data.key("fwd", sq_bucket=2048, sk_bucket=2048)
    rng = random.Random(10)
    mk = lambda **kw: _data.result(rng, direction="fwd", p=None, **kw)  # noqa: E731
    stale_here = dataclasses.replace(mk(device=H200, software=OLD_SW), key=k, problem=None)
    elsewhere = dataclasses.replace(mk(device=A100, software=SW), key=k, problem=None)
    near = dataclasses.replace(mk(device=H200, software=SW), key=_data.key("fwd"),
                               problem=None)
    far = dataclasses.replace(near, key=_data.key("fwd", sq_bucket=65536, sk_bucket=65536))
    other_family = dataclasses.replace(near, key=_data.key("fwd", causal=True))
    storage.put_results([stale_here, elsewhere, near, far, other_family])
    seeds = storage.seeds(H200, k, SW)
    assert seeds[:2] == [stale_here, elsewhere]
    assert seeds[0].stale and not seeds[1].stale
    assert seeds[2:] == [near, far]  # nearest first; another family never
    assert storage.nearest(H200, SW, k, n=1) == [near]


@contract
def test_misses_add_up_and_keep_an_example(storage: Storage) -> None:
    rng = random.Random(11)
    p1, p2 = _data.problem(rng), _data.problem(rng)
    k1, k2 = p1.key("fwd"), p2.key("bwd")
    storage.record_misses(H200, SW, {k1: (3, p1), k2: (1, p2)})
    storage.record_misses(H200, SW, {k1: (4, p1)})
    storage.record_misses(A100, SW, {k2: (10, p2)})
    assert storage.misses() == [(k2, 11, p2), (k1, 7, p1)]
    assert storage.misses(device="h200") == [(k1, 7, p1), (k2, 1, p2)]
    assert storage.counts()["misses"] == 18


@pytest.mark.parametrize("db_url", FILE_BACKENDS, indirect=True)
def test_a_second_storage_sees_committed_writes(db_url: str, storage: Storage) -> None:
    rs = _data.results(12, 5)
    storage.put_results(rs)
    with open_storage(db_url, read_only=True) as other:
        assert len(other.results()) == 5
        with pytest.raises(StorageError, match="read-only"):
            other.put_results(rs[:1])


# -- failure modes (files and servers) ----------------------------------------------------

@pytest.mark.parametrize("db_url", FILE_BACKENDS, indirect=True)
def test_newer_schema_is_refused(db_url: str, storage: Storage) -> None:
    with storage.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE flashtune_alembic_version SET version_num = '9999'")
    storage.close()
    for ro in (False, True):
        with pytest.raises(SchemaError, match="9999.*newer"):
            open_storage(db_url, read_only=ro)


@pytest.mark.parametrize("db_url", ["file"], indirect=True)
def test_garbage_file_is_a_storage_error(db_url: str) -> None:
    with open(db_url, "wb") as f:
        f.write(os.urandom(4096))
    for ro in (False, True):
        with pytest.raises(StorageError, match="not a flashtune database") as e:
            open_storage(db_url, read_only=ro)
        assert "\n" not in str(e.value) and db_url in str(e.value)


@pytest.mark.parametrize("db_url", ["file"], indirect=True)
def test_missing_read_only_database(db_url: str) -> None:
    with pytest.raises(DatabaseMissingError, match="no such database"):
        open_storage(db_url, read_only=True)
    assert not os.path.exists(db_url)


@pytest.mark.parametrize("db_url", ["file"], indirect=True)
def test_locked_database_is_a_storage_error(db_url: str, storage: Storage,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rdb, "BUSY_TIMEOUT_S", 0.2)
    other = open_storage(db_url)  # opened with the short timeout
    holder = sqlite3.connect(db_url, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StorageError, match="locked by another writer"):
            other.put_results(_data.results(13, 1))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert other.put_results(_data.results(13, 1)) == ["added"]
    other.close()


@pytest.mark.parametrize("db_url", ["file"], indirect=True)
def test_sqlite_file_uses_wal(db_url: str, storage: Storage) -> None:
    with storage.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


@pytest.mark.parametrize("db_url", ["memory"], indirect=True)
def test_bad_urls_are_storage_errors(db_url: str) -> None:
    for url in ("nosuchdialect://x/y", "postgresql+nosuchdriver://h/db", "mysql://h/db"):
        with pytest.raises(StorageError, match="cannot use this URL"):
            open_storage(url)


@pytest.mark.parametrize("db_url", ["memory"], indirect=True)
def test_location_defaults(db_url: str, tmp_path: os.PathLike[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASHTUNE_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(tmp_path, "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", os.path.join(tmp_path, "data"))
    if sys.platform.startswith("linux"):
        expect = os.path.join(tmp_path, "data", "flashtune", "tuning.db")
        assert resolve_url() == "sqlite:///" + expect
    expect = resolve_url()[len("sqlite:///"):]
    open_storage().close()
    assert os.path.isfile(expect)


@pytest.mark.parametrize("db_url", ["memory"], indirect=True)
def test_a_database_at_the_old_default_location_stays_in_use(
        db_url: str, tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASHTUNE_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(tmp_path, "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", os.path.join(tmp_path, "data"))
    old = os.path.join(tmp_path, "cache", "flashtune", "tuning.db")
    open_storage(old).close()
    assert resolve_url() == "sqlite:///" + old  # the user's results are not left behind
    monkeypatch.setenv("FLASHTUNE_DB", "postgresql://u@h/db")
    assert resolve_url() == "postgresql+psycopg://u@h/db"
    assert resolve_url("rel.db") == "sqlite:///" + os.path.abspath("rel.db")


@contract
@pytest.mark.parametrize("stored_origin, stored_verify, incoming_origin, expect", [
    # A measurement here replaces an untrusted claim whatever it claimed (it is slower).
    ("imported", "unverified", "local", "replaced"),
    ("unknown", "unverified", "local", "replaced"),
    ("shipped", "unverified", "local", "replaced"),
    # ... but a result measured or verified here stands by speed as before.
    ("imported", "passed", "local", "kept"),
    ("local", "unverified", "local", "kept"),
    # An untrusted claim never displaces a trusted result under "faster", even when faster.
    ("local", "unverified", "imported", "kept"),
    ("imported", "passed", "imported", "kept"),
    ("imported", "unverified", "imported", "replaced"),  # between claims: the faster
])
def test_trust_settles_conflicts_before_speed(storage: Storage, stored_origin: str,
                                              stored_verify: str, incoming_origin: str,
                                              expect: str) -> None:
    r = _data.result(random.Random(14), device=H200, software=SW)
    stored = dataclasses.replace(r, origin=stored_origin, verify=stored_verify)
    # The incoming result is slower when it is local, faster when it is a claim.
    factor = 2.0 if incoming_origin == "local" else 0.5
    incoming = _data.retimed(r, r.median_ms * factor, origin=incoming_origin)
    assert storage.put_results([stored]) == ["added"]
    assert storage.put_results([incoming]) == [expect]
    got = storage.get_result(H200, SW, r.key)
    assert got is not None
    assert got.origin == (incoming_origin if expect == "replaced" else stored_origin)


@contract
def test_verify_outcomes_are_stored_and_a_failed_result_is_never_served(
        storage: Storage) -> None:
    a, b = (dataclasses.replace(r, origin="imported")
            for r in _data.results(15, 2, devices=(H200,), software=(SW,)))
    storage.put_results([a, b])
    storage.set_verify(a, "passed", median_ms=a.median_ms * 2, p20_ms=a.median_ms * 1.9,
                       p80_ms=a.median_ms * 2.1, max_error=0.002)
    storage.set_verify(b, "failed")
    got = storage.get_result(H200, SW, a.key)
    assert got is not None and (got.verify, got.origin) == ("passed", "imported")
    assert got.verified_at is not None and got.trusted
    assert got.median_ms == a.median_ms * 2 and got.max_error == 0.002
    assert got.tflops == pytest.approx(a.tflops / 2)  # the same FLOPs in twice the time
    assert storage.get_result(H200, SW, b.key) is None
    assert set(storage.load_table(H200, SW)) == {a.key}
    assert set(storage.failed(H200, SW)) == {b.key}
    assert storage.failed(H200, SW)[b.key].verify == "failed"
    assert {r.key for r in storage.results(software=SW)} == {a.key, b.key}  # kept, listed
    assert all(n.key != b.key for n in storage.nearest(H200, SW, b.key, n=5))
    # A shipped entry gets a row of its own to hold its outcome.
    c = dataclasses.replace(_data.result(random.Random(16), device=H200, software=SW),
                            origin="shipped")
    storage.set_verify(c, "failed")
    assert storage.failed(H200, SW)[c.key].origin == "shipped"
    with pytest.raises(ValueError, match="outcome must be"):
        storage.set_verify(a, "maybe")


@contract
def test_a_result_without_a_ptxas_version_is_fresh_beside_a_newer_one(storage: Storage) -> None:
    now = dataclasses.replace(SW, ptxas="12.9.86")
    old = dataclasses.replace(SW, ptxas="")  # stored before ptxas versions were recorded
    r = _data.result(random.Random(17), device=H200, software=old)
    storage.put_results([dataclasses.replace(r, origin="unknown")])
    got = storage.get_result(H200, now, r.key)
    assert got is not None and not got.stale  # judged by the other fields
    other = dataclasses.replace(now, ptxas="13.0.48")
    assert storage.get_result(H200, other, r.key) is not None
    # A newer, slower measurement under today's ptxas is the one served: it is trusted.
    mine = _data.retimed(dataclasses.replace(r, software=now), r.median_ms * 3)
    storage.put_results([mine])
    assert storage.get_result(H200, now, r.key).median_ms == mine.median_ms
    assert storage.load_table(H200, now)[r.key].median_ms == mine.median_ms
    # Under another ptxas, today's result is stale and the unrecorded one still serves.
    assert storage.get_result(H200, other, r.key).median_ms == r.median_ms
    assert {x.stale for x in storage.results(software=now)} == {False}


def test_the_suite_never_touches_the_users_database() -> None:
    from flashtune.db import default_path, resolve_url

    assert "flashtune-test-home-" in str(default_path())  # tests/conftest.py's folder
    assert "flashtune-test-home-" in resolve_url(None)
