"""`autotune info`: device, versions, database location, counts and layers."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from flashtune.cli import main
from flashtune.db import open_storage
from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo, software_info
from flashtune.problem import Problem

H200 = DeviceInfo(name="NVIDIA H200", capability="9.0", sm_count=132, memory_gb=140)
A100 = DeviceInfo(name="NVIDIA A100-SXM4-80GB", capability="8.0", sm_count=108, memory_gb=80)
OLD = SoftwareInfo(torch="2.0", triton="2.1", cuda="12.1", kernels_hash="old")
P = Problem(batch=2, heads_q=8, heads_kv=8, seqlen_q=1024, seqlen_k=1024, head_dim=64)


def _put(st, dev: DeviceInfo, sw: SoftwareInfo, direction: str) -> None:
    cfg = {"block_m": 64, "block_n": 64} if direction == "fwd" else {}
    st.put_result(dev, sw, P.key(direction), cfg, median_ms=1.0, p20_ms=0.9, p80_ms=1.1,
                  tflops=100.0, max_error=1e-3, trials=3, search_seconds=1.0, problem=P)


def _info(*args: str) -> dict:
    res = CliRunner().invoke(main, ["info", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_info_on_a_database_not_created_yet(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    d = _info("--db", str(db))
    assert d["database"] == {"url": f"sqlite:///{db}", "path": str(db), "exists": False}
    assert not db.exists()  # info never creates it
    assert [layer["name"] for layer in d["layers"]] == ["user", "shipped"]
    assert d["layers"][0]["entries_by_device"] == {} and d["entries"] == 0
    assert d["layers"][1]["source"].endswith("shipped.json")
    assert set(d["versions"]) >= {"torch", "triton", "optuna", "sqlalchemy", "flashtune"}
    assert len(d["device"]["fingerprint"]) == 16 and d["software"] == {
        **software_info().as_dict(), "fingerprint": software_info().fingerprint}


def test_info_counts_entries_by_device_and_stale(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    with open_storage(db) as st:
        _put(st, H200, software_info(), "fwd")
        _put(st, H200, software_info(), "bwd")
        _put(st, A100, OLD, "fwd")  # other software: stale
        st.record_misses(H200, software_info(), {P.key("fwd"): (5, P)})
    d = _info("--db", db)
    user = d["layers"][0]
    assert user["entries_by_device"] == {"NVIDIA H200": 2, "NVIDIA A100-SXM4-80GB": 1}
    assert (d["entries"], d["stale"], d["misses"]) == (3, 1, 5)
    assert (user["entries"], user["stale"]) == (3, 1)

    human = CliRunner().invoke(main, ["info", "--db", db])
    assert human.exit_code == 0, human.output
    assert "entries    3 (1 stale), 5 recorded misses" in human.stdout
    assert "NVIDIA H200: 2" in human.stdout and "layer      shipped" in human.stdout


def test_info_on_a_garbage_file_is_a_clean_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not a database" * 100)
    res = CliRunner().invoke(main, ["info", "--db", str(bad)])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert str(bad) in res.stderr and len(res.stderr.strip().splitlines()) == 1
