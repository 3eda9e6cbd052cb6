"""Miss recording: batched, written to the user database by a background thread."""

from __future__ import annotations

import atexit
import os
import threading

from flashtune._env import database_url
from flashtune.db.fingerprint import DeviceInfo, software_info
from flashtune.dispatch._state import counters, lock, warn_once
from flashtune.problem import Problem, ProblemKey

_MISS_BATCH = 64  # pending keys that wake the recorder before its period is up
_MISS_PERIOD_S = 30.0
WRITE_BUSY_TIMEOUT_S = 10.0  # a writer holding the lock longer costs this batch (counted)
_EXIT_FLUSH_S = 5.0  # at most this long at interpreter exit for the last batch


class MissRecorder:
    """Batches misses and writes them from a background thread (never on the hot path)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._pending: dict[DeviceInfo, dict[ProblemKey, tuple[int, Problem]]] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._writing = threading.Lock()

    def add(self, device: DeviceInfo, key: ProblemKey, problem: Problem) -> None:
        with self._cv:
            per = self._pending.setdefault(device, {})
            count = per.get(key, (0, problem))[0]
            per[key] = (count + 1, problem)
            if self._thread is None or self._pid != os.getpid():  # none yet, or forked
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="flashtune-misses",
                                                daemon=True)
                self._thread.start()
            if sum(len(p) for p in self._pending.values()) >= _MISS_BATCH:
                self._cv.notify()

    def _take(self) -> dict[DeviceInfo, dict[ProblemKey, tuple[int, Problem]]]:
        with self._cv:
            batch, self._pending = self._pending, {}
            return batch

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait(timeout=_MISS_PERIOD_S)
            self.write()

    def write(self) -> None:
        with self._writing:
            batch = self._take()
            if not batch:
                return
            n = sum(c for misses in batch.values() for c, _ in misses.values())
            try:
                from flashtune.db import open_storage

                sw = software_info()
                with open_storage(database_url(), busy_timeout=WRITE_BUSY_TIMEOUT_S) as storage:
                    for device, misses in batch.items():
                        storage.record_misses(device, sw, misses)
            except Exception as e:
                with lock:
                    counters["misses_dropped"] += n
                warn_once("misses", f"flashtune: cannot record dispatcher misses in the "
                           f"tuning database ({type(e).__name__}: {e}); dropping them "
                           "(stats()['misses_dropped'] counts them)")
                return
            with lock:
                counters["misses_recorded"] += n

    def flush(self, timeout: float | None = None) -> bool:
        """Write what is pending now; False if it did not finish within ``timeout``."""
        t = threading.Thread(target=self.write, name="flashtune-misses-flush", daemon=True)
        t.start()
        t.join(timeout)
        return not t.is_alive()


recorder = MissRecorder()


def flush_misses(timeout: float | None = None) -> bool:
    """Write the pending misses to the database now (also done at exit, bounded)."""
    return recorder.flush(timeout)


atexit.register(flush_misses, _EXIT_FLUSH_S)
