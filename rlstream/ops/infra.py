"""The local infrastructure: noida-db (Kafka protocol) and redis-server on free loopback ports.

One launcher for the CLI (``rlstream infra up``) and the tests. Each service runs in its own
process session with a throwaway data directory, is waited on until it answers, and is
stopped by its PID. ``RLSTREAM_KAFKA_BOOTSTRAP`` / ``RLSTREAM_REDIS_URL`` point everything at
external services instead, and then nothing is started for that service.
"""
from __future__ import annotations

import json
import os
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

from rlstream.transport.log import get_logger

log = get_logger(__name__)
LOOPBACK = "127.0.0.1"


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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return True


@dataclass
class ServiceProcess:
    """A started (or external) service: its address and, when we started it, its PID."""

    name: str
    address: str
    pid: int | None = None
    data_dir: str | None = None
    log_file: str | None = None
    external: bool = False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, wait, then SIGKILL; removes nothing but the process."""
        if self.pid is None or self.external:
            return
        stop_pid(self.pid, timeout_s)


def stop_pid(pid: int, timeout_s: float = 30.0) -> None:
    """Stop one process by PID: SIGTERM, then SIGKILL after ``timeout_s``; reaps it when it is our child."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        if not pid_alive(pid):
            break
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:
                pass
            if not pid_alive(pid):
                break
            time.sleep(0.05)
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


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


def _exit_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when the process that started it dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _spawn(cmd: list[str], log_file: Path, detach: bool = False) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session. Unless ``detach``, it dies with its parent (a killed test run
    leaves no broker behind); ``rlstream infra up`` detaches so the services outlive the command.
    Linux ties this to the starting *thread*, so only the main thread attaches; others detach."""
    detach = detach or threading.current_thread() is not threading.main_thread()
    log_fh = open(log_file, "ab")
    try:
        return subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True,
                                preexec_fn=None if detach or not sys.platform.startswith("linux") else _exit_with_parent)
    finally:
        log_fh.close()


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
    return ServiceProcess("kafka", f"{LOOPBACK}:{port}", proc.pid, str(data_dir), str(log_file))


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
    return ServiceProcess("redis", f"redis://{LOOPBACK}:{port}/0", proc.pid, str(data_dir), str(log_file))


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
        except Exception:
            kafka.stop()
            raise
        return cls(kafka=kafka, redis=redis, root=str(root))

    def stop(self) -> None:
        for svc in (*self.extra.values(), self.redis, self.kafka):
            svc.stop()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"kafka": asdict(self.kafka), "redis": asdict(self.redis), "root": self.root,
                "extra": {k: asdict(v) for k, v in self.extra.items()}}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "LocalStack":
        data = json.loads(Path(path).read_text())
        return cls(kafka=ServiceProcess(**data["kafka"]), redis=ServiceProcess(**data["redis"]), root=data["root"],
                   extra={k: ServiceProcess(**v) for k, v in data.get("extra", {}).items()})

    def status(self) -> dict[str, dict[str, object]]:
        out = {}
        for svc in (self.kafka, self.redis, *self.extra.values()):
            alive = pid_alive(svc.pid) if svc.pid else None
            out[svc.name] = {"address": svc.address, "pid": svc.pid, "alive": alive, "external": svc.external}
        return out
