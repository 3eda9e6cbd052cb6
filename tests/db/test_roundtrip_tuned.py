"""Export -> import is lossless on a database filled by the real tuner (`autotune tune`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flashtune.db import open_storage
from flashtune.db.exchange import export_json, import_json


def test_round_trip_on_a_database_filled_by_autotune_tune(tmp_path: Path) -> None:
    src = tmp_path / "tuned.db"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "flashtune.cli", "tune", "--interpret", "--db", str(src),
           "--batch", "1", "--heads", "2", "--kv-heads", "1", "--seqlen", "33", "--head-dim",
           "32", "--dtype", "fp16", "--causal", "--trials", "2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    with open_storage(src) as st:
        first = export_json(st)
        assert export_json(st) == first  # two exports of one database: identical bytes
        tuned = st.results()
    assert {r.direction for r in tuned} == {"fwd", "bwd"}
    dst = tmp_path / "copy.db"
    with open_storage(dst) as st:
        report = import_json(st, first)
        assert report.added == len(tuned)
        assert export_json(st) == first  # lossless: the copy exports the same bytes
        copied = {(r.key, r.device, r.software): r for r in st.results()}
    for r in tuned:
        c = copied[(r.key, r.device, r.software)]
        assert (c.config, c.median_ms, c.max_error, c.trials, c.host, c.created_at) == \
            (r.config, r.median_ms, r.max_error, r.trials, r.host, r.created_at)
