"""The same pipeline on a CUDA GPU, with the compile pool (skipped without one)."""

from __future__ import annotations

import pytest

from flashtune.autotune import tune
from flashtune.problem import Problem
from flashtune.timing import SDPA_ANCHORS

pytestmark = pytest.mark.gpu


def test_tune_on_gpu_with_compile_pool(tmp_path) -> None:
    p = Problem(batch=2, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_k=300, head_dim=64,
                dtype="bf16", causal=True)
    res = tune(p, "both", trials=6, storage=tmp_path / "t.db", compile_workers=2,
               interpret=False)
    for r in res.values():
        assert r.stored and not r.interpreter and r.complete >= 1
        assert r.median_ms > 0 and r.tflops > 0
        assert r.pool_compile_seconds > 0
        # The stored figure was taken beside the default and the SDPA anchors (each either
        # timed or refused with its reason), at a recorded clock.
        a = r.anchored
        assert a is not None and a["ms"]["winner"] == r.median_ms, a
        ran = set(a["ms"]) - {"winner", "default"}
        assert ran and ran | set(a["errors"]) == set(SDPA_ANCHORS), a
        assert all(v > 0 for v in a["ms"].values()) and a["clocks"]["samples"] > 0
        # The final re-timing says what SM clock it ran at (NVML comes with the driver),
        # as the bench's rows do, and the study keeps it.
        if len(r.retimed) > 1:
            clocks = r.retime_clocks
            assert clocks is not None and clocks["samples"] > 0, clocks
            assert 100 < clocks["sm_mhz"]["min"] <= clocks["sm_mhz"]["median"] \
                <= clocks["sm_mhz"]["max"] < 5000
            import optuna

            study = optuna.load_study(study_name=r.study_name,
                                      storage=f"sqlite:///{tmp_path / 't.db'}")
            assert study.user_attrs["retime_clocks"] == clocks
        # The trials after the first ran beside the incumbent (flashtune.timing.
        # time_against): each holds its ratio to it, and its time alone.
        import optuna

        study = optuna.load_study(study_name=r.study_name,
                                  storage=f"sqlite:///{tmp_path / 't.db'}")
        timed = [t for t in study.trials if t.value is not None]
        assert "against_ratio" not in timed[0].user_attrs
        for t in timed[1:]:
            assert 0.2 < t.user_attrs["against_ratio"] < 20 and t.user_attrs["alone_ms"] > 0
