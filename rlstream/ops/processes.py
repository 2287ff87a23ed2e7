"""Process identity and stopping, through psutil: is a PID alive, is it still the process that was recorded
(same boot, same start time), which processes share a process group, and stopping a process or its whole group.

A recorded identity is psutil's ``create_time`` (seconds since the epoch) plus the boot id. psutil derives the
start time from the boot time, which the kernel reports in whole seconds and which a clock adjustment moves, so two
start times within :data:`START_TIME_TOLERANCE_S` count as the same; a PID is reused only after the PID space wraps,
far later than that.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil

from rlstream.ops.children import GroupReaper

START_TIME_TOLERANCE_S = 0.5


def _is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie (a zombie counts as gone)."""
    try:
        return not _is_zombie(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (psutil's ``create_time``, seconds since the epoch); None when it does not exist."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): start times only compare within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def same_process(pid: int, start_time: float | None, boot: str | None = None,
                 expect_in_cmdline: str | None = None) -> bool:
    """True when ``pid`` is alive and still the process that was recorded: same boot, same start time.
    Without a recorded start time its command line must mention ``expect_in_cmdline`` (e.g. its data directory);
    with neither, the answer is False."""
    if not pid_alive(pid):
        return False
    if start_time is not None:
        if boot is not None and boot_id() not in (None, boot):
            return False
        current = process_start_time(pid)
        return current is not None and abs(current - start_time) < START_TIME_TOLERANCE_S
    if expect_in_cmdline:
        try:
            return expect_in_cmdline in " ".join(psutil.Process(pid).cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False
    return False


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and not _is_zombie(proc):
                found.append(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def _leads_own_group(pid: int) -> bool:
    """True when ``pid`` leads a process group that is not ours (so signalling the group is safe), also when the
    leader itself is gone and reaped while members of its group live on (a SIGKILLed vLLM API server's engine core:
    the kernel allocates no pid equal to a live process group's id, so such members are that leader's)."""
    try:
        return os.getpgid(pid) == pid and pid != os.getpgid(0)
    except ProcessLookupError:
        return pid != os.getpgid(0) and bool(group_members(pid))
    except PermissionError:
        return False


def reap(pid: int, settle_s: float = 0.0) -> int | None:
    """Collect ``pid``'s exit status when it is our child and has exited: its exit code (minus the signal's number
    when a signal ended it, as ``Popen.returncode``); None otherwise.

    With ``settle_s``, waits up to that long while ``pid`` shows as a zombie whose status cannot be collected yet:
    the main thread of a multi-threaded process (the learner, a streams worker) may end before its other threads,
    and the process's status only exists once the last one has ended."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours, or collected already
            return None
        if reaped == pid:
            return os.waitstatus_to_exitcode(status)
        if pid_alive(pid) or not psutil.pid_exists(pid) or time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_pid(pid: int, timeout_s: float = 30.0) -> int | None:
    """Stop a process by PID: SIGTERM, then SIGKILL after ``timeout_s``; reaps it when it is our child and returns
    its exit code then (None when it was not ours to reap, or was reaped before: ``Popen.poll()`` has that code),
    waiting a few seconds for a process whose main thread ended before its other threads.

    When it leads a process group of its own (everything :func:`rlstream.ops.children.spawn` starts does), the
    whole group is signalled, and members that outlive the leader (a server's workers) are SIGKILLed after a short
    grace."""
    group = _leads_own_group(pid)
    exit_code: int | None = None
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        if not pid_alive(pid):
            break
        _signal(pid, sig, group)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            exit_code = reap(pid)
            if exit_code is not None or not pid_alive(pid):
                break
            time.sleep(0.05)
    if exit_code is None:
        exit_code = reap(pid, settle_s=5.0)
    if group and group_members(pid):  # members that outlived their leader (they had its SIGTERM too)
        _signal(pid, signal.SIGTERM, True)
        deadline = time.monotonic() + min(5.0, timeout_s)
        while group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_members(pid):
            _signal(pid, signal.SIGKILL, True)
    GroupReaper.forget(pid)
    return exit_code
