"""``benchmarks/step_table.py``: the training-step ratio issue 13's target is read from, on
a bench file built here (forward and backward rows of two shapes, an inference-only one)."""

from __future__ import annotations

import json

import pytest

from tests._scripts import load_script


def _step_table():
    return load_script("step_table")


def _row(shape: str, timing: str, seqlen: int, causal: bool, tuned: float, anchor: float):
    return {"shape": shape, "timing": timing, "ms": {"tuned": tuned, "cudnn": anchor},
            "problem": {"seqlen_q": seqlen, "causal": causal}}


def test_the_step_is_the_anchors_two_times_over_ours_per_shape(tmp_path, capsys) -> None:
    st = _step_table()
    rows = [_row("8x32x2048x64 bf16", "fwd", 2048, False, 0.5, 0.6),
            _row("8x32x2048x64 bf16", "bwd", 2048, False, 1.8, 1.6),
            _row("8x32x2048x64 bf16 causal", "fwd", 2048, True, 0.4, 0.35),
            _row("8x32x2048x64 bf16 causal", "bwd", 2048, True, 1.0, 1.1),
            _row("32x32x512x64 bf16", "fwd", 512, False, 0.2, 0.1),
            _row("32x32x512x64 bf16", "bwd", 512, False, 0.6, 0.3),
            _row("1x8x4096x128 bf16", "infer", 4096, False, 1.0, 2.0)]
    got = {r["shape"]: r for r in st.step_rows({"rows": rows})}
    # The inference-only shape has no step; the causal one is not merged with the other.
    assert set(got) == {"8x32x2048x64 bf16", "8x32x2048x64 bf16 causal", "32x32x512x64 bf16"}
    plain = got["8x32x2048x64 bf16"]
    assert plain["fwd"] == pytest.approx(0.6 / 0.5) and plain["bwd"] == pytest.approx(1.6 / 1.8)
    assert plain["step"] == pytest.approx((0.6 + 1.6) / (0.5 + 1.8))
    assert plain["step"] < 1.0
    assert got["8x32x2048x64 bf16 causal"]["step"] == pytest.approx(1.45 / 1.4)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows, "geomean_ratios": {}}))
    assert st.main([str(path)]) == 0
    out = capsys.readouterr().out
    # Of the two shapes from 2k queries, one steps at or above 1.0x (the causal one);
    # the 512-query shape is left out of the count; the lowest backward is the 512 one.
    assert "step >= 1.0x at S >= 2048: 1 of 2" in out
    assert "lowest backward 0.500x (32x32x512x64 bf16)" in out


def test_a_file_without_a_training_pair_is_a_clear_error(tmp_path) -> None:
    st = _step_table()
    path = tmp_path / "infer.json"
    path.write_text(json.dumps({"rows": [_row("1x8x4096x128 bf16", "infer", 4096, False,
                                              1.0, 2.0)]}))
    with pytest.raises(SystemExit, match="no shape has forward and backward rows"):
        st.main([str(path)])


def test_a_shape_read_mostly_as_host_time_is_named_so(tmp_path, capsys) -> None:
    """The bench's host_bound names of the forward and backward rows (ours and the
    anchor only) follow the shape, and the printed row says them."""
    st = _step_table()
    rows = [_row("32x16x512x128 bf16 causal", "fwd", 512, True, 0.2, 0.18),
            _row("32x16x512x128 bf16 causal", "bwd", 512, True, 0.9, 0.6),
            _row("8x32x2048x64 bf16", "fwd", 2048, False, 0.5, 0.6),
            _row("8x32x2048x64 bf16", "bwd", 2048, False, 1.8, 1.6)]
    rows[1]["host"] = {"host_bound": ["flex", "tuned"], "issue_ms": {}, "lead_ms": 0.0}
    rows[0]["host"] = {"host_bound": ["cudnn"], "issue_ms": {}, "lead_ms": 0.0}
    got = {r["shape"]: r for r in st.step_rows({"rows": rows})}
    assert got["32x16x512x128 bf16 causal"]["host_bound"] == ["cudnn", "tuned"]
    assert got["8x32x2048x64 bf16"]["host_bound"] == []
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows}))
    assert st.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x for x in lines if "host-bound" in x] == [
        next(x for x in lines if x.startswith("32x16x512x128"))]
    assert lines[[i for i, x in enumerate(lines) if x.startswith("32x16")][0]].endswith(
        "host-bound: cudnn, tuned")
