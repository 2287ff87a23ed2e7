"""The children of a launcher (``rlstream up``, ``rlstream finetune``): started as process-group leaders that die
with it however it ends, stopped newest first.

A child is essential (the run cannot go on without it: :meth:`Supervisor.dead` names it once it ended, and the
launcher stops the run) or auxiliary (``rlstream console``: the run goes on without it; once it ended it is logged
with its exit code and log file and started again after a backoff, at most :data:`AUXILIARY_RESTARTS` times)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.ops.children import GroupReaper, spawn
from rlstream.ops.processes import stop_pid
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: Times an auxiliary child that ended is started again before the run goes on without it.
AUXILIARY_RESTARTS = 3
#: Seconds before an auxiliary child that ended is started again; doubled after each restart.
AUXILIARY_BACKOFF_S = 2.0


@dataclass
class Child:
    """A started child: its name, process and log file; an auxiliary one (the run goes on without it) also keeps
    how to start it again, how often it was, and when it was last seen ended."""

    name: str
    proc: subprocess.Popen[bytes]
    log_file: Path
    auxiliary: bool = False
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    ended_at: float | None = None  # monotonic time the current process was seen ended (None: running)


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

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None, auxiliary: bool = False) -> Child:
        """Start ``args`` as the child ``name`` (output appended to ``LOG_DIR/NAME.log``); ``auxiliary``: the run
        goes on without it (see the module docstring)."""
        log_file = self.log_dir / f"{name}.log"
        child_env = {**os.environ, **self.env, **(env or {})}
        child = Child(name, self._start(args, child_env, log_file), log_file, auxiliary, list(args), child_env)
        self.children.append(child)
        log.info("started", service=name, pid=child.proc.pid, log=str(log_file), auxiliary=auxiliary)
        return child

    @staticmethod
    def _start(args: list[str], env: dict[str, str], log_file: Path) -> subprocess.Popen[bytes]:
        with open(log_file, "ab") as out:
            return spawn(args, stdout=out, stderr=subprocess.STDOUT, env=env)

    def dead(self) -> list[Child]:
        """The essential children that ended (the run cannot go on without them); auxiliary children that ended are
        tended to (:meth:`tend_auxiliary`), never named here."""
        self.tend_auxiliary()
        return [c for c in self.children if not c.auxiliary and c.proc.poll() is not None]

    def tend_auxiliary(self, now: float | None = None) -> list[Child]:
        """Auxiliary children that are not running: each one that ended is logged once (exit code, log file), and
        started again ``AUXILIARY_BACKOFF_S * 2**restarts`` seconds later, at most :data:`AUXILIARY_RESTARTS`
        times; then the run goes on without it. Returns those still not running."""
        now = time.monotonic() if now is None else now
        down = []
        for child in self.children:
            if not child.auxiliary or child.proc.poll() is None:
                continue
            if child.ended_at is None:
                child.ended_at = now
                gives_up = child.restarts >= AUXILIARY_RESTARTS
                log.error("auxiliary service stopped; the run goes on" + (" without it" if gives_up else ""),
                          service=child.name, exit_code=child.proc.returncode, log=str(child.log_file),
                          restarts=child.restarts)
            backoff_s = AUXILIARY_BACKOFF_S * 2 ** child.restarts
            if child.restarts < AUXILIARY_RESTARTS and now - child.ended_at >= backoff_s:
                GroupReaper.forget(child.proc.pid)  # its process group is gone; the new one is watched instead
                child.proc = self._start(child.args, child.env, child.log_file)
                child.restarts += 1
                child.ended_at = None
                log.warning("auxiliary service started again", service=child.name, pid=child.proc.pid,
                            restarts=child.restarts)
                continue
            down.append(child)
        return down

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
