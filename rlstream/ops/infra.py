"""The local infrastructure: noida-db (Kafka protocol) and redis-server on free loopback ports, and the process
handling every launcher of rlstream shares.

One launcher for the CLI (``rlstream infra up``) and the tests. Each service runs in its own process session
with a throwaway data directory, is waited on until it answers, and is stopped by its PID.
``RLSTREAM_KAFKA_BOOTSTRAP`` / ``RLSTREAM_REDIS_URL`` point everything at external services instead, and then
nothing is started for that service.

Process trees (``rlstream up``, ``rlstream finetune``, the tests, the ``infra up`` supervisor):

* :func:`spawn` starts a child as the leader of a new session, so the child and everything it starts (vLLM's
  engine and workers) form one process group, which :func:`stop_pid` signals as a whole.
* A child started from the main thread gets ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: Linux signals it when its
  parent ends in any way, SIGKILL included.
* Every process that spawns children also runs a small *group reaper* (:class:`GroupReaper`), a process of its
  own that holds one end of a pipe: when the parent ends, however it ends, the pipe closes and the reaper
  SIGTERMs, then SIGKILLs, every process group still registered (grandchildren included; children started
  from other threads, which PDEATHSIG cannot cover, too).
* ``rlstream infra up`` leaves its services running on purpose: it starts a small supervisor daemon
  (:func:`serve`) that owns them (they die with it) and hands over only once the services answer; killed before
  that, ``infra up`` takes them down with it. The state file records each PID with its start time (field 22 of
  ``/proc/<pid>/stat``) and the boot id, and ``infra down`` signals a PID only when both still match, so a
  PID reused by another process (after a reboot, say) is never signalled.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from rlstream.transport.log import get_logger

log = get_logger(__name__)
LOOPBACK = "127.0.0.1"
#: How long the group reaper waits for the process groups of a dead parent before it SIGKILLs them.
REAPER_GRACE_S = 10.0
STATE_FILE = "infra.json"


class InfraError(RuntimeError):
    """A local service could not be started or reached."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


# --- process identity ----------------------------------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, is index 0)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(") ", 1)[-1].split()
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)  # a zombie counts as gone
    return fields is None or fields[0] != "Z"


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (field 22 of ``/proc/<pid>/stat``); None without /proc."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): start times only compare within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def same_process(pid: int, start_time: int | None, boot: str | None = None, expect_in_cmdline: str | None = None) -> bool:
    """True when ``pid`` is alive and still the process that was recorded: same boot, same start time.
    Without a recorded start time (a state file of an older rlstream) its command line must mention
    ``expect_in_cmdline`` (e.g. its data directory); with neither, the answer is False. Without ``/proc``
    (not Linux) nothing can be checked and a live PID counts as the same process."""
    if not pid_alive(pid):
        return False
    if not Path("/proc").is_dir():
        return True
    if start_time is not None:
        if boot is not None and boot_id() not in (None, boot):
            return False
        return process_start_time(pid) == start_time
    if expect_in_cmdline:
        try:
            return expect_in_cmdline in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
    return False


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields and fields[0] != "Z" and fields[2] == str(pgid):
                found.append(int(entry.name))
    return found


def _leads_own_group(pid: int) -> bool:
    """True when ``pid`` leads a process group that is not ours (so signalling the group is safe)."""
    try:
        return os.getpgid(pid) == pid and pid != os.getpgid(0)
    except (ProcessLookupError, PermissionError):
        return False


def _reap(pid: int, settle_s: float = 0.0) -> int | None:
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
        fields = _stat_fields(pid)
        if fields is None or fields[0] != "Z" or time.monotonic() >= deadline:
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

    When it leads a process group of its own (everything :func:`spawn` starts does), the whole group is
    signalled, and members that outlive the leader (a server's workers) are SIGKILLed after a short grace."""
    group = _leads_own_group(pid)
    exit_code: int | None = None
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        if not pid_alive(pid):
            break
        _signal(pid, sig, group)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            exit_code = _reap(pid)
            if exit_code is not None or not pid_alive(pid):
                break
            time.sleep(0.05)
    if exit_code is None:
        exit_code = _reap(pid, settle_s=5.0)
    if group and group_members(pid):  # members that outlived their leader (they had its SIGTERM too)
        _signal(pid, signal.SIGTERM, True)
        deadline = time.monotonic() + min(5.0, timeout_s)
        while group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_members(pid):
            _signal(pid, signal.SIGKILL, True)
    GroupReaper.forget(pid)
    return exit_code


# --- starting children ---------------------------------------------------------------------------------
PR_SET_PDEATHSIG = 1
_prctl: Any = None


def _load_prctl() -> Any:
    """libc's prctl, looked up in the parent (the child between fork and exec should do as little as it can)."""
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


REAPER_SCRIPT = Path(__file__).with_name("reaper.py")


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
        with cls._lock:
            cls._send(f"+ {pgid} {int(pdeathsig)}\n")
            cls._groups[pgid] = pdeathsig

    @classmethod
    def forget(cls, pgid: int) -> None:
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


def _spawn(cmd: list[str], log_file: Path, detach: bool = False) -> subprocess.Popen[bytes]:
    """Start a service with its output appended to ``log_file`` (see :func:`spawn`)."""
    with open(log_file, "ab") as log_fh:
        return spawn(cmd, stdout=log_fh, stderr=subprocess.STDOUT, detach=detach)


@dataclass
class ServiceProcess:
    """A started (or external) service: its address and, when we started it, its PID and start time."""

    name: str
    address: str
    pid: int | None = None
    data_dir: str | None = None
    log_file: str | None = None
    external: bool = False
    start_time: int | None = None  # clock ticks after boot (/proc/<pid>/stat field 22)
    boot_id: str | None = None

    @classmethod
    def started(cls, name: str, address: str, pid: int, **kw: Any) -> "ServiceProcess":
        """A record of a process we just started, with its identity."""
        return cls(name, address, pid, start_time=process_start_time(pid), boot_id=boot_id(), **kw)

    def is_running(self) -> bool:
        """Alive, and still the process that was started (not a reused PID)."""
        if self.pid is None or self.external:
            return False
        return same_process(self.pid, self.start_time, self.boot_id, self.data_dir)

    def stop(self, timeout_s: float = 30.0) -> str:
        """SIGTERM, wait, then SIGKILL; removes nothing but the process. Returns what happened: ``stopped``,
        ``not running``, ``external`` or ``refused`` (the PID now belongs to another process: not signalled)."""
        if self.pid is None or self.external:
            return "external"
        if not pid_alive(self.pid):
            _reap(self.pid)
            return "not running"
        if not self.is_running():
            log.warning("not signalled: the pid belongs to another process now (start time differs)",
                        service=self.name, pid=self.pid, recorded_start=self.start_time,
                        current_start=process_start_time(self.pid))
            return "refused"
        stop_pid(self.pid, timeout_s)
        return "stopped"


def noida_binary() -> str:
    """Path of the noida-db executable: the binary inside the package first (the console script is a
    Python wrapper that runs it as a child, and stopping the wrapper by PID would orphan the broker)."""
    try:
        import noida_db  # type: ignore[import-not-found]

        candidate = Path(noida_db.__file__).parent / "noida-db"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("noida-db") or shutil.which("noida-db", path=str(Path(sys.executable).parent))
    if found:
        return found
    raise InfraError("noida-db is not installed: `pip install noida-db` (it is a dependency of rlstream)")


def _wait_for(check, what: str, proc: subprocess.Popen[bytes], log_file: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_file.read_text(errors="replace")[-2000:]
            raise InfraError(f"{what} exited with code {proc.returncode} during start; log {log_file}:\n{tail}")
        if check():
            return
        time.sleep(0.05)
    stop_pid(proc.pid)
    raise InfraError(f"{what} did not answer within {timeout_s:.0f} s; log {log_file}")


def start_kafka(data_dir: Path, port: int | None = None, timeout_s: float = 30.0, detach: bool = False) -> ServiceProcess:
    """Start noida-db speaking the Kafka protocol on ``127.0.0.1:port``."""
    port = port or free_port()
    if port_open(LOOPBACK, port):
        raise InfraError(f"port {port} is taken: choose another with --kafka-port or stop what listens there")
    data_dir.mkdir(parents=True, exist_ok=True)
    log_file = data_dir / "noida-db.log"
    cmd = [noida_binary(), "start", "--only", "kafka", "--kafka-port", str(port), "--data-dir", str(data_dir / "data")]
    proc = _spawn(cmd, log_file, detach)
    _wait_for(lambda: _kafka_answers(port), f"noida-db (port {port})", proc, log_file, timeout_s)
    log.info("kafka broker started", address=f"{LOOPBACK}:{port}", pid=proc.pid, data_dir=str(data_dir))
    return ServiceProcess.started("kafka", f"{LOOPBACK}:{port}", proc.pid, data_dir=str(data_dir), log_file=str(log_file))


def _kafka_answers(port: int) -> bool:
    """True once the broker answers an ApiVersions request (not just accepts TCP)."""
    if not port_open(LOOPBACK, port):
        return False
    request = (
        b"\x00\x12"  # api key 18 ApiVersions
        + b"\x00\x00"  # version 0
        + b"\x00\x00\x00\x01"  # correlation id
        + b"\x00\x05probe"  # client id
    )
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1.0) as sock:
            sock.sendall(len(request).to_bytes(4, "big") + request)
            header = sock.recv(4)
            return len(header) == 4 and int.from_bytes(header, "big") > 0
    except OSError:
        return False


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise InfraError("redis-server is not installed: `apt-get install -y redis-server` (or set RLSTREAM_REDIS_URL)")
    return found


def start_redis(data_dir: Path, port: int | None = None, timeout_s: float = 20.0, detach: bool = False) -> ServiceProcess:
    """Start a throwaway redis-server (no persistence) on ``127.0.0.1:port``."""
    port = port or free_port()
    if port_open(LOOPBACK, port):
        raise InfraError(f"port {port} is taken: choose another with --redis-port or stop what listens there")
    data_dir.mkdir(parents=True, exist_ok=True)
    log_file = data_dir / "redis.log"
    cmd = [redis_binary(), "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
           "--daemonize", "no", "--dir", str(data_dir), "--protected-mode", "yes"]
    proc = _spawn(cmd, log_file, detach)
    _wait_for(lambda: _redis_answers(port), f"redis-server (port {port})", proc, log_file, timeout_s)
    log.info("redis started", address=f"redis://{LOOPBACK}:{port}/0", pid=proc.pid)
    return ServiceProcess.started("redis", f"redis://{LOOPBACK}:{port}/0", proc.pid, data_dir=str(data_dir),
                                  log_file=str(log_file))


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class LocalStack:
    """The broker and Redis that a run uses: started here, or external via environment."""

    kafka: ServiceProcess
    redis: ServiceProcess
    root: str
    extra: dict[str, ServiceProcess] = field(default_factory=dict)
    #: the ``infra up`` daemon that owns the services (None when this process started them)
    supervisor: ServiceProcess | None = None

    @property
    def bootstrap(self) -> str:
        return self.kafka.address

    @property
    def redis_url(self) -> str:
        return self.redis.address

    @classmethod
    def start(cls, root: Path | None = None, kafka_port: int | None = None, redis_port: int | None = None,
              detach: bool = False) -> "LocalStack":
        """Start what the environment does not provide. ``root`` holds data dirs (temp dir by default)."""
        root = Path(root) if root else Path(tempfile.mkdtemp(prefix="rlstream-infra-"))
        root.mkdir(parents=True, exist_ok=True)
        external_kafka = os.environ.get("RLSTREAM_KAFKA_BOOTSTRAP")
        external_redis = os.environ.get("RLSTREAM_REDIS_URL")
        kafka = (ServiceProcess("kafka", external_kafka, external=True) if external_kafka
                 else start_kafka(root / "kafka", kafka_port, detach=detach))
        try:
            redis = (ServiceProcess("redis", external_redis, external=True) if external_redis
                     else start_redis(root / "redis", redis_port, detach=detach))
        except BaseException:
            kafka.stop()
            raise
        return cls(kafka=kafka, redis=redis, root=str(root))

    def services(self) -> list[ServiceProcess]:
        return [self.kafka, self.redis, *self.extra.values()]

    def stop(self, timeout_s: float = 30.0) -> dict[str, str]:
        """Stop the owning daemon (if any), then every service that is still the process that was started;
        returns ``{name: outcome}`` (see :meth:`ServiceProcess.stop`)."""
        outcome: dict[str, str] = {}
        if self.supervisor is not None:
            outcome["supervisor"] = self.supervisor.stop(timeout_s * 2)  # it stops the services itself
        for svc in (*self.extra.values(), self.redis, self.kafka):
            outcome[svc.name] = svc.stop(timeout_s)
        return outcome

    def running(self) -> bool:
        """True when any service of this stack (verified by start time) still runs."""
        return any(svc.is_running() for svc in self.services())

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        from rlstream.schemas.masking import mask_data

        # an external service's address may carry a password: the state file never holds one
        data: dict[str, Any] = mask_data({"kafka": asdict(self.kafka), "redis": asdict(self.redis),
                                          "root": self.root, "extra": {k: asdict(v) for k, v in self.extra.items()}})
        if self.supervisor is not None:
            data["supervisor"] = asdict(self.supervisor)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "LocalStack":
        data = json.loads(Path(path).read_text())
        supervisor = data.get("supervisor")
        return cls(kafka=ServiceProcess(**data["kafka"]), redis=ServiceProcess(**data["redis"]), root=data["root"],
                   extra={k: ServiceProcess(**v) for k, v in data.get("extra", {}).items()},
                   supervisor=ServiceProcess(**supervisor) if supervisor else None)

    def status(self) -> dict[str, dict[str, object]]:
        out = {}
        for svc in self.services():
            alive = svc.is_running() if svc.pid else None
            out[svc.name] = {"address": svc.address, "pid": svc.pid, "alive": alive, "external": svc.external}
        return out


# --- `rlstream infra up`: a supervisor daemon that owns the services -----------------------------------
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


def start_background(state_dir: Path, kafka_port: int | None = None, redis_port: int | None = None,
                     timeout_s: float = 90.0) -> LocalStack:
    """Start the :func:`serve` daemon and return its stack once the services answer. The daemon outlives this
    process (that is what ``infra up`` is for); if this process ends before the hand-over, the services go."""
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", "from rlstream.ops.infra import main; main()", "serve", "--state-dir", str(state_dir)]
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
    """``python -c 'from rlstream.ops.infra import main; main()' serve --state-dir DIR``: the infra daemon."""
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
