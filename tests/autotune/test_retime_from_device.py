"""``benchmarks/retime_knob.py --from-device``: each shipped entry of one GPU timed against
the config another GPU's shipped entry holds for the same key. The jobs it builds come from
the shipped layer alone, so they are checked here on the packaged data."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from flashtune.kernels import config
from flashtune.kernels.config import BwdConfig, active_fields, check, config_from_dict
from flashtune.problem import Problem
from tests._scripts import load_script

ROOT = Path(__file__).parents[2]
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _retime_knob():
    return load_script("retime_knob")


def test_each_entry_gets_the_other_gpus_config_for_its_key_as_the_knobs_that_differ(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "hopper_support", lambda: "")  # (judged as on an sm90 GPU)
    device_jobs = _retime_knob().device_jobs
    entries = json.loads((ROOT / "flashtune" / "data" / "shipped.json").read_text())["entries"]
    jobs = device_jobs(entries, H100, H200, "bwd")
    assert jobs
    theirs = {json.dumps(e["problem"], sort_keys=True): e["config"] for e in entries
              if e["device"]["name"] == H200 and e["direction"] == "bwd"}
    switched = 0
    for spec, knobs in jobs:
        e = entries[int(spec)]
        assert (e["device"]["name"], e["direction"]) == (H100, "bwd")
        other = theirs[json.dumps(e["problem"], sort_keys=True)]
        # The candidate retime_knob builds (the entry's config with the knobs) is the
        # other GPU's config wherever the kernel reads it.
        cand = {**e["config"], **knobs}
        variant = other["variant"]
        assert {k: cand[k] for k in active_fields(BwdConfig, variant)} == \
            {k: other[k] for k in active_fields(BwdConfig, variant)}
        assert all(e["config"][k] != v for k, v in knobs.items())
        if variant == e["config"]["variant"]:
            assert set(knobs) <= set(active_fields(BwdConfig, variant))
        else:
            switched += 1
            assert knobs["variant"] == variant
            check(config_from_dict("bwd", cand), Problem.from_dict(e["example"]))
    assert switched, "some H100 keys hold a portable winner where the H200's is Hopper"
    # Only the H100's keys the H200 also holds; --entries narrows them.
    assert {int(s) for s, _ in device_jobs(entries, H100, H200, "bwd", {int(jobs[0][0])})} \
        == {int(jobs[0][0])}

    # A key the other GPU lacks, or holds with the same config, gets no job.
    one = next(e for e in entries if e["device"]["name"] == H100 and e["direction"] == "bwd")
    twin = copy.deepcopy(one)
    twin["device"] = {**twin["device"], "name": H200}
    assert device_jobs([one, twin], H100, H200, "bwd") == []
    assert device_jobs([one], H100, H200, "bwd") == []
    twin["config"] = {**twin["config"], "pre_block_m": 2 * one["config"]["pre_block_m"]}
    assert device_jobs([one, twin], H100, H200, "bwd") == [
        ("0", {"pre_block_m": 2 * one["config"]["pre_block_m"]})]
    assert device_jobs([one, twin], H100, H200, "fwd") == []


def test_budget_winners_become_jobs_against_the_entry_of_their_own_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--from-budget``: a short search's winner that beat the shipped config of its key by
    the margin becomes a job on that entry (the knobs that differ); a smaller gain, another
    direction or a key without an entry make none; a ``nondet`` label finds the
    deterministic=False entry of the same shape, not the deterministic one."""
    monkeypatch.setattr(config, "hopper_support", lambda: "")
    script = _retime_knob()
    label = load_script("tune_autotuner")._label
    entries = json.loads((ROOT / "flashtune" / "data" / "shipped.json").read_text())["entries"]
    mine = {i: e for i, e in enumerate(entries)
            if e["device"]["name"] == H200 and e["direction"] == "bwd"}
    pairs = [(i, j) for i, e in mine.items() for j, f in mine.items()
             if e["example"].get("deterministic", True)
             and not f["example"].get("deterministic", True)
             and {**e["example"], "deterministic": False} == f["example"]]
    assert pairs, "a shape shipped both deterministic and not"
    det, nondet = pairs[0]
    example = mine[nondet]["example"]
    shape = Problem(**{**example, "window": tuple(example["window"])})
    regs = mine[nondet]["config"]["hopper_regs"]
    winner = {**mine[nondet]["config"], "hopper_regs": 224 if regs != 224 else 232}
    rows = [{"direction": "bwd", "problem": label(shape), "gap": -0.03, "short_config": winner},
            {"direction": "bwd", "problem": label(shape), "gap": -0.003,
             "short_config": {**winner, "hopper_regs": 216}},
            {"direction": "fwd", "problem": label(shape), "gap": -0.05, "short_config": winner},
            {"direction": "bwd", "problem": "B3 H5 S77 D64", "gap": -0.5,
             "short_config": winner}]
    assert "nondet" in label(shape)
    jobs = script.budget_jobs(rows, entries, H200, "bwd", -0.008)
    assert jobs == [(str(nondet), {"hopper_regs": winner["hopper_regs"]})]
    assert det != nondet
    # The whole config where the kernel variant differs.
    portable = {**mine[nondet]["config"], "variant": 0}
    whole = script.budget_jobs([{**rows[0], "short_config": portable}], entries, H200, "bwd",
                               -0.008)
    assert whole and whole[0][1]["variant"] == 0
    assert set(whole[0][1]) == {k for k, v in portable.items()
                                if mine[nondet]["config"][k] != v}


def test_budget_shipped_keys_are_every_labelled_key_of_the_gpu() -> None:
    """``tune_autotuner.py budget --shipped-keys``: one problem per key the shipped layer
    holds for the GPU and direction, each named by a label that parses back to the same
    key (``nondet`` included); keys a label cannot name (varlen, a window) are left out."""
    script = load_script("tune_autotuner")
    entries = json.loads((ROOT / "flashtune" / "data" / "shipped.json").read_text())["entries"]
    probs = script.shipped_problems("bwd", H200)
    keys = [p.key("bwd") for p in probs]
    assert len(set(keys)) == len(keys) == len({script._label(p) for p in probs})
    assert all(script.problem_of_label(script._label(p)).key("bwd") == p.key("bwd")
               for p in probs)
    assert any(not p.deterministic for p in probs) and any(p.deterministic for p in probs)
    held = [e for e in entries if e["device"]["name"] == H200 and e["direction"] == "bwd"]
    named = [e for e in held if not e["example"].get("total_q")
             and tuple(e["example"]["window"]) == (-1, -1)]
    assert len(probs) == len(named) < len(held)
