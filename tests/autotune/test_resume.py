"""`autotune tune` interrupted by SIGINT, then by kill -9, resumes from the stored trials."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

from flashtune.autotune._faults import fault_env
from flashtune.db import open_storage
from flashtune.db.fingerprint import device_info, software_info
from flashtune.problem import Problem

ARGS = ["--interpret", "--batch", "1", "--heads", "2", "--seqlen", "32", "--head-dim", "32",
        "--dtype", "fp16", "--direction", "fwd", "--trials", "6", "--seed", "3"]


def _cli(db: str) -> subprocess.Popen[bytes]:
    # Every trial sleeps 1 s in the worker, so the interruptions land mid-search.
    env = {**os.environ, "TRITON_INTERPRET": "1", **fault_env(({}, "slow"))}
    return subprocess.Popen([sys.executable, "-c", "from flashtune.cli import main; main()", "tune",
                             "--db", db, *ARGS],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            # A background shell starts children with SIGINT ignored; Python
                            # then installs no KeyboardInterrupt handler. Restore the default.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _measured(url: str) -> list[optuna.trial.FrozenTrial]:
    try:
        names = optuna.get_all_study_names(url)
    except Exception:
        return []
    if not names:
        return []
    study = optuna.load_study(study_name=names[0], storage=url)
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("measured")]


def _wait_for(url: str, n: int, proc: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while len(_measured(url)) < n:
        assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
        assert time.monotonic() < deadline, "tuner made no progress"
        time.sleep(0.2)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_then_kill9_then_resume(tmp_path) -> None:
    db = str(tmp_path / "tuning.db")
    url = f"sqlite:///{db}"

    p1 = _cli(db)
    _wait_for(url, 2, p1)
    p1.send_signal(signal.SIGINT)
    out1 = p1.communicate(timeout=60)[0].decode()
    assert p1.returncode != 0, out1
    first = {t.number: t.params for t in _measured(url)}
    assert len(first) >= 2

    p2 = _cli(db)
    _wait_for(url, len(first) + 1, p2)
    p2.kill()
    p2.wait(timeout=30)
    second = {t.number: t.params for t in _measured(url)}
    assert len(second) > len(first) and second.items() >= first.items()

    p3 = _cli(db)
    out3 = p3.communicate(timeout=180)[0].decode()
    assert p3.returncode == 0, out3[-3000:]
    final = _measured(url)
    # The budget counts the trials measured before the interruptions; none was redone.
    assert len(final) == 6, out3
    assert {t.number: t.params for t in final}.items() >= second.items()
    study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    problem = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=32, seqlen_k=32, head_dim=32,
                      dtype="fp16")
    with open_storage(db) as st:
        assert st.get_result(device_info(), software_info(), problem.key("fwd")) is not None


def test_recover_fails_a_running_trial_killed_before_it_named_its_tuner() -> None:
    """A kill -9 between asking a trial and writing its pid leaves a RUNNING trial with no
    pid. It is failed when no other tuner of the study is alive, and kept while one is."""
    from flashtune.autotune.study import recover

    study = optuna.create_study()
    orphan = study.ask()  # RUNNING, no host or pid: its tuner died right after asking
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        study.set_user_attr(f"tuner:{socket.gethostname()}:{live.pid}", 0.0)
        assert recover(study) == 0  # another tuner is alive: the trial may be its own
        assert study.trials[orphan.number].state == TrialState.RUNNING
    finally:
        live.kill()
        live.wait()
    assert recover(study) == 1
    assert study.trials[orphan.number].state == TrialState.FAIL
    assert "abandoned" in study.trials[orphan.number].user_attrs["error"]
