"""Crash isolation: the parent's handle on one measurement worker subprocess.

:meth:`Worker.request` sends one request and waits for the reply with a timeout.
If the worker dies (``os._exit``, SIGSEGV, an illegal memory access that kills the
CUDA context) or does not answer in time (a hang), the worker is killed, the
request is answered with ``{"status": "died" | "timeout", "detail": ...}`` and the
next request starts a fresh worker. The timeout clock starts only once the worker
has reported ready, so its import and CUDA start-up are never charged to a trial.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

STARTUP_TIMEOUT_S = 300.0
# The signals that interrupt a tuner (Ctrl-C, and SIGTERM as the sweep handles it).
INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM that arrive during the block: the first of them is raised
    again once it ends, to the handler that was in place before (a KeyboardInterrupt
    there, say, or the default SIGTERM's exit). Python runs signal handlers in the main
    thread only, so elsewhere nothing can interrupt the block and nothing is held. A
    signal mask would not do: the kernel hands a process-wide signal to any thread that
    does not block it, and the handler then runs in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        got.append(signum)

    old = {}
    for s in INTERRUPTS:
        h = signal.getsignal(s)
        if h is not None:  # None: set outside Python, which could not put it back
            old[s] = h
            signal.signal(s, hold)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            signal.raise_signal(got[0])


@contextmanager
def children_start_held() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread while the block starts child processes:
    they inherit the mask, so such a signal that reaches one while Python starts up (a
    Ctrl-C goes to the whole process group) waits until it calls
    :func:`unblock_interrupts`, its handlers in place, instead of ending it with a fatal
    error in its site import."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock_interrupts() -> None:
    """A child's side of :func:`children_start_held` (a no-op in a process started
    otherwise)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)


class Worker:
    """One measurement subprocess, started lazily and restarted after a death or hang."""

    def __init__(self, *, interpret: bool, env: dict[str, str] | None = None):
        self.interpret = interpret
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.restarts = 0
        self.starts = 0
        self.startup_seconds = 0.0

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        if self.interpret:
            env["TRITON_INTERPRET"] = "1"
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def start(self) -> None:
        if self.proc is not None:
            return
        t0 = time.perf_counter()
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        # An interrupt inside Popen (it waits for the exec) would leave a child running
        # that no one can stop or answer, and that prints a BrokenPipeError on the shared
        # terminal once it is ready: held until the process and its end are ours.
        with interrupts_held():
            with children_start_held():
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "flashtune.autotune._worker", str(fd)],
                    pass_fds=(fd,), env=self._env(), stdin=subprocess.DEVNULL)
            theirs.close()
            self.conn = Connection(ours.detach())
        self.starts += 1
        ready = self._recv(STARTUP_TIMEOUT_S)
        if not isinstance(ready, dict) or ready.get("op") != "ready":
            self.kill()
            raise RuntimeError(f"measurement worker failed to start: {ready!r}")
        self.startup_seconds += time.perf_counter() - t0

    def _recv(self, timeout: float) -> Any:
        assert self.conn is not None and self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"status": "timeout", "detail": f"no answer within {timeout:.0f} s"}
            try:
                if self.conn.poll(min(left, 0.5)):
                    return self.conn.recv()
            except (EOFError, OSError):
                return self._death()
            if self.proc.poll() is not None:
                # It may have answered just before exiting.
                try:
                    if self.conn.poll(0):
                        return self.conn.recv()
                except (EOFError, OSError):
                    pass
                return self._death()

    def _death(self) -> dict[str, Any]:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        if rc is not None and rc < 0:
            try:
                how = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                how = f"killed by signal {-rc}"
        else:
            how = f"exited with code {rc}"
        return {"status": "died", "detail": f"measurement worker {how}"}

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send ``msg``; the reply, or a died/timeout record (the worker is then replaced)."""
        self.start()
        assert self.conn is not None
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError):
            reply: Any = self._death()
        else:
            reply = self._recv(timeout)
        if not isinstance(reply, dict):
            reply = {"status": "error", "detail": f"unexpected reply {reply!r}"}
        if reply.get("status") in ("died", "timeout") or reply.get("poisoned"):
            self.kill()
            self.restarts += 1
        return reply

    def kill(self) -> None:
        """Stop the worker now (SIGKILL); the next request starts a fresh one."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None

    def close(self) -> None:
        """Ask the worker to exit, then make sure it has."""
        if self.proc is not None and self.conn is not None and self.proc.poll() is None:
            try:
                self.conn.send({"op": "stop"})
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
