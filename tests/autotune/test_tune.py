"""End-to-end tuning under Triton's interpreter, with the real worker subprocesses.

Problems are tiny (B=1, H=2, S<=64, D=32) and budgets a handful of trials: the
interpreter spends 0.3-2 s per launch.
"""

from __future__ import annotations

import time
from typing import Any

import optuna
import pytest
import torch
from optuna.trial import TrialState

from flashtune.autotune import SearchSpace, TuneResult, tune
from flashtune.autotune._faults import ENV, fault_env
from flashtune.db import open_storage
from flashtune.db.fingerprint import device_info, software_info
from flashtune.kernels.attn_bwd import ONE_LAUNCH_PART
from flashtune.kernels.config import (
    BWD_FUSED,
    BWD_ONE_LAUNCH,
    config_from_dict,
    config_to_dict,
    default_config,
)
from flashtune.kernels.reference import compare
from flashtune.problem import Problem

TINY = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=32, seqlen_k=32, head_dim=32,
               dtype="fp16")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(ENV, raising=False)


def test_tune_both_stores_results_that_pass_the_gate(tmp_path, seed: int) -> None:
    db = tmp_path / "tuning.db"
    problem = Problem(batch=1, heads_q=2, heads_kv=1, seqlen_q=40, seqlen_k=48, head_dim=32,
                      dtype="fp16", causal=True)
    events: list[dict] = []
    res = tune(problem, "both", trials=3, storage=db, seed=seed, progress=events.append)
    assert set(res) == {"fwd", "bwd"}
    with open_storage(db) as st:
        for d, r in res.items():
            assert isinstance(r, TuneResult) and r.stored and r.interpreter
            assert r.trials == 3 and r.complete >= 1 and r.device == "cpu-interpreter"
            stored = st.get_result(device_info(), software_info(), problem.key(d))
            assert stored is not None and stored.config == config_to_dict(r.config)
            assert stored.median_ms == pytest.approx(r.median_ms)
            # The stored config passes the gate again, on inputs it has never seen.
            gen = torch.Generator().manual_seed(seed + 17)
            cmp = compare(problem, d, config_from_dict(d, stored.config), device="cpu",
                          generator=gen)
            assert cmp.ok, cmp.detail
    # The study is in the same database, readable by plain Optuna (and optuna-dashboard).
    names = optuna.get_all_study_names(f"sqlite:///{db}")
    assert sorted(n.split("/")[1] for n in names) == ["bwd", "fwd"]
    # Backward trials carry each launch's time (what the recombination step reads).
    study = optuna.load_study(study_name=res["bwd"].study_name, storage=f"sqlite:///{db}")
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    launches = {BWD_ONE_LAUNCH: {"pre", ONE_LAUNCH_PART},
                BWD_FUSED: {ONE_LAUNCH_PART}}  # else pre, dkdv, dq
    assert done and all(set(t.user_attrs["parts_ms"])
                        == launches.get(t.params["variant"], {"pre", "dkdv", "dq"})
                        for t in done)
    assert {e["event"] for e in events} >= {"trial", "done"}


def test_faults_fail_their_trials_and_never_get_stored(tmp_path, monkeypatch) -> None:
    # A 6-point grid, searched exhaustively, with one misbehaving config per fault kind.
    space = SearchSpace.subgrid("fwd", block_m=(16, 32), block_n=(16, 32, 64), num_warps=4,
                                num_stages=3)
    faults = {(16, 16): "corrupt", (16, 32): "exit", (16, 64): "hang", (32, 16): "segv"}
    db = tmp_path / "tuning.db"
    # The per-trial timeout must outlast a good trial on this machine as loaded now (on a
    # busy 2-core CI box one takes several times as long as alone): time one first.
    probe = tune(TINY, "fwd", sampler="grid", storage=tmp_path / "probe.db",
                 space=SearchSpace.subgrid("fwd", block_m=32, block_n=32, num_warps=4,
                                           num_stages=3), warm_start=False, retime_rounds=1)
    good = optuna.load_study(study_name=probe.study_name, storage=f"sqlite:///{tmp_path}/probe.db")
    timeout = max(15.0, 4 * max(t.user_attrs["wall_s"] for t in good.trials))
    monkeypatch.setenv(ENV, fault_env(*(({"block_m": m, "block_n": n}, a)
                                         for (m, n), a in faults.items()))[ENV])
    r = tune(TINY, "fwd", sampler="grid", space=space, storage=db, trial_timeout=timeout,
             warm_start=False, retime_rounds=1)
    assert r.trials == 6 and r.complete == 2 and r.failed == 4
    assert r.worker_restarts == 3
    assert (r.config.block_m, r.config.block_n) in {(32, 32), (32, 64)}
    with open_storage(db) as st:
        stored = st.get_result(device_info(), software_info(), TINY.key("fwd"))
        assert stored is not None
        assert (stored.config["block_m"], stored.config["block_n"]) not in faults
    study = optuna.load_study(study_name=r.study_name, storage=f"sqlite:///{db}")
    by_cfg = {(t.params["block_m"], t.params["block_n"]): t for t in study.trials}
    expect = {"corrupt": "correctness gate failed", "exit": "exited with code 3",
              "segv": "SIGSEGV", "hang": "trial timeout"}
    for cfg, action in faults.items():
        t = by_cfg[cfg]
        assert t.state == TrialState.FAIL, (cfg, t.state)
        assert expect[action] in t.user_attrs["error"], (action, t.user_attrs["error"])
    hang = by_cfg[(16, 64)]  # bounded by the timeout (its worker sleeps for an hour)
    assert timeout <= hang.user_attrs["wall_s"] < timeout + 30


def test_infeasible_candidates_are_pruned_with_a_reason(tmp_path) -> None:
    # Half of this space is infeasible (16 warps for a 16-row tile).
    space = SearchSpace.subgrid("fwd", block_m=16, block_n=(16, 32), num_warps=(16, 4),
                                num_stages=3)
    db = tmp_path / "tuning.db"
    r = tune(TINY, "fwd", sampler="grid", space=space, storage=db, warm_start=False,
             retime_rounds=0, trials=2)
    assert r.trials == 2 and r.infeasible == 2
    study = optuna.load_study(study_name=r.study_name, storage=f"sqlite:///{db}")
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert len(pruned) == 2
    assert all("16 warps" in t.user_attrs["pruned_reason"] for t in pruned)


STALE_WINNER = {"block_m": 16, "block_n": 32, "num_warps": 2, "num_stages": 1}


def _tune_after_upgrade(tmp_path) -> tuple[TuneResult, list[Any]]:
    """A 0.5 s tune of TINY whose database holds :data:`STALE_WINNER`, tuned under an
    older Triton; the result and its measured trials."""
    from flashtune.db.fingerprint import SoftwareInfo

    db = tmp_path / "tuning.db"
    now = software_info()
    before = SoftwareInfo(torch=now.torch, triton="3.8.0", cuda=now.cuda,  # an older Triton
                          kernels_hash=now.kernels_hash, ptxas=now.ptxas)
    with open_storage(db) as st:
        st.put_result(device_info(), before, TINY.key("fwd"), STALE_WINNER, problem=TINY,
                      tflops=1.0, median_ms=2.0, p20_ms=2.0, p80_ms=2.0, max_error=0.0,
                      trials=9, search_seconds=1.0)
    r = tune(TINY, "fwd", time_budget=0.5, storage=db, retime_rounds=0)
    study = optuna.load_study(study_name=r.study_name, storage=f"sqlite:///{db}")
    return r, [t for t in study.trials if t.user_attrs.get("measured")]


def test_a_stale_winner_seeds_at_least_three_trials_under_a_short_budget(tmp_path) -> None:
    """After an upgrade the stale winner seeds the search; a time budget shorter than one
    trial then still measures three candidates (the stale winner first), where the same
    budget without a stale winner measures one (the next test)."""
    from flashtune.autotune.tuner import STALE_MIN_TRIALS

    r, measured = _tune_after_upgrade(tmp_path)
    assert STALE_MIN_TRIALS == 3
    assert r.trials == STALE_MIN_TRIALS and r.stop_reason == "time budget"
    assert len(measured) == STALE_MIN_TRIALS
    assert measured[0].user_attrs["seed_source"] == "stale"
    assert {k: measured[0].params[k] for k in STALE_WINNER} == STALE_WINNER


def test_the_minimum_counts_timed_trials_not_failed_ones(tmp_path, monkeypatch) -> None:
    """A stale winner that fails on the new software does not count towards the three:
    the search times three others after it."""
    from flashtune.autotune.tuner import STALE_MIN_TRIALS

    monkeypatch.setenv(ENV, fault_env((STALE_WINNER, "raise"))[ENV])
    r, measured = _tune_after_upgrade(tmp_path)
    assert measured[0].user_attrs["seed_source"] == "stale"
    assert measured[0].state == TrialState.FAIL
    assert "injected launcher failure" in measured[0].user_attrs["error"]
    assert [t.state for t in measured[1:]] == [TrialState.COMPLETE] * STALE_MIN_TRIALS
    assert r.trials == STALE_MIN_TRIALS + 1 and r.complete == STALE_MIN_TRIALS
    assert r.stop_reason == "time budget"


def test_the_minimum_gives_up_when_every_candidate_fails(tmp_path, monkeypatch) -> None:
    """Where nothing can be timed, the minimum stops waiting for timings after
    MIN_TRIALS_TRIES times its count of candidates: the budget ends the search, which
    then says that no candidate passed."""
    from flashtune.autotune.search import MIN_TRIALS_TRIES
    from flashtune.autotune.tuner import STALE_MIN_TRIALS
    from flashtune.exceptions import TuningError

    monkeypatch.setenv(ENV, fault_env(({}, "raise"))[ENV])  # every config
    n = MIN_TRIALS_TRIES * STALE_MIN_TRIALS
    with pytest.raises(TuningError, match=f"{n} measured \\({n} failed"):
        _tune_after_upgrade(tmp_path)
    url = f"sqlite:///{tmp_path / 'tuning.db'}"
    (name,) = optuna.get_all_study_names(url)
    trials = optuna.load_study(study_name=name, storage=url).trials
    assert [t.state for t in trials if t.user_attrs.get("measured")] == [TrialState.FAIL] * n


def test_time_budget_and_resume_counts_stored_trials(tmp_path) -> None:
    db = tmp_path / "tuning.db"
    t0 = time.perf_counter()
    # Half a second is less than one trial takes (and, on a loaded machine, less than the
    # setup): exactly one trial is measured, then the budget stops the search.
    r1 = tune(TINY, "fwd", time_budget=0.5, storage=db, retime_rounds=0)
    assert r1.trials == 1 and r1.stop_reason == "time budget"
    assert time.perf_counter() - t0 < 300  # not the 50 trials of no budget
    r2 = tune(TINY, "fwd", trials=3, storage=db, retime_rounds=0)
    assert r2.study_name == r1.study_name and r2.trials == 3
    # After the first 40% of the budget the search polishes: each polish trial is an
    # untried neighbour (one or two fields one step away) of the best trial before it.
    study = optuna.load_study(study_name=r2.study_name, storage=f"sqlite:///{db}")
    space = SearchSpace.full("fwd")
    measured = [t for t in study.trials if t.user_attrs.get("measured")]
    polish = [t for t in measured if t.user_attrs.get("seed_source") == "polish"]
    assert len(polish) == 1 and polish[0].number == measured[-1].number  # trial 3 of 3
    for t in polish:
        before = [e for e in measured if e.number < t.number]
        # A trial holds only its variant's knobs: compare whole configs.
        full = space.complete
        incumbent = full(min(before, key=lambda e: e.value).params)
        near = space.neighbours(incumbent, 1) + space.neighbours(incumbent, 2)
        assert full(t.params) in near and all(full(e.params) != full(t.params) for e in before)


def test_warm_start_enqueues_default_and_database_seeds(tmp_path) -> None:
    from dataclasses import replace

    from flashtune.db.fingerprint import DeviceInfo

    db = tmp_path / "tuning.db"
    here, sw = device_info(), software_info()
    other = DeviceInfo(name="Other GPU", capability="9.0", sm_count=132, memory_gb=80)
    near = replace(TINY, seqlen_q=64, seqlen_k=64)  # same family, next bucket
    timing = dict(median_ms=1.0, p20_ms=0.9, p80_ms=1.1, tflops=1.0, max_error=0.0,
                  trials=1, search_seconds=1.0)
    with open_storage(db) as st:
        st.put_result(other, sw, TINY.key("fwd"), {"block_m": 16, "block_n": 16}, **timing)
        st.put_result(here, sw, near.key("fwd"), {"block_m": 32, "block_n": 16}, **timing)
    r = tune(TINY, "fwd", trials=3, storage=db, retime_rounds=0)
    study = optuna.load_study(study_name=r.study_name, storage=f"sqlite:///{db}")
    # The seeds run first, in order, before any pick of the sampler or polishing point.
    measured = [t for t in study.trials if t.user_attrs.get("measured")]
    sources = [t.user_attrs.get("seed_source") for t in measured]
    assert sources == ["default", "device:Other GPU", "nearest"]
    assert measured[1].params["block_m"] == 16 and measured[2].params["block_m"] == 32


def _tune_on_shipped(tmp_path, monkeypatch: pytest.MonkeyPatch, put: Any) -> list[Any]:
    """The measured trials of a 3-trial tune of TINY on a fresh database, with the shipped
    layer made of what ``put(storage)`` stores."""
    from dataclasses import replace

    import flashtune.db.exchange as exchange

    with open_storage(tmp_path / "made.db") as st:  # results as the shipped layer holds them
        put(st)
        layer = [replace(r, origin="shipped") for r in st.results(software=software_info())]
    monkeypatch.setattr(exchange, "shipped_results", lambda software=None: layer)
    # A fresh database: the seeds can only come from the shipped layer.
    r = tune(TINY, "fwd", trials=3, storage=tmp_path / "fresh.db", retime_rounds=0)
    study = optuna.load_study(study_name=r.study_name,
                              storage=f"sqlite:///{tmp_path / 'fresh.db'}")
    return [t for t in study.trials if t.user_attrs.get("measured")]


def test_shipped_layer_seeds_the_search(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    here, sw = device_info(), software_info()
    near = replace(TINY, seqlen_q=64, seqlen_k=64)  # same family, next bucket
    timing = dict(median_ms=1.0, p20_ms=0.9, p80_ms=1.1, tflops=1.0, max_error=0.0,
                  trials=1, search_seconds=1.0)

    def put(st: Any) -> None:
        st.put_result(here, sw, TINY.key("fwd"), {"block_m": 32, "block_n": 32}, **timing)
        st.put_result(here, sw, near.key("fwd"), {"block_m": 16, "block_n": 32}, **timing)

    measured = _tune_on_shipped(tmp_path, monkeypatch, put)
    assert [t.user_attrs.get("seed_source") for t in measured] == \
        ["shipped", "default", "nearest"]
    assert (measured[0].params["block_m"], measured[2].params["block_m"]) == (32, 16)
    # Turned off (the autotuner's own benchmarks), the search starts from the default.
    r = tune(TINY, "fwd", trials=1, storage=tmp_path / "off.db", retime_rounds=0,
             shipped_seeds=False)
    study = optuna.load_study(study_name=r.study_name,
                              storage=f"sqlite:///{tmp_path / 'off.db'}")
    assert [t.user_attrs.get("seed_source") for t in study.trials] == ["default"]


def test_shipped_winners_of_other_devices_seed_the_search(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped layer's winners for the key on other devices seed the search after the
    default, fastest first, as the database's do: a device whose own entry came from a
    short search starts from what another GPU found."""
    from flashtune.db.fingerprint import DeviceInfo

    here, sw = device_info(), software_info()
    fast = DeviceInfo(name="Fast GPU", capability="9.0", sm_count=132, memory_gb=141)
    slow = DeviceInfo(name="Slow GPU", capability="9.0", sm_count=132, memory_gb=80)
    timing = dict(tflops=1.0, max_error=0.0, trials=1, search_seconds=1.0)

    def put(st: Any) -> None:
        st.put_result(slow, sw, TINY.key("fwd"), {"block_m": 32, "block_n": 32},
                      median_ms=2.0, p20_ms=1.9, p80_ms=2.1, **timing)
        st.put_result(fast, sw, TINY.key("fwd"), {"block_m": 16, "block_n": 32},
                      median_ms=1.0, p20_ms=0.9, p80_ms=1.1, **timing)

    measured = _tune_on_shipped(tmp_path, monkeypatch, put)
    assert [t.user_attrs.get("seed_source") for t in measured] == \
        ["default", "device:Fast GPU", "device:Slow GPU"]
    assert [t.params["block_m"] for t in measured[1:]] == [16, 32]
    assert here.fingerprint not in (fast.fingerprint, slow.fingerprint)


def test_backward_polish_moves_each_launch_and_recombines(tmp_path) -> None:
    db = tmp_path / "tuning.db"
    space = SearchSpace.subgrid("bwd", dkdv_block_m=(16, 32), dkdv_block_n=(16, 32),
                                dkdv_warps=(2, 4, 8), dq_block_m=(16, 32),
                                dq_block_n=(16, 32), dq_warps=(2, 4, 8))
    r = tune(TINY, "bwd", trials=8, storage=db, space=space, retime_rounds=0, seed=3)
    study = optuna.load_study(study_name=r.study_name, storage=f"sqlite:///{db}")
    measured = [t for t in study.trials if t.user_attrs.get("measured")]
    assert len(measured) == 8 == r.trials
    # After 40% of the budget the search polishes (unless a recombination is predicted
    # faster), so the last two trials are of those kinds. Each polish trial is new, and at
    # least one launch of it is in a setting no earlier trial ran (the point of timing
    # launches separately).
    sources = [t.user_attrs.get("seed_source") for t in measured]
    assert set(sources[-2:]) <= {"polish", "compose"}
    polish = [t for t in measured if t.user_attrs.get("seed_source") == "polish"]
    full = space.complete  # a trial's params hold only the knobs its variant uses
    for t in polish:
        earlier = [e for e in measured if e.number < t.number]
        assert all(e.params != t.params for e in earlier)
        assert any(all(space.part_setting(part, full(e.params))
                       != space.part_setting(part, full(t.params))
                       for e in earlier) for part in space.parts)
    # A trial that beat the incumbent was timed twice more and kept the median of three.
    confirmed = [t for t in measured if "confirm_ms" in t.user_attrs]
    assert confirmed or min(measured, key=lambda t: t.value).number == measured[0].number
    for t in confirmed:
        three = sorted([t.user_attrs["first_ms"], *t.user_attrs["confirm_ms"]])
        assert t.value == pytest.approx(three[1])
    # A recombined candidate, when one was made, is the best parts of earlier trials.
    for t in measured:
        if t.user_attrs.get("seed_source") == "compose":
            earlier = [(full(e.params), e.user_attrs["parts_ms"]) for e in measured
                       if e.number < t.number and "parts_ms" in e.user_attrs]
            assert full(t.params) in [c for _, c in space.compose(earlier)]


def test_a_real_tune_replaces_imported_claims_whatever_they_claimed(tmp_path) -> None:
    import dataclasses
    import json
    import random

    from flashtune.db.exchange import FORMAT, FORMAT_VERSION, import_json
    from flashtune.db.validation import to_entry
    from tests.db import _data

    db = tmp_path / "tuning.db"
    here, sw = device_info(), software_info()
    fast_p = dataclasses.replace(TINY, seqlen_q=64, seqlen_k=64)
    # An import at the plausibility floor (1 us): faster than any interpreter run.
    floor = _data.result(random.Random(1), device=here, software=sw, direction="fwd", p=fast_p,
                         median_ms=1e-3, p20_ms=1e-3, p80_ms=1e-3,
                         tflops=fast_p.flops("fwd") / 1e6, max_error=0.0)
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "entries": [to_entry(floor)]}
    # ... and a 0 ms row of unknown origin, as a database of flashtune <= 0.1 may hold
    # (imported before imports were checked for plausibility).
    zero = dataclasses.replace(
        _data.result(random.Random(2), device=here, software=sw, direction="fwd", p=TINY),
        median_ms=0.0, p20_ms=0.0, p80_ms=0.0, tflops=0.0, origin="unknown")
    with open_storage(db) as st:
        assert import_json(st, json.dumps(doc).encode()).added == 1
        assert st.put_results([zero]) == ["added"]
    for p, claimed in ((TINY, 0.0), (fast_p, 1e-3)):
        r = tune(p, "fwd", trials=1, storage=db, retime_rounds=0, warm_start=False)
        assert r.stored and r.median_ms > claimed  # slower than the claim, and stored
        with open_storage(db) as st:
            got = st.get_result(here, sw, p.key("fwd"))
            assert got is not None and got.origin == "local"
            assert got.median_ms == pytest.approx(r.median_ms)
            assert st.counts()["entries"] == 2  # replaced, not added beside
    # Once measured here, the result stands: the faster claim imported again is kept out
    # (only --prefer theirs forces it in).
    with open_storage(db) as st:
        assert import_json(st, json.dumps(doc).encode()).kept == 1
        assert import_json(st, json.dumps(doc).encode(), prefer="theirs").replaced == 1


def test_the_worker_makes_the_gate_case_before_the_first_candidate(tmp_path) -> None:
    """The real worker prepares the problem (inputs, fp32 reference; for the backward its
    forward) on request, so the first candidate's gate finds the reference made."""
    events: list[dict] = []
    r = tune(TINY, "bwd", trials=1, storage=tmp_path / "t.db", retime_rounds=0,
             progress=events.append)
    (prep,) = [e for e in events if e.get("event") == "prepare"]
    assert prep["status"] == "ok", prep  # it did not fail
    # Its parts: the forward that gives O and the log-sum-exp, then the gate case.
    assert prep["seconds"]["forward_s"] > 0 and prep["seconds"]["case_s"] > 0
    assert prep["seconds"]["wall_s"] >= prep["seconds"]["forward_s"] + prep["seconds"]["case_s"]
    study = optuna.load_study(study_name=r.study_name, storage=f"sqlite:///{tmp_path / 't.db'}")
    assert study.user_attrs["prepare_s"] > 0
    (first,) = [t for t in study.trials if t.user_attrs.get("measured")]
    assert first.state == TrialState.COMPLETE and first.user_attrs["reference_s"] == 0.0


def test_a_free_order_search_seeds_its_deterministic_twin_in_its_fixed_order(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``deterministic=False`` backward search seeded from its deterministic twin's Hopper
    entry tries that config first as the dispatcher serves it (``hopper_dq_fixed=1``, the
    order it was timed in), then in the free order."""
    from dataclasses import replace

    from flashtune.autotune.tuner import _seed_configs
    from flashtune.kernels import config as kconfig
    from flashtune.kernels.config import BWD_HOPPER, BwdConfig, config_to_dict
    from flashtune.problem import Problem

    monkeypatch.setattr(kconfig, "hopper_support", lambda: "")
    det = Problem(2, 32, 32, 8192, 8192, 64, "bf16", True, deterministic=True)
    twin = BwdConfig(variant=BWD_HOPPER, hopper_block_m=128, hopper_regs=216)
    timing = dict(median_ms=1.0, p20_ms=0.9, p80_ms=1.1, tflops=1.0, max_error=0.0,
                  trials=1, search_seconds=1.0)
    with open_storage(tmp_path / "t.db") as st:
        st.put_result(device_info(), software_info(), det.key("bwd"), config_to_dict(twin),
                      **timing)
        free = replace(det, deterministic=False)
        seeds = _seed_configs(st, device_info(), software_info(), free, "bwd",
                              SearchSpace.full("bwd"), shipped=False)
        nearest = [SearchSpace.full("bwd").config(p) for p, src in seeds if src == "nearest"]
        assert nearest[:2] == [replace(twin, hopper_dq_fixed=1), twin]
        # A deterministic search of the same key has no such seed.
        seeds = _seed_configs(st, device_info(), software_info(), det, "bwd",
                              SearchSpace.full("bwd"), shipped=False)
        assert all(SearchSpace.full("bwd").config(p).hopper_dq_fixed == 0 for p, _ in seeds)
    # A twin that stages in column groups (the fixed order only): pinned it keeps them, in
    # the free order it seeds the rows' staging, which that order's rules allow.
    grouped = replace(twin, hopper_dq_groups=1)
    with open_storage(tmp_path / "g.db") as st:
        st.put_result(device_info(), software_info(), det.key("bwd"), config_to_dict(grouped),
                      **timing)
        seeds = _seed_configs(st, device_info(), software_info(), free, "bwd",
                              SearchSpace.full("bwd"), shipped=False)
        nearest = [SearchSpace.full("bwd").config(p) for p, src in seeds if src == "nearest"]
        assert nearest[:2] == [replace(grouped, hopper_dq_fixed=1), twin]
        kconfig.check_bwd(nearest[0], free)
        kconfig.check_bwd(nearest[1], free)


def test_the_anchored_timing_gives_the_stored_figure(tmp_path) -> None:
    """With ``anchored`` (on by default on a GPU only) the winner is timed once more in one
    loop with the default, and that loop's figure is the result's and the database's (on
    the CPU the SDPA anchors do not join it). Without it, the re-timing's figure stands."""
    db = tmp_path / "t.db"
    r = tune(TINY, "fwd", trials=3, storage=db, anchored=True, seed=1)
    assert r.anchored is not None and r.anchored["errors"] == {}
    ms = r.anchored["ms"]
    assert ms["winner"] == r.median_ms and set(ms) <= {"winner", "default"}
    default = config_to_dict(default_config("fwd", TINY))
    if config_to_dict(r.config) != default:
        assert ms["default"] == r.default_ms
    with open_storage(db) as st:
        stored = st.get_result(device_info(), software_info(), TINY.key("fwd"))
        assert stored is not None and stored.median_ms == pytest.approx(r.median_ms)
    study = optuna.load_study(study_name=r.study_name, storage=f"sqlite:///{db}")
    assert study.user_attrs["anchored"] == r.anchored
    plain = tune(TINY, "bwd", trials=2, storage=db)  # the interpreter's default: none
    assert plain.anchored is None


def test_trials_after_the_first_are_timed_beside_the_incumbent(tmp_path) -> None:
    """With an adaptive timing (``rel_tol``), each trial after the first runs in pairs with
    the incumbent in the real worker, and its score is its ratio to the incumbent times
    the incumbent's score (a new incumbent's: the median of three such ratios)."""
    import statistics

    db = tmp_path / "t.db"
    r = tune(TINY, "fwd", trials=4, storage=db, retime_rounds=0, seed=2,
             timing={"rel_tol": 0.5, "cpu_reps": 2})
    study = optuna.load_study(study_name=r.study_name, storage=f"sqlite:///{db}")
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) >= 3
    assert "against_ratio" not in done[0].user_attrs  # nothing to time it beside
    best = float(done[0].value)
    for t in done[1:]:
        ratio = t.user_attrs["against_ratio"]
        assert ratio > 0 and t.user_attrs["alone_ms"] > 0
        ratios = [ratio, *t.user_attrs.get("confirm_ratios", [])]
        assert float(t.value) == pytest.approx(statistics.median(ratios) * best, rel=1e-9)
        best = min(best, float(t.value))
