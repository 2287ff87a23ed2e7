"""SIGTERM and SIGHUP as Ctrl-C for launchers, so that their ``finally`` blocks stop children in order."""
from __future__ import annotations

import signal
import threading
from typing import Any


class terminate_as_interrupt:
    """``with terminate_as_interrupt():`` SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does, so that a
    launcher's ``finally`` stops its children in order and writes its outputs (if it is killed outright, its
    children still die with it). Only in the main thread; elsewhere it does nothing. Call :meth:`install`
    again after ``asyncio.run``, whose signal handlers reset these signals to their defaults."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    @staticmethod
    def _raise(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    def install(self) -> None:
        """Route SIGTERM and SIGHUP to KeyboardInterrupt (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self._raise)
            self._previous.setdefault(sig, previous)

    def __enter__(self) -> "terminate_as_interrupt":
        self.install()
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before the first :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __exit__(self, *exc: Any) -> None:
        self.restore()
