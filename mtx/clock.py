"""Stopping and the training clock: the signals that save a checkpoint and stop (`StopRequest`),
and a clock that leaves out the time the process was stopped (`PauseClock`). It imports no torch."""

from __future__ import annotations

import logging
import signal
import threading
import time
from time import monotonic as _monotonic
from typing import Any

from mtx.errors import STOP_SIGNALS, take_signals

log = logging.getLogger(__name__)


class StopRequest:
    """SIGINT, SIGTERM and SIGHUP set a flag; the loop saves a checkpoint at the next step boundary.

    A second signal, or the first while `at_once` is set (setting up, before anything could be
    saved), stops at once (KeyboardInterrupt). `announce=False` keeps the "received" line to itself
    (torchrun's ranks other than 0: rank 0 speaks for the job)."""

    def __init__(self, announce: bool = True) -> None:
        self.signal: int | None = None
        self.second: int | None = None  # a second signal, which stopped at once
        self.announce = announce
        self.at_once = False  # True: the first signal stops at once too (KeyboardInterrupt)
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._old = take_signals(self._handle, (signal.SIGINT, *STOP_SIGNALS))
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:  # a second Ctrl-C: stop now
            self.second = signum
            raise KeyboardInterrupt
        self.signal = signum
        if self.at_once:  # setting up: nothing to save yet
            raise KeyboardInterrupt
        if self.announce:
            log.warning("received %s: saving a checkpoint and stopping", signal.Signals(signum).name)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class PauseClock:
    """Training's clock: `time.perf_counter()` less the time the process was stopped (Ctrl-Z,
    `kill -STOP`), which train.max_minutes, elapsed_s and tokens/s do not count (stop 68's probe:
    a run stopped for 40 s of a 30 s budget trained 167 steps where 553 were its due, its linear
    rate ended at 73% of the peak, and the window with the stop logged 31 tgt tok/s). While it
    runs, a thread wakes every `TICK` s: a wake more than `GAP` s late means that the whole process
    was stopped (a stop shorter than that counts; a suspended machine's time perf_counter already
    leaves out). `GAP` is long beside what a call that holds the GIL keeps the thread waiting. Its
    stops are timed on `time.monotonic` (the clock of `perf_counter` on Linux), read once at
    import, which a test's stand-in for `perf_counter` leaves as it is."""

    TICK, GAP = 0.05, 5.0

    def __init__(self) -> None:
        self.paused = 0.0
        self.last = _monotonic()  # the thread's last wake
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PauseClock:
        self.last = _monotonic()
        self._done.clear()
        self._thread = threading.Thread(target=self._watch, name="mtx-pause-clock", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(self.TICK):
            with self._lock:
                now = _monotonic()
                if now - self.last > self.GAP:
                    self.paused += now - self.last - self.TICK
                self.last = now

    def now(self) -> float:
        """Seconds of a clock that stood still while the process was stopped (a stop the thread has
        not woken from yet left out too)."""
        with self._lock:
            late = _monotonic() - self.last if self._thread is not None and not self._done.is_set() else 0.0
            return time.perf_counter() - self.paused - (late - self.TICK if late > self.GAP else 0.0)
