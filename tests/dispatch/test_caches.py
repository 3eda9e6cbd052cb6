"""What invalidates the dispatcher's remembered decisions and the kernels' per-signature
plans, and what it leaves alone: a database reload, a tuned result written by this
process, a device. Real SQLite databases; the other process is a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import flashtune
from flashtune import dispatch
from flashtune.kernels.attention import call_plan
from flashtune.kernels.config import default_fwd
from tests.dispatch.test_dispatch import FWD_A, FWD_B, fresh_db, prob, put, qkv


@pytest.fixture
def db(tmp_path, monkeypatch):
    yield from fresh_db(tmp_path, monkeypatch)


def _run(p, device):
    """One no-grad call of ``p``; returns the config its plan's forward launch runs."""
    q, k, v = qkv(p, device)
    flashtune.flash_attention(q, k, v, causal=p.causal)
    plan = call_plan(q, k, v, p.causal, None, (-1, -1), 0.0, True, None)
    assert plan.fwd is not None
    return plan.fwd.config, plan.fwd


def test_reload_serves_what_another_process_wrote(db, device):
    p = prob()
    assert _run(p, device)[0] == default_fwd(p)
    code = ("from tests.dispatch.test_dispatch import FWD_A, prob, put\n"
            f"put({str(db)!r}, prob(), 'fwd', FWD_A)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300,
                   env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert _run(p, device)[0] == default_fwd(p)  # remembered: no database read per call
    reads = dispatch.stats()["db_reads"]
    dispatch.reload()
    assert _run(p, device)[0] == FWD_A
    assert dispatch.stats()["db_reads"] == 1 and reads == 1


def test_a_tuned_entry_written_here_is_served_at_once_and_only_where_it_may_change(db, device):
    p = prob()  # bf16, d32, causal
    near = prob(seqlen_q=128, seqlen_k=128)  # the same family, another bucket
    other = prob(causal=False)  # another key family: its decision cannot change
    assert _run(p, device)[0] == default_fwd(p)
    assert _run(near, device)[0] == default_fwd(near)
    _, other_launch = _run(other, device)
    reads = dispatch.stats()["db_reads"]
    put(db, p, "fwd", FWD_A)  # the tuner's write, in this process
    assert _run(p, device)[0] == FWD_A
    assert _run(near, device)[0] == FWD_A  # now its nearest tuned bucket
    assert _run(other, device)[1] is other_launch  # untouched: the same launch object
    assert dispatch.stats()["db_reads"] == reads  # no table reload: the entry was added
    put(db, p, "fwd", FWD_B, median_ms=0.5)  # a faster result replaces it
    assert _run(p, device)[0] == FWD_B


def test_a_write_to_another_database_changes_nothing(db, tmp_path, device):
    p = prob()
    _, launch = _run(p, device)
    put(tmp_path / "elsewhere.db", p, "fwd", FWD_A)
    cfg, again = _run(p, device)
    assert cfg == default_fwd(p) and again is launch


def test_reload_of_one_device_leaves_the_others(db, device):
    p = prob()
    _, launch = _run(p, device)
    sights = dispatch.stats()["first_sights"]
    other = "cuda:1" if device == "cpu" else "cpu"
    dispatch.reload(other)
    assert _run(p, device)[1] is launch
    assert dispatch.stats()["first_sights"] == sights
    put_elsewhere = dispatch.stats()["table_loads"]
    dispatch.reload(torch.device(device))
    cfg, fresh = _run(p, device)
    assert fresh is not launch and cfg == default_fwd(p)
    assert dispatch.stats()["first_sights"] == sights + 1
    assert dispatch.stats()["table_loads"] == put_elsewhere + 1
