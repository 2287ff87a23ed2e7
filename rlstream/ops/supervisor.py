"""The children of a launcher (``rlstream up``, ``rlstream finetune``): started as process-group leaders that die
with it however it ends, stopped newest first."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rlstream.ops.children import spawn
from rlstream.ops.processes import stop_pid
from rlstream.transport.log import get_logger

log = get_logger(__name__)


@dataclass
class Child:
    """A started child: its name, process and log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_file: Path


class Supervisor:
    """Starts children as process-group leaders that die with this process however it ends (PDEATHSIG and the
    group reaper of :func:`rlstream.ops.children.spawn`) and stops them by process group, newest first.

    ``env`` is added to every child's environment: the run's secrets travel there (:func:`secret_env`), never in
    the config files the children are started with."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env: dict[str, str] = dict(env or {})
        self.children: list[Child] = []
        self.extra_pids: dict[str, int] = {}

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        log_file = self.log_dir / f"{name}.log"
        with open(log_file, "ab") as out:
            proc = spawn(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env, **(env or {})})
        child = Child(name, proc, log_file)
        self.children.append(child)
        log.info("started", service=name, pid=proc.pid, log=str(log_file))
        return child

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def stop_all(self) -> None:
        for child in reversed(self.children):
            ended = child.proc.poll()  # it ended by itself: Popen collected its code; else stop_pid does
            reaped = stop_pid(child.proc.pid, timeout_s=20.0)
            log.info("stopped", service=child.name, pid=child.proc.pid,
                     exit_code=ended if ended is not None else reaped)
        for name, pid in self.extra_pids.items():
            log.info("stopped", service=name, pid=pid, exit_code=stop_pid(pid, timeout_s=20.0))


def rlstream_command(*args: str) -> list[str]:
    """The command line of an ``rlstream`` subcommand run with this interpreter."""
    return [sys.executable, "-m", "rlstream.cli", "--log-format", "json", *args]
