"""The worker's stop deadline: armed once by the first stop signal, it ends the process with 128 + signal."""
from __future__ import annotations

import os
import signal
import threading
import time

from rlstream.streams.shutdown import StopDeadline


def test_the_deadline_exits_once_with_the_signal_code_and_only_after_its_time() -> None:
    exited: list[tuple[int, float]] = []
    done = threading.Event()

    def fake_exit(code: int) -> None:
        exited.append((code, time.monotonic()))
        done.set()

    deadline = StopDeadline(0.3, exit_process=fake_exit)
    start = time.monotonic()
    assert deadline.arm(signal.SIGTERM) is True
    assert deadline.arm(signal.SIGINT) is False  # a second signal does not move or add a deadline
    assert done.wait(5)
    time.sleep(0.4)
    assert [code for code, _ in exited] == [143]
    assert exited[0][1] - start >= 0.3
    assert deadline.timer is not None and deadline.timer.daemon


def test_a_real_sigterm_arms_it_from_the_python_handler() -> None:
    exited: list[int] = []
    deadline = StopDeadline(60, exit_process=exited.append)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        deadline.install((signal.SIGTERM,))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs in the main thread at the next bytecode
        assert deadline.timer is not None and deadline.timer.is_alive() and exited == []
    finally:
        deadline.cancel()
        signal.signal(signal.SIGTERM, previous)
