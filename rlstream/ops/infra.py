"""The local infrastructure: noida-db (Kafka protocol) and redis-server on free loopback ports.

One launcher for the CLI (``rlstream infra up``, whose owning daemon is ``rlstream/ops/infra_daemon.py``) and the
tests. Each service runs in its own process session with a throwaway data directory (started through
:func:`rlstream.ops.children.spawn`, so it dies with its parent unless detached), is waited on until it answers,
and is stopped by its PID. ``RLSTREAM_KAFKA_BOOTSTRAP`` / ``RLSTREAM_REDIS_URL`` point everything at external
services instead, and then nothing is started for that service.

The state file records each PID with its start time and the boot id (:mod:`rlstream.ops.processes`), and
``infra down`` signals a PID only when both still match, so a PID reused by another process is never signalled.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlstream.ops.children import spawn
from rlstream.ops.ports import LOOPBACK, free_port, port_open
from rlstream.ops.processes import boot_id, pid_alive, process_start_time, reap, same_process, stop_pid
from rlstream.transport.log import get_logger

log = get_logger(__name__)
STATE_FILE = "infra.json"


class InfraError(RuntimeError):
    """A local service could not be started or reached."""


def _spawn(cmd: list[str], log_file: Path, detach: bool = False) -> subprocess.Popen[bytes]:
    """Start a service with its output appended to ``log_file`` (see :func:`rlstream.ops.children.spawn`)."""
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
    start_time: float | None = None  # psutil's create_time (rlstream.ops.processes)
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
            reap(self.pid)
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


def _wait_for(check: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], log_file: Path,
              timeout_s: float) -> None:
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
