"""The measurement worker's start and end around interrupts: real worker processes.

An interrupt that lands while the parent starts the worker must not leave a worker no one
can stop, and a worker whose parent is gone exits without a traceback on the terminal the
two share (a Ctrl-C'd sweep once printed a BrokenPipeError after its resume message)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flashtune.autotune import _isolation
from flashtune.autotune._isolation import Worker

ROOT = Path(__file__).resolve().parents[2]


def _blocked(pid: int) -> int:
    """The signal mask of process ``pid`` (Linux: SigBlk in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk line for {pid}")


INTERRUPT_BITS = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))


class _Stop(Exception):
    pass


def test_an_interrupt_while_the_worker_starts_leaves_it_ours_to_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM sent the moment the child exists (as if it came inside Popen): it reaches
    its handler only once the worker's process and connection are the parent's, so
    close() ends it; the handlers are the caller's again afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen_then_interrupt(*args: Any, **kw: Any) -> subprocess.Popen[bytes]:
        p = real_popen(*args, **kw)
        started.append(p)
        os.kill(os.getpid(), signal.SIGTERM)
        return p

    def stop(signum: int, frame: Any) -> None:
        raise _Stop

    monkeypatch.setattr(_isolation.subprocess, "Popen", popen_then_interrupt)
    old = signal.signal(signal.SIGTERM, stop)
    # Python's default, or SIG_IGN where the suite runs as a background job (`cmd &`).
    sigint_before = signal.getsignal(signal.SIGINT)
    w = Worker(interpret=True)
    try:
        with pytest.raises(_Stop):
            w.start()
        assert len(started) == 1 and w.proc is started[0] and w.conn is not None
        assert signal.getsignal(signal.SIGTERM) is stop
        assert signal.getsignal(signal.SIGINT) is sigint_before
    finally:
        signal.signal(signal.SIGTERM, old)
        w.close()
    assert started[0].poll() is not None, "the worker outlived close()"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_the_worker_starts_with_interrupts_held_and_then_takes_them() -> None:
    """SIGINT and SIGTERM are blocked while the worker starts (a Ctrl-C then cannot end
    Python's start-up with a fatal error), and unblocked once it is ready: a SIGTERM
    ends it. The parent's own mask is as it was."""
    before = _blocked(os.getpid()) & INTERRUPT_BITS
    w = Worker(interpret=True)
    try:
        w.start()
        assert w.proc is not None
        assert not _blocked(w.proc.pid) & INTERRUPT_BITS
        assert _blocked(os.getpid()) & INTERRUPT_BITS == before
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        w.close()


def test_a_worker_whose_parent_is_gone_exits_without_a_traceback() -> None:
    ours, theirs = socket.socketpair()
    fd = theirs.fileno()
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.Popen([sys.executable, "-m", "flashtune.autotune._worker", str(fd)],
                            pass_fds=(fd,), cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    theirs.close()
    ours.close()  # gone before the worker could say it is ready
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]
