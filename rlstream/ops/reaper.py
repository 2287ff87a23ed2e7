"""The process-group reaper of :class:`rlstream.ops.children.GroupReaper`, run as a script by an interpreter of its
own (``python -I -S reaper.py GRACE_S``); standard library only, nothing of rlstream is imported.

It reads ``+ PGID PDEATHSIG`` / ``- PGID`` lines from stdin, the pipe its parent holds. When the pipe closes
(the parent ended, however it ended) it stops every registered process group that still has members:
SIGTERM (at once for a group whose leader is gone or was started without PDEATHSIG; a leader with PDEATHSIG
got its SIGTERM from Linux and is given the grace to stop its own group first), then SIGKILL after GRACE_S.
An empty group can never gain members again, so it is forgotten: a reused number is never signalled.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import time


def members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    fields = fh.read().rsplit(") ", 1)[-1].split()
            except OSError:
                continue
            if fields[0] != "Z" and fields[2] == str(pgid):
                out.append(int(name))
    return out


def watch(fd: int = 0) -> dict[int, bool]:
    """Read registrations until the pipe closes; returns ``{pgid: started with PDEATHSIG}`` still registered."""
    groups: dict[int, bool] = {}
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 2.0 if groups else None)
        if not ready:
            groups = {g: pd for g, pd in groups.items() if members(g)}
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return groups
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            parts = line.decode(errors="replace").split()
            if len(parts) == 3 and parts[0] == "+":
                groups[int(parts[1])] = parts[2] == "1"
            elif len(parts) >= 2 and parts[0] == "-":
                groups.pop(int(parts[1]), None)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def stop_groups(groups: dict[int, bool], grace_s: float) -> None:
    termed: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        live = {g: pd for g, pd in groups.items() if members(g)}
        if not live or time.monotonic() >= deadline:
            break
        for pgid, pdeathsig in live.items():
            if pgid not in termed and (not pdeathsig or pgid not in members(pgid)):
                termed.add(pgid)
                _killpg(pgid, signal.SIGTERM)
        time.sleep(0.1)
    for pgid in groups:
        if members(pgid):
            _killpg(pgid, signal.SIGKILL)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    grace_s = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    stop_groups(watch(), grace_s)


if __name__ == "__main__":
    main()
