"""The shipped layer as packaged (`flashtune/data/shipped.json`): whole, one software per
device and direction, and covering every problem of the shipped presets in both directions on every
device it holds, so a fresh install on those GPUs is served "tuned" for all of them."""

from __future__ import annotations

from collections import defaultdict

from flashtune.autotune.presets import preset
from flashtune.db.exchange import _shipped
from flashtune.db.fingerprint import kernels_hash

SHIPPED_PRESETS = ("standard", "llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b", "gpt2",
                   "llama3-8b-packed")


def test_shipped_layer_covers_every_preset_problem_on_every_device() -> None:
    layer = _shipped()
    assert layer, "the package ships no tuning data"
    # One tree shipped: every device's entries from the same kernel sources, each direction
    # under one hash (a forward result may carry the forward's own, docs/database.md).
    # And that hash is this tree's: an edit to a hashed kernel file without a re-sweep
    # (or a relabelling on proof of unchanged code) would leave a fresh install untuned.
    for direction in ("fwd", "bwd"):
        hashes = {r.software.kernels_hash for r in layer if r.key.direction == direction}
        assert len(hashes) == 1, (direction, sorted(h[:12] for h in hashes))
        assert hashes == {kernels_hash(direction=direction)}, (
            f"the shipped {direction} entries are stale on this tree: tuned on kernels hash "
            f"{next(iter(hashes))[:12]}, this tree's is {kernels_hash(direction=direction)[:12]}")
    by_device: dict[str, list] = defaultdict(list)
    for r in layer:
        by_device[r.device.fingerprint].append(r)
    wanted = {p.key(d) for name in SHIPPED_PRESETS for p in preset(name) for d in ("fwd", "bwd")}
    for results in by_device.values():
        name = results[0].device.name
        # One sweep's software per device and direction: a merge must not mix kernels or
        # compilers.
        for direction in ("fwd", "bwd"):
            prints = {r.software.fingerprint for r in results if r.key.direction == direction}
            assert len(prints) == 1, (name, direction)
        assert len({(r.software.triton, r.software.ptxas) for r in results}) == 1, name
        keys = [r.key for r in results]
        assert len(keys) == len(set(keys)), f"{name}: a key shipped twice"
        missing = wanted - set(keys)
        assert not missing, f"{name}: no entry for {sorted(k.short() for k in missing)[:3]}"
        for r in results:  # what the gate measured: a finite time and a passing error
            assert r.origin == "shipped" and r.median_ms > 0 and r.trials >= 1
            assert r.problem is not None and r.problem.key(r.key.direction) == r.key
