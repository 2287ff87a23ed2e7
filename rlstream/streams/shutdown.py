"""A hard deadline on the worker's stop.

SIGTERM or SIGINT starts Faust's clean stop (flush, commit the open transactions, leave the group). With the
broker down or frozen, aiokafka's coordinator look-ups, commits and leave-group calls retry for much longer
than a supervisor waits, so a timer thread, armed by the signal itself, ends the process once
``streams.stop_timeout_s`` has passed without the stop finishing (exit code 128 + the signal's number).

Exiting then loses no applied work: a record's effects (groups, dead letters, table changes and its progress
marker) go out in its source partition's transaction, so work is either committed, and stays committed, or
in a transaction that never commits and that the broker aborts (when the next worker with the same
transactional id starts, or on the transaction timeout); the next worker resumes at the committed markers.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Callable, Iterable

import faust

from rlstream.transport.log import get_logger

log = get_logger(__name__)


def flush_standard_streams() -> None:
    """Flush stdout and stderr before a hard exit (``os._exit`` skips it); a broken stream is ignored."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not keep the process alive
            pass


class StopDeadline:
    """Ends the process ``timeout_s`` after the first stop signal, unless it has ended by then."""

    def __init__(self, timeout_s: float, exit_process: Callable[[int], object] = os._exit) -> None:
        self.timeout_s = timeout_s
        self.exit_process = exit_process
        self.timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def arm(self, signum: int) -> bool:
        """Start the deadline (once; later signals change nothing). True when this call started it."""
        with self._lock:
            if self.timer is not None:
                return False
            self.timer = threading.Timer(self.timeout_s, self._expire, args=(signum,))
            self.timer.daemon = True  # never what keeps the process alive
            self.timer.name = "rlstream-stop-deadline"
            self.timer.start()
            return True

    def cancel(self) -> None:
        """Stop the timer (tests; the worker process relies on it until the very end)."""
        with self._lock:
            if self.timer is not None:
                self.timer.cancel()

    def _expire(self, signum: int) -> None:
        log.error("streams worker did not stop cleanly in time; exiting now (open transactions are aborted by the "
                  "broker, committed work stays committed)", timeout_s=self.timeout_s,
                  signal=signal.Signals(signum).name)
        flush_standard_streams()
        self.exit_process(128 + signum)

    def install(self, signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Arm on ``signals`` from a Python-level handler (runs in the main thread even while the event loop is
        busy). Call after asyncio's ``add_signal_handler``: the loop still learns of the signal through its wakeup
        fd, which the interpreter writes for every signal, so Faust's own handler runs as before."""
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:  # noqa: ARG002
        if self.arm(signum):
            log.info("stop signal received; clean stop under way", signal=signal.Signals(signum).name,
                     deadline_s=self.timeout_s)


class DeadlineWorker(faust.Worker):
    """``faust.Worker`` whose stop signals also arm a :class:`StopDeadline`."""

    stop_deadline: StopDeadline | None = None

    def install_signal_handlers(self) -> None:
        super().install_signal_handlers()
        if self.stop_deadline is not None and sys.platform != "win32":
            self.stop_deadline.install()
