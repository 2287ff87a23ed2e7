"""The Redis users of docs/security.md on a real redis-server: each service's own control-plane writes succeed as its
own user, every user reads, and only the sync workers' user writes a heartbeat that routing takes (a key another
user may write through a pattern of its own that also starts like a heartbeat is not a replica)."""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis
import redis.exceptions
import yaml

from rlstream.schemas.config import InferenceConfig
from rlstream.transport.control import ControlPlane, worker_key
from rlstream.transport.serving import ServingControl

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
POLICY = "p"


def documented_users() -> dict[str, str]:
    """user -> its ACL line, from the block under docs/security.md's "Redis users"."""
    section = (ROOT / "docs" / "security.md").read_text().split("## Redis users", 1)[1]
    block = section.split("```", 2)[1]
    return {line.split()[1]: line for line in block.splitlines() if line.startswith("user ")}


def test_the_compose_files_users_are_the_documented_ones() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    lines = compose["configs"]["redis-acl"]["content"].splitlines()
    users = {line.split()[1]: re.sub(r">\$\{[^}]*\}", ">PASSWORD", line) for line in lines if line.startswith("user ")}
    documented = documented_users()
    assert {"default", "sync", "learner", "streams", "rollout", "admin"} <= set(users)  # the services compose runs
    assert {user: documented.get(user) for user in users} == users


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def urls(tmp_path: Path) -> AsyncIterator[Callable[[str], str]]:
    """A redis-server with the documented users (password ``pw-<user>``); ``user -> redis URL``."""
    users = documented_users()
    acl = tmp_path / "users.acl"
    acl.write_text("".join(line.replace(">PASSWORD", f">pw-{user}") + "\n" for user, line in users.items()))
    port = free_port()
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                               "127.0.0.1", "--save", "", "--appendonly", "no", "--aclfile", str(acl)],
                              stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert server.poll() is None, "redis-server refused the documented ACL"
            try:
                if redis.Redis(port=port).ping():
                    break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)
        yield lambda user: f"redis://{user}:pw-{user}@127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(10)


async def test_each_service_writes_its_own_keys_as_its_own_user(urls: Callable[[str], str]) -> None:
    gateway, gate, sync = (ControlPlane(urls(u), retry_max_s=1.0) for u in ("gateway", "gate", "sync"))
    try:
        # the gateway: its shared per-tenant ids and its sessions' pins
        await gateway.tenant_put(POLICY, "ids", "acme", {"t-1": "x"}, ttl_s=60, capacity=8)
        assert await gateway.tenant_get(POLICY, "ids", "acme", "t-1", ttl_s=60) == "x"
        assert await ServingControl(gateway).pin_session(POLICY, "acme:s", 3, ttl_s=60) == 3
        # the gate: the serving fencing token and the versions it evaluates; the sync worker only reads the holds
        assert await ServingControl(gate).issue_token(POLICY) == 1
        await ServingControl(gate).hold_for_evaluation(POLICY, "eval-0", 7, ttl_s=60, holder="gate")
        await sync.heartbeat_worker(POLICY, "eval-0", 7, "policy@7", ttl_s=60)
        assert await ServingControl(sync).evaluation_holds(POLICY, "eval-0") == {7}
        assert [r.worker_id for r in await ServingControl(gateway).replicas(POLICY)] == ["eval-0"]
        await ServingControl(gate).release_evaluation(POLICY, "eval-0", 7, "gate")
        assert await ServingControl(sync).evaluation_holds(POLICY, "eval-0") == set()
        # control: the same calls refused to the users whose keys they are not
        for service in (gateway, gate):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await service.heartbeat_worker(POLICY, "eval-0", 7, "policy@7", ttl_s=60)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await sync.tenant_put(POLICY, "ids", "acme", {"t-2": "x"}, ttl_s=60, capacity=8)
    finally:
        for service in (gateway, gate, sync):
            await service.close()


def heartbeat_lookalikes(line: str) -> list[str]:
    """Worker ids whose heartbeat key also matches one of the write patterns of ACL ``line``."""
    ids = []
    for token in line.split():
        if token.startswith("~rlstream:*:"):
            tail = token.removeprefix("~rlstream:*:").replace("*", "x")
            ids += [tail, f"w0:{tail}"]
    return ids


async def test_no_other_user_plants_a_heartbeat_through_its_own_patterns(urls: Callable[[str], str]) -> None:
    users = documented_users()
    planted: dict[str, list[str]] = {}
    for user in sorted(set(users) - {"sync", "admin", "default"}):
        client = redis.Redis.from_url(urls(user))
        for worker_id in heartbeat_lookalikes(users[user]):
            try:
                client.hset(worker_key(POLICY, worker_id), mapping={
                    "version": 1, "name": "policy", "heartbeat_at": time.time(), "url": "http://attacker:8000"})
            except redis.exceptions.NoPermissionError:
                continue
            planted.setdefault(user, []).append(worker_id)
    assert {"gateway", "gate", "streams", "rollout", "learner"} <= set(planted), planted  # Redis took them
    reader = ControlPlane(urls("gateway"), retry_max_s=1.0)
    sync = ControlPlane(urls("sync"), retry_max_s=1.0)
    try:
        assert await ServingControl(reader).replicas(POLICY) == []
        # control: the sync worker's own heartbeat is a replica
        await sync.heartbeat_worker(POLICY, "w0", 1, "policy", ttl_s=60)
        assert [r.worker_id for r in await ServingControl(reader).replicas(POLICY)] == ["w0"]
    finally:
        await reader.close()
        await sync.close()


@pytest.mark.parametrize("worker_id", ["w0:status", "status", "latest", "a:session:b", ":x", ""])
def test_a_sync_worker_id_another_user_could_write_is_refused(worker_id: str) -> None:
    with pytest.raises(ValueError, match="worker_id"):
        InferenceConfig(worker_id=worker_id)
    assert InferenceConfig(worker_id="eval-0.replica_1").worker_id == "eval-0.replica_1"  # control
