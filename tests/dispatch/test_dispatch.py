"""The dispatcher: the ladder (tuned, nearest, default), misses, strict mode, online
tuning, bad databases, the hot path's cost. Real SQLite files throughout, filled through
the storage API; corrupt databases are real files too."""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import flashtune
from flashtune import dispatch
from flashtune.db import device_info, open_storage, software_info
from flashtune.db.fingerprint import SoftwareInfo
from flashtune.exceptions import DispatchMissError
from flashtune.kernels.config import (
    BwdConfig,
    FwdConfig,
    config_to_dict,
    default_bwd,
    default_fwd,
    is_feasible,
)
from flashtune.kernels.reference import attention_ref
from flashtune.problem import Problem

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Configs no heuristic picks, so a test can tell where a config came from.
FWD_A = FwdConfig(block_m=16, block_n=16, num_warps=2, num_stages=1)
FWD_B = FwdConfig(block_m=32, block_n=16, num_warps=1, num_stages=2)
BWD_A = BwdConfig(dkdv_block_m=16, dkdv_block_n=16, dkdv_warps=2, dkdv_stages=1,
                  dq_block_m=16, dq_block_n=16, dq_warps=2, dq_stages=1, pre_block_m=16)


def prob(**kw) -> Problem:
    base = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32,
                dtype="bf16", causal=True)
    base.update(kw)
    return Problem(**base)


def qkv(p: Problem, device: str, grad: bool = False) -> tuple[torch.Tensor, ...]:
    dt = DTYPES[p.dtype]
    q = torch.randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim, dtype=dt, device=device)
    k = torch.randn(p.batch, p.heads_kv, p.seqlen_k, p.head_dim, dtype=dt, device=device)
    v = torch.randn_like(k)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def put(db: str | os.PathLike[str], p: Problem, direction: str, config, *,
        median_ms: float = 1.0, software: SoftwareInfo | None = None) -> None:
    """Store a tuned result for ``p`` on this process's device, as the tuner would."""
    with open_storage(db) as st:
        st.put_result(device_info(), software or software_info(), p.key(direction),
                      config_to_dict(config), median_ms=median_ms, p20_ms=median_ms * 0.9,
                      p80_ms=median_ms * 1.1, tflops=p.flops(direction) / (median_ms * 1e9),
                      max_error=1e-3, trials=4,
                      search_seconds=1.0, problem=p)


def call(p: Problem, device: str, grad: bool = False, **kw) -> torch.Tensor:
    q, k, v = qkv(p, device, grad)
    window = tuple(p.window)
    out = flashtune.flash_attention(q, k, v, causal=p.causal, window_size=window,
                                    softcap=p.softcap, **kw)
    ref, _ = attention_ref(q, k, v, causal=p.causal, window_size=window, softcap=p.softcap)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    if grad:
        out.float().square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    return out


def chosen(p: Problem, device: str, direction: str = "fwd"):
    q, k, _ = qkv(p, device)
    return dispatch.resolve(direction, q, k, p.causal, tuple(p.window), p.softcap)


def fresh_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh, empty tuning database as FLASHTUNE_DB, and a dispatcher that forgot all."""
    path = tmp_path / "tuning.db"
    open_storage(path).close()
    monkeypatch.setenv("FLASHTUNE_DB", str(path))
    for name in ("FLASHTUNE_STRICT", "FLASHTUNE_TUNE_ON_MISS", "FLASHTUNE_DIST_SYNC"):
        monkeypatch.delenv(name, raising=False)
    dispatch.flush_misses(10)
    dispatch.reload()
    yield path
    dispatch.flush_misses(10)
    dispatch.reload()


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from fresh_db(tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- the ladder


def test_exact_bucket_wins_for_both_directions(db, device, seed):
    p = prob()
    assert is_feasible(FWD_A, p)[0] and is_feasible(BWD_A, p)[0]
    put(db, p, "fwd", FWD_A)
    put(db, p, "bwd", BWD_A)
    put(db, prob(seqlen_q=256, seqlen_k=256), "fwd", FWD_B)  # another bucket: not chosen
    call(p, device, grad=True)
    assert chosen(p, device, "fwd") == FWD_A
    assert chosen(p, device, "bwd") == BWD_A
    # Another shape in the same buckets (40 -> 64) is the same key: the same entry.
    assert chosen(dataclasses.replace(p, seqlen_q=40, seqlen_k=40), device) == FWD_A
    assert dispatch.stats()["table_loads"] == 1


def test_nearest_bucket_of_the_same_family(db, device, seed):
    p = prob(seqlen_q=32, seqlen_k=32)
    put(db, prob(seqlen_q=64, seqlen_k=64), "fwd", FWD_A, median_ms=5.0)  # distance 2
    put(db, prob(seqlen_q=256, seqlen_k=256), "fwd", FWD_B, median_ms=0.1)  # distance 6
    # Exact buckets, but another family (head dim, dtype, mask): never served.
    put(db, prob(seqlen_q=32, seqlen_k=32, head_dim=64), "fwd", FWD_B)
    put(db, prob(seqlen_q=32, seqlen_k=32, dtype="fp16"), "fwd", FWD_B)
    put(db, prob(seqlen_q=32, seqlen_k=32, causal=False), "fwd", FWD_B)
    call(p, device)
    assert chosen(p, device) == FWD_A


def test_default_when_no_bucket_of_the_family(db, device, seed):
    p = prob(seqlen_q=48, seqlen_k=48)
    put(db, prob(head_dim=64), "fwd", FWD_A)
    put(db, prob(causal=False), "bwd", BWD_A)
    call(p, device, grad=True)
    assert chosen(p, device, "fwd") == default_fwd(p)
    assert chosen(p, device, "bwd") == default_bwd(p)


def test_stale_results_are_never_served(db, device, seed):
    p = prob()
    sw = software_info()
    put(db, p, "fwd", FWD_A,
        software=dataclasses.replace(sw, kernels_hash="0" * 64, fwd_kernels_hash="0" * 64))
    assert chosen(p, device) == default_fwd(p)


def test_infeasible_and_corrupt_entries_are_skipped(db, device, seed, caplog):
    p = prob()
    # Fits every knob's choices, but its score tile needs ~2300 registers per thread.
    bad = FwdConfig(block_m=256, block_n=256, num_warps=1, num_stages=1)
    assert not is_feasible(bad, p)[0]
    put(db, p, "fwd", bad)
    other = prob(seqlen_q=128, seqlen_k=128)
    put(db, other, "fwd", FWD_B)
    put(db, prob(seqlen_q=256, seqlen_k=256), "fwd", FWD_A)
    with sqlite3.connect(db) as con:  # a row whose config no flashtune can run
        con.execute("UPDATE ft_results SET config_json = ? WHERE median_ms = 1.0 AND id IN "
                    "(SELECT r.id FROM ft_results r JOIN ft_problems pr ON r.problem_id = pr.id "
                    "WHERE pr.sq_bucket = 128)", ('{"block_m": 7}',))
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        call(p, device)
        assert chosen(p, device) == FWD_A  # the exact entry is infeasible, 128 is corrupt
    assert any("skipping" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- misses


def test_each_miss_logged_once_and_recorded(db, device, seed, caplog):
    with caplog.at_level(logging.INFO, logger="flashtune.dispatch"):
        for s in (24, 20, 24, 20, 24):  # two shapes of one key (bucket 32), five calls
            call(prob(seqlen_q=s, seqlen_k=s), device)
    lines = [r for r in caplog.records if "no tuned fwd config" in r.getMessage()]
    assert len(lines) == 1
    assert dispatch.flush_misses(30)
    with open_storage(db, read_only=True) as st:
        misses = st.misses()
    key = prob(seqlen_q=24, seqlen_k=24).key("fwd")
    assert [(k, c) for k, c, _ in misses] == [(key, 2)]  # one count per process and shape
    assert misses[0][2].seqlen_q in (20, 24)


def test_miss_recording_can_be_turned_off(db, device, seed, monkeypatch):
    monkeypatch.setenv("FLASHTUNE_RECORD_MISSES", "0")  # a read-only training job
    call(prob(seqlen_q=24, seqlen_k=24), device)
    dispatch.flush_misses(30)
    with open_storage(db, read_only=True) as st:
        assert st.misses() == []


def test_strict_mode_raises_on_a_miss(db, device, seed, monkeypatch):
    monkeypatch.setenv("FLASHTUNE_STRICT", "1")
    p = prob()
    with pytest.raises(DispatchMissError, match="FLASHTUNE_STRICT=1.*fwd bf16 d32 causal"):
        call(p, device)
    put(db, p, "fwd", FWD_A)
    dispatch.reload()
    call(p, device)  # a tuned forward runs
    q, k, v = qkv(p, device, grad=True)
    out = flashtune.flash_attention(q, k, v, causal=True)
    with pytest.raises(DispatchMissError, match="no tuned bwd config"):
        out.sum().backward()  # the backward has no tuned entry


def test_online_tuning_on_a_miss(db, device, seed, monkeypatch):
    pytest.importorskip("optuna")
    monkeypatch.setenv("FLASHTUNE_TUNE_ON_MISS", "1")
    monkeypatch.setenv("FLASHTUNE_TUNE_TRIALS", "2")
    p = prob(batch=1, seqlen_q=32, seqlen_k=32)
    call(p, device)
    call(dataclasses.replace(p, seqlen_q=30, seqlen_k=30), device)  # same key: no new tune
    assert dispatch.stats()["tunes"] == 1
    assert dispatch.explain(*qkv(p, device), causal=True).fwd.source == "tuned"
    with open_storage(db, read_only=True) as st:  # written for the next run and for sweeps
        assert st.get_result(device_info(), software_info(), p.key("fwd")) is not None


# ----------------------------------------------------------------------------- bad databases


def _locked(path: Path, monkeypatch: pytest.MonkeyPatch) -> sqlite3.Connection:
    # No timeout patching: the dispatcher's own short busy timeout must keep the step quick.
    open_storage(path).close()
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA locking_mode = EXCLUSIVE")
    con.execute("BEGIN EXCLUSIVE")
    con.execute("INSERT INTO ft_devices (fingerprint, name, capability, sm_count, memory_gb) "
                "VALUES ('x', 'x', 'x', 0, 0)")
    return con


def _bad_database(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "bad.db"
    if kind == "corrupt":
        path.write_bytes(os.urandom(4096))
    elif kind == "truncated":
        open_storage(path).close()
        path.write_bytes(path.read_bytes()[:1000])
    elif kind == "missing":
        path = tmp_path / "no" / "such.db"
    elif kind == "directory":
        path.mkdir()
    elif kind == "other-schema":
        open_storage(path).close()
        with sqlite3.connect(path) as con:
            con.execute("UPDATE flashtune_alembic_version SET version_num = 'ffff_from_future'")
    elif kind == "not-ours":
        with sqlite3.connect(path) as con:
            con.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    elif kind == "locked":
        return path, _locked(path, monkeypatch)
    return path, None


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "missing", "directory", "other-schema",
                                  "not-ours", "locked"])
def test_bad_database_warns_once_and_training_goes_on(kind, tmp_path, monkeypatch, device, seed):
    path, holder = _bad_database(kind, tmp_path, monkeypatch)
    monkeypatch.setenv("FLASHTUNE_DB", str(path))
    dispatch.reload()
    torch.manual_seed(seed)
    dt = torch.bfloat16
    proj = torch.nn.Linear(32, 3 * 2 * 32, dtype=dt, device=device)  # q, k, v: 2 heads of 32
    opt = torch.optim.SGD(proj.parameters(), lr=1e-2)
    x = torch.randn(2, 24, 32, dtype=dt, device=device)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in (16, 24):  # two steps, two shapes: still one warning
                q, k, v = proj(x[:, :s]).view(2, s, 3, 2, 32).permute(2, 0, 3, 1, 4)
                out = flashtune.flash_attention(q, k, v, causal=True)
                out.float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                assert torch.isfinite(out).all()
        dispatch.flush_misses(10)
    finally:
        if holder is not None:
            holder.close()
        dispatch.reload()
    ours = [w for w in caught if "tuning database" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "Training goes on" in str(ours[0].message)


def test_misses_dropped_while_the_database_is_locked_are_counted(db, monkeypatch, device,
                                                                 seed):
    from flashtune.dispatch import _misses

    monkeypatch.setattr(_misses, "WRITE_BUSY_TIMEOUT_S", 0.2)
    call(prob(seqlen_q=24, seqlen_k=24), device)  # the table is loaded, a miss recorded
    assert dispatch.flush_misses(30)
    assert dispatch.stats()["misses_recorded"] == 1
    holder = _locked(db, monkeypatch)  # another writer holds the database
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(prob(seqlen_q=100, seqlen_k=100), device)
            call(prob(seqlen_q=300, seqlen_k=300), device)
            assert dispatch.flush_misses(30)
    finally:
        holder.close()
    got = dispatch.stats()
    assert (got["misses_dropped"], got["misses_recorded"]) == (2, 1)
    assert any("misses_dropped" in str(w.message) for w in caught)
    call(prob(seqlen_q=1000, seqlen_k=1000), device)  # the lock is gone: recorded again
    assert dispatch.flush_misses(30)
    assert dispatch.stats()["misses_recorded"] == 2
    with open_storage(db, read_only=True) as st:
        assert sorted(c for _, c, _ in st.misses()) == [1, 1]


def test_a_postgresql_server_that_never_answers_costs_seconds(monkeypatch, device, seed):
    """A server that accepts the connection and then says nothing: the dispatcher gives up
    as soon as on a locked SQLite file (libpq's connect timeout, 2 s), and training goes on."""
    import socket
    import threading

    pytest.importorskip("psycopg")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])  # accepted, never answered
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    port = server.getsockname()[1]
    monkeypatch.setenv("FLASHTUNE_DB", f"postgresql://u:secret@127.0.0.1:{port}/tuning")
    dispatch.reload()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            call(prob(), device)
            spent = time.perf_counter() - t0
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        server.close()
        monkeypatch.setenv("FLASHTUNE_RECORD_MISSES", "0")
        dispatch.reload()
    ours = [str(w.message) for w in caught if "tuning database" in str(w.message)]
    assert len(ours) == 1 and "secret" not in ours[0], ours
    assert spent < 8.0, spent  # 2 s of connect timeout (+ a pre-ping retry), not 10 s or more


# ----------------------------------------------------------------------------- cost


def test_cache_hit_costs_at_most_2us(db, device):
    p = prob()
    q, k, _ = qkv(p, device)
    dispatch.resolve("fwd", q, k, True, (-1, -1), 0.0)  # first sight
    n, best = 20000, float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            dispatch.resolve("fwd", q, k, True, (-1, -1), 0.0)
        best = min(best, (time.perf_counter() - t0) / n)
    assert best <= 2e-6, f"cache-hit lookup took {best * 1e6:.2f} us"


def test_import_is_light_until_the_first_call(tmp_path, device):
    code = (
        "import sys, torch\n"
        "import flashtune\n"
        "assert 'sqlalchemy' not in sys.modules and 'triton' not in sys.modules\n"
        "fa = flashtune.flash_attention\n"
        "assert 'sqlalchemy' not in sys.modules and 'optuna' not in sys.modules\n"
        "from flashtune.kernels.attention import get_config_resolver\n"
        "from flashtune import dispatch\n"
        "assert get_config_resolver() is dispatch.resolve\n"
        f"q = torch.randn(1, 1, 16, 32, dtype=torch.bfloat16, device={device!r}); fa(q, q, q)\n"
        "assert 'sqlalchemy' in sys.modules and 'optuna' not in sys.modules\n"
    )
    env = dict(os.environ, FLASHTUNE_DB=str(tmp_path / "t.db"))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_kernels_flash_attention_works_without_the_dispatcher(db, device, seed):
    from flashtune.kernels import attention

    p = prob()
    put(db, p, "fwd", FWD_A)
    before = attention.get_config_resolver()
    attention.set_config_resolver(None)
    try:
        q, k, v = qkv(p, device)
        out = attention.flash_attention(q, k, v, causal=True)
        ref, _ = attention_ref(q, k, v, causal=True)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        assert dispatch.stats()["first_sights"] == 0
    finally:
        attention.set_config_resolver(before)


def test_a_free_order_call_is_served_its_deterministic_twins_hopper_config(
        db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``deterministic=False`` call whose only same-key entry is deterministic, with a
    Hopper config whose free order does not fit in shared memory, is served that entry (run
    in the fixed order), not another GQA ratio's entry that fits. Before session 34's fix
    the twin was rejected as infeasible for the free order, and the nearest rung fell to
    another ratio's entry (BENCHMARKS.md, issue 13, session 34)."""
    from flashtune.dispatch import _table
    from flashtune.kernels import config as kconfig
    from flashtune.kernels.config import BWD_HOPPER

    monkeypatch.setattr(kconfig, "hopper_support", lambda: "")  # the rules as on an sm90
    det = Problem(4, 32, 8, 4096, 4096, 128, "bf16", False, deterministic=True)
    twin = BwdConfig(variant=BWD_HOPPER, hopper_stages=3)  # free order: 246,784 B
    fits = BwdConfig(variant=BWD_HOPPER, hopper_stages=2)
    other = dataclasses.replace(det, heads_kv=32)  # another GQA ratio, same buckets
    put(db, det, "bwd", twin)
    put(db, other, "bwd", fits)
    table = _table.load_table(device_info(), str(db))
    free = dataclasses.replace(det, deterministic=False)
    c = table.choose(free, "bwd")
    # Served the twin's tiles, pinned to the fixed order it was timed in (session 35).
    assert c.source == "nearest" and c.config == dataclasses.replace(twin, hopper_dq_fixed=1)
    assert c.entry is not None and c.entry.key == det.key("bwd")
    assert kconfig.hopper_bwd_fixed_order(c.config, 128, False)  # it runs in the fixed order
    # The deterministic call itself is served its own entry, as before.
    assert table.choose(det, "bwd").config == twin


def test_a_deterministic_hopper_entry_serves_a_free_order_call_in_its_fixed_order(
        db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deterministic Hopper entry was timed in the fixed dQ order; served to a
    ``deterministic=False`` call it keeps that order (``hopper_dq_fixed=1``) even where its
    free order would fit: on the H200 the free order of the twin's config ran 2x slower at
    2x32x8192x64 causal (BENCHMARKS.md, issue 13, session 35). A non-deterministic entry is
    served as stored, and a portable entry is served unchanged."""
    from flashtune.dispatch import _table
    from flashtune.kernels import config as kconfig
    from flashtune.kernels.config import BWD_HOPPER

    monkeypatch.setattr(kconfig, "hopper_support", lambda: "")
    det = Problem(2, 32, 32, 8192, 8192, 64, "bf16", True, deterministic=True)
    twin = BwdConfig(variant=BWD_HOPPER, hopper_block_m=128, hopper_stages=2, hopper_regs=216)
    assert not kconfig.hopper_bwd_fixed_order(twin, 64, False)  # its free order fits
    put(db, det, "bwd", twin)
    portable = dataclasses.replace(det, seqlen_q=4096, seqlen_k=4096)
    put(db, portable, "bwd", BWD_A)
    table = _table.load_table(device_info(), str(db))
    free = dataclasses.replace(det, deterministic=False)
    served = table.choose(free, "bwd").config
    assert served == dataclasses.replace(twin, hopper_dq_fixed=1)
    assert kconfig.hopper_bwd_fixed_order(served, 64, False)
    assert table.choose(dataclasses.replace(portable, deterministic=False), "bwd").config == BWD_A
    # Once the free-order key has its own entry (here the free order), that is served.
    put(db, free, "bwd", twin)
    table = _table.load_table(device_info(), str(db))
    assert table.choose(free, "bwd").config == twin
