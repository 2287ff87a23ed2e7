"""An rlstream command run by a test as a child process: its own session, output appended to a log, stopped by PID
(SIGTERM, then SIGKILL) or SIGKILLed on purpose."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Self

from rlstream.ops.processes import stop_pid

ROOT = Path(__file__).resolve().parents[2]


class ChildProcess:
    """``cmd`` as a child process in its own session, run from the repository root, its output in ``log_path``."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log_path = log_path
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush, no commit."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_pid(self.proc.pid, timeout_s=20)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def shown(self, line: str) -> bool:
        """Whether a log line belongs in :meth:`log_tail` (subclasses leave out their noise)."""
        return True

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` shown lines of its log."""
        with contextlib.suppress(OSError):
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if self.shown(line)]
            return "\n".join(lines[-n:])
        return ""
