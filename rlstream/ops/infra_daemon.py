"""``rlstream infra up``'s daemon: it owns the local stack's services (they die with it) and hands over to the
starting command only once they answer; killed before that, ``infra up`` takes them down with it."""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rlstream.ops.children import spawn
from rlstream.ops.infra import STATE_FILE, InfraError, LocalStack, ServiceProcess
from rlstream.ops.processes import stop_pid
from rlstream.transport.log import get_logger

log = get_logger(__name__)

READY, HANDOVER = "READY", "OK"


def _reply(line: str) -> bool:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        return True
    except (BrokenPipeError, OSError, ValueError):
        return False


def serve(state_dir: Path, kafka_port: int | None = None, redis_port: int | None = None) -> int:
    """The ``infra up`` daemon: start the services (they die with this process), write the state file, say
    READY on stdout and wait for ``OK`` on stdin. No OK (the starting command ended first): stop everything.
    Then run until SIGTERM/SIGINT/SIGHUP and stop the services."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    state_file = state_dir / STATE_FILE
    try:
        stack = LocalStack.start(state_dir, kafka_port, redis_port)
    except InfraError as exc:
        _reply("ERROR " + json.dumps(str(exc)))
        return 1
    stack.supervisor = ServiceProcess.started("supervisor", "", os.getpid())
    stack.save(state_file)
    handed_over = not stop.is_set() and _reply(READY) and sys.stdin.readline().strip() == HANDOVER
    if not handed_over or stop.is_set():
        log.warning("the starting command ended before the hand-over; stopping the services")
        stack.supervisor = None
        stack.stop()
        state_file.unlink(missing_ok=True)
        return 1
    devnull = os.open(os.devnull, os.O_RDWR)  # the starting command is gone: no stdio from it
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    log.info("local infrastructure up", kafka=stack.bootstrap, redis=stack.redis_url, state=str(state_file))
    reported: set[str] = set()
    while not stop.wait(1.0):
        for svc in (stack.kafka, stack.redis):
            if not svc.external and svc.name not in reported and not svc.is_running():
                reported.add(svc.name)
                log.error("a service exited; `rlstream infra down` cleans up", service=svc.name, log=svc.log_file)
    stack.supervisor = None
    stack.stop()
    log.info("local infrastructure stopped")
    return 0


class AlreadyRunning(InfraError):
    """``infra up`` found a stack of its state directory still running."""

    def __init__(self, state_file: Path, stack: LocalStack) -> None:
        super().__init__(f"already running (state {state_file}); `rlstream infra down` first")
        self.stack = stack


def bring_up(state_dir: Path, kafka_port: int | None = None, redis_port: int | None = None) -> LocalStack:
    """``rlstream infra up``: start the daemon and its services unless the state directory's stack still runs
    (PIDs checked against their recorded start times: a reused PID does not count). Raises
    :class:`AlreadyRunning` or :class:`InfraError`."""
    state_file = state_dir / STATE_FILE
    if state_file.exists():
        stack = LocalStack.load(state_file)
        if stack.running():
            raise AlreadyRunning(state_file, stack)
    return start_background(state_dir, kafka_port, redis_port)


def take_down(state_dir: Path) -> tuple[LocalStack, dict[str, str]] | None:
    """``rlstream infra down``: stop what the state file names (see :meth:`LocalStack.stop`) and remove the file;
    returns the stack and ``{name: outcome}``, or None when there is no state file."""
    state_file = state_dir / STATE_FILE
    if not state_file.exists():
        return None
    stack = LocalStack.load(state_file)
    outcome = stack.stop()
    state_file.unlink(missing_ok=True)  # what it names is stopped, or gone
    return stack, outcome


def start_background(state_dir: Path, kafka_port: int | None = None, redis_port: int | None = None,
                     timeout_s: float = 90.0) -> LocalStack:
    """Start the :func:`serve` daemon and return its stack once the services answer. The daemon outlives this
    process (that is what ``infra up`` is for); if this process ends before the hand-over, the services go."""
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", "from rlstream.ops.infra_daemon import main; main()", "serve", "--state-dir", str(state_dir)]
    if kafka_port:
        cmd += ["--kafka-port", str(kafka_port)]
    if redis_port:
        cmd += ["--redis-port", str(redis_port)]
    log_file = state_dir / "infra.log"
    with open(log_file, "ab") as log_fh:
        proc = spawn(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_fh, detach=True)
    assert proc.stdout is not None and proc.stdin is not None
    line = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not line:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline().decode(errors="replace").strip() or "EXIT"
    if line == READY:
        proc.stdin.write(f"{HANDOVER}\n".encode())
        proc.stdin.flush()
        proc.stdin.close()
        proc.stdout.close()
        proc.returncode = 0  # it lives on by design; nothing to wait for or warn about
        return LocalStack.load(state_dir / STATE_FILE)
    stop_pid(proc.pid, timeout_s=30.0)
    if line.startswith("ERROR "):
        raise InfraError(json.loads(line[len("ERROR "):]))
    tail = log_file.read_text(errors="replace")[-2000:]
    what = "exited" if line else f"did not answer within {timeout_s:.0f} s"
    raise InfraError(f"the infra supervisor {what}; log {log_file}:\n{tail}")


def main(argv: list[str] | None = None) -> None:
    """``python -c 'from rlstream.ops.infra_daemon import main; main()' serve --state-dir DIR``: the infra daemon."""
    from rlstream.transport.log import configure_logging

    parser = argparse.ArgumentParser(prog="rlstream-infra")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve")
    run.add_argument("--state-dir", type=Path, required=True)
    run.add_argument("--kafka-port", type=int)
    run.add_argument("--redis-port", type=int)
    args = parser.parse_args(argv)
    configure_logging("json")
    raise SystemExit(serve(args.state_dir, args.kafka_port, args.redis_port))
