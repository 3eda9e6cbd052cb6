"""`autotune verify` under Triton's interpreter, with the real measurement worker: entries
tuned elsewhere are re-gated here, and one that fails is never served."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from flashtune.autotune._faults import ENV, fault_env
from flashtune.autotune.verify import representative, verify
from flashtune.db import open_storage
from flashtune.db.exchange import FORMAT, FORMAT_VERSION, import_json
from flashtune.db.fingerprint import device_info, software_info
from flashtune.db.validation import to_entry
from flashtune.kernels.config import FwdConfig, config_to_dict, default_config
from flashtune.problem import Problem
from tests.db import _data

FWD = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=32, seqlen_k=32, head_dim=32,
              dtype="fp16")
BWD = Problem(batch=1, heads_q=2, heads_kv=1, seqlen_q=24, seqlen_k=40, head_dim=32,
              dtype="fp16", causal=True)
# use_tma needs a power-of-two head dim: infeasible for its own problem, whatever it claims.
ODD = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=32, seqlen_k=32, head_dim=40,
              dtype="fp16")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(ENV, raising=False)


def _entry(p: Problem, direction: str, config: dict[str, Any], host: str) -> dict[str, Any]:
    median = 5.0
    r = _data.result(__import__("random").Random(0), device=device_info(),
                     software=software_info(), direction=direction, p=p, config=config,
                     median_ms=median, p20_ms=median, p80_ms=median,
                     tflops=p.flops(direction) / (median * 1e9), max_error=0.001, host=host)
    return to_entry(r)


def _import(db: Any, *entries: dict[str, Any]) -> None:
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "entries": list(entries)}
    with open_storage(db) as st:
        assert import_json(st, json.dumps(doc).encode()).added == len(entries)


def test_verify_passes_good_entries_and_fails_wrong_ones_for_good(tmp_path, monkeypatch) -> None:
    from flashtune.dispatch import _table

    db = tmp_path / "tuning.db"
    good = config_to_dict(default_config("fwd", FWD))
    wrong = config_to_dict(default_config("bwd", BWD))
    infeasible = config_to_dict(FwdConfig(use_tma=1))
    _import(db, _entry(FWD, "fwd", good, "gpu-node-7"), _entry(BWD, "bwd", wrong, "gpu-node-7"),
            _entry(ODD, "fwd", infeasible, "gpu-node-8"))
    monkeypatch.setenv("FLASHTUNE_DB", str(db))
    before = _table.load_table(device_info())
    assert before.choose(BWD, "bwd").source == "tuned"  # the import is served, unverified

    # The worker's backward launcher perturbs its outputs (the project's fault hook): the
    # kernel for that entry now gives wrong numbers there, and only there.
    with open_storage(db) as st:
        out = verify(st, shipped=False, seed=1, env=fault_env(({"direction": "bwd"},
                                                               "corrupt")))
    by_key = {o.key: o for o in out}
    assert len(out) == 3 and {o.layer for o in out} == {"user"}
    ok, bad, odd = by_key[FWD.key("fwd")], by_key[BWD.key("bwd")], by_key[ODD.key("fwd")]
    assert ok.outcome == "passed" and ok.median_ms is not None and ok.median_ms > 0
    assert bad.outcome == "failed" and "correctness gate failed" in bad.detail
    assert odd.outcome == "failed" and "infeasible" in odd.detail and "use_tma" in odd.detail

    with open_storage(db) as st:
        dev, sw = device_info(), software_info()
        served = st.load_table(dev, sw)
        assert set(served) == {FWD.key("fwd")}
        passed = served[FWD.key("fwd")]
        assert (passed.verify, passed.origin) == ("passed", "imported")
        assert passed.verified_at is not None and passed.median_ms == ok.median_ms
        assert set(st.failed(dev, sw)) == {BWD.key("bwd"), ODD.key("fwd")}
        # Nothing left to do: the passed entry is done, the failed ones are not served.
        assert verify(st, shipped=False) == []
    # A fresh table (a new process's) never serves the failed entry, though its config is
    # feasible and, in this process, correct.
    after = _table.load_table(device_info())
    choice = after.choose(BWD, "bwd")
    assert choice.source == "default" and choice.entry is None
    assert after.choose(FWD, "fwd").source == "tuned"


def test_representative_problems_fall_in_their_keys() -> None:
    for p in (FWD, BWD, ODD, Problem(3, 8, 2, 1000, 3000, 64, causal=True, window=(100, 0),
                                     softcap=20.0, deterministic=False),
              Problem(5, 4, 4, 700, 700, 128, total_q=2000, total_k=2000)):
        for d in ("fwd", "bwd"):
            assert representative(p.key(d)).key(d) == p.key(d)


def test_verify_cli_prints_a_table_and_json_and_exits_1_on_a_failure(tmp_path) -> None:
    from flashtune.cli import main

    db = tmp_path / "tuning.db"
    _import(db, _entry(ODD, "fwd", config_to_dict(FwdConfig(use_tma=1)), "gpu-node-8"))
    run = CliRunner().invoke(main, ["verify", "--interpret", "--db", str(db), "--json",
                                    "--no-shipped"])
    assert run.exit_code == 1, run.output
    doc = json.loads(run.output)
    assert (doc["verified"], doc["failed"], doc["interpreter"]) == (1, 1, True)
    assert doc["entries"][0]["outcome"] == "failed" and doc["entries"][0]["host"] == "gpu-node-8"
    again = CliRunner().invoke(main, ["verify", "--interpret", "--db", str(db), "--no-shipped"])
    assert again.exit_code == 0 and "nothing to verify" in again.output
    # The table: one row per entry, with its outcome and why.
    table = CliRunner().invoke(main, ["verify", "--interpret", "--db", str(db), "--no-shipped",
                                      "--again"])
    assert table.exit_code == 0 and "nothing to verify" in table.output  # failed: not served
    _import(tmp_path / "two.db", _entry(FWD, "fwd", config_to_dict(default_config("fwd", FWD)),
                                        "gpu-node-9"))
    shown = CliRunner().invoke(main, ["verify", "--interpret", "--db", str(tmp_path / "two.db"),
                                      "--no-shipped"])
    assert shown.exit_code == 0, shown.output
    assert "passed" in shown.output and "gpu-node-9" in shown.output
    assert "ms (interpreter)" in shown.output


def test_shipped_entries_are_verified_into_the_database(tmp_path, monkeypatch) -> None:
    from dataclasses import replace

    from flashtune.db import exchange
    from flashtune.dispatch import _table

    team = tmp_path / "team.db"  # the package's layer, as `autotune export` writes it
    _import(team, _entry(FWD, "fwd", config_to_dict(default_config("fwd", FWD)), "ci-h200"),
            _entry(BWD, "bwd", config_to_dict(default_config("bwd", BWD)), "ci-h200"))
    with open_storage(team) as st:
        shipped = tuple(replace(r, origin="shipped")
                        for r in exchange.validate_export(exchange.export_json(st)))
    monkeypatch.setattr(exchange, "_shipped", lambda: shipped)
    db = tmp_path / "tuning.db"
    monkeypatch.setenv("FLASHTUNE_DB", str(db))
    with open_storage(db) as st:
        out = verify(st, seed=2, env=fault_env(({"direction": "bwd"}, "corrupt")))
        assert {(o.key.direction, o.layer, o.outcome) for o in out} == {
            ("fwd", "shipped", "passed"), ("bwd", "shipped", "failed")}
        dev, sw = device_info(), software_info()
        assert st.load_table(dev, sw)[FWD.key("fwd")].origin == "shipped"
        assert st.failed(dev, sw)[BWD.key("bwd")].origin == "shipped"
        assert verify(st) == []  # both settled
    table = _table.load_table(device_info())
    assert table.choose(FWD, "fwd").source == "tuned"
    assert table.choose(BWD, "bwd").source == "default"  # the shipped entry is dropped here
