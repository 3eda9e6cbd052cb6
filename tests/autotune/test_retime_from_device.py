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
