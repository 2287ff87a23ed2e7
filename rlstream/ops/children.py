"""Starting children that die with this process, however it ends.

* :func:`spawn` starts a child as the leader of a new session, so the child and everything it starts (vLLM's
  engine and workers) form one process group, which :func:`rlstream.ops.processes.stop_pid` signals as a whole.
* A child started from the main thread gets ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: Linux signals it when its
  parent ends in any way, SIGKILL included.
* Every process that spawns children also runs a small *group reaper* (:class:`GroupReaper`, the script
  ``rlstream/ops/reaper.py``), a process of its own that holds one end of a pipe: when the parent ends, however it
  ends, the pipe closes and the reaper SIGTERMs, then SIGKILLs, every process group still registered (grandchildren
  included; children started from other threads, which PDEATHSIG cannot cover, too).
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any, Callable

from rlstream.transport.log import get_logger

log = get_logger(__name__)
#: How long the group reaper waits for the process groups of a dead parent before it SIGKILLs them.
REAPER_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1
REAPER_SCRIPT = Path(__file__).with_name("reaper.py")
_prctl: Any = None


def _load_prctl() -> Any:
    """libc's prctl (psutil has no PDEATHSIG), looked up in the parent: the child between fork and exec should do
    as little as it can."""
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            import ctypes

            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    return _prctl or None


def _die_with_parent(parent_pid: int, prctl: Any) -> Callable[[], None]:
    """A ``preexec_fn``: SIGTERM this child when its parent ends; if the parent is gone already, end now."""
    sigterm = int(signal.SIGTERM)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sigterm)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


class GroupReaper:
    """One small process per parent: it reads process-group ids from a pipe, and when the parent's end of
    the pipe closes (the parent ended: normally, by a signal, by SIGKILL) it stops every group still
    registered: SIGTERM (at once for a group whose leader is gone or has no PDEATHSIG), then SIGKILL after
    :data:`REAPER_GRACE_S`."""

    _lock = threading.Lock()
    _proc: subprocess.Popen[bytes] | None = None
    _owner: int | None = None
    _groups: dict[int, bool] = {}  # pgid -> started with PDEATHSIG

    @classmethod
    def _pipe(cls) -> IO[bytes] | None:
        if cls._proc is not None and cls._owner == os.getpid() and cls._proc.poll() is None:
            return cls._proc.stdin
        if not Path("/proc").is_dir():
            return None
        if cls._owner != os.getpid():  # a forked child: its parent's groups are not its own
            cls._groups = {}
        cls._proc = subprocess.Popen([sys.executable, "-I", "-S", str(REAPER_SCRIPT), str(REAPER_GRACE_S)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        cls._owner = os.getpid()
        assert cls._proc.stdin is not None
        for pgid, pdeathsig in cls._groups.items():  # a reaper that died is replaced with what it watched
            cls._proc.stdin.write(f"+ {pgid} {int(pdeathsig)}\n".encode())
        return cls._proc.stdin

    @classmethod
    def _send(cls, line: str) -> None:
        try:
            pipe = cls._pipe()
            if pipe is not None:
                pipe.write(line.encode())
                pipe.flush()
        except (OSError, ValueError) as exc:  # the reaper is gone: PDEATHSIG still covers direct children
            log.warning("process-group reaper unavailable", error=str(exc))

    @classmethod
    def watch(cls, pgid: int, pdeathsig: bool) -> None:
        """Register a process group to stop when this process ends."""
        with cls._lock:
            cls._send(f"+ {pgid} {int(pdeathsig)}\n")
            cls._groups[pgid] = pdeathsig

    @classmethod
    def forget(cls, pgid: int) -> None:
        """Unregister a process group (it was stopped)."""
        with cls._lock:
            if cls._owner == os.getpid() and pgid in cls._groups:
                del cls._groups[pgid]
                cls._send(f"- {pgid}\n")

    @classmethod
    def close(cls) -> None:
        """At a normal exit: close the pipe (the reaper stops what is still registered) and collect it."""
        with cls._lock:
            proc, cls._proc = cls._proc, None
            if proc is None or cls._owner != os.getpid():
                return
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=0.5 if not cls._groups else REAPER_GRACE_S + 1)
            except (OSError, subprocess.TimeoutExpired):
                pass


atexit.register(GroupReaper.close)


def spawn(cmd: list[str], *, stdout: Any = None, stderr: Any = None, stdin: Any = subprocess.DEVNULL,
          env: dict[str, str] | None = None, cwd: str | Path | None = None,
          detach: bool = False) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a new session (its own process group, which it shares with whatever it
    starts). Unless ``detach``, it dies with this process however this process ends: PDEATHSIG when started
    from the main thread (Linux ties it to the starting *thread*), and the :class:`GroupReaper` always."""
    prctl = None if detach else _load_prctl()
    pdeath = prctl is not None and threading.current_thread() is threading.main_thread()
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, stdin=stdin, env=env, cwd=cwd,
                            start_new_session=True,
                            preexec_fn=_die_with_parent(os.getpid(), prctl) if pdeath else None)
    if not detach:
        GroupReaper.watch(proc.pid, pdeath)
    return proc
