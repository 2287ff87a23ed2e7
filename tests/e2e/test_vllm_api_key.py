"""A real vLLM server started with an API key (``start_vllm_server(api_key=...)``, as ``rlstream inference serve
--api-key`` and ``rlstream up`` start it): its /v1 routes, the LoRA admin ones included, refuse a call without the key;
the sync worker (real broker and Redis) loads a LoRA version through them with the key, and the gateway captures a
call with it. The controls without the key fail with 401. The server is this module's own (the shared one has no key,
since the other vLLM tests call it without one); it is stopped at the end of the module."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from rlstream.inference.sync import InferenceSyncWorker, adapter_name
from rlstream.inference.vllm_backend import BackendError, VllmBackend
from rlstream.ops.vllm import VllmServer, start_vllm_server
from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent, WeightsKind
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from tests.e2e.vllm_support import SERVED_MODEL, make_lora_version, policy_version, tiny_model_dir, wait_until
from tests.support.learner_helpers import read_topic
from tests.support.version_helpers import announce_versions

KEY = "vllm-test-key-5b1e"
MESSAGES = [{"role": "user", "content": "Say b."}]


@pytest.fixture(scope="module")
def keyed_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = start_vllm_server(tiny_model_dir(tmp_path_factory), SERVED_MODEL,
                               workdir=tmp_path_factory.mktemp("keyed-vllm"), api_key=KEY)
    try:
        yield server
    finally:
        server.stop()


def test_vllm_with_a_key_refuses_calls_without_it(keyed_vllm: VllmServer, tmp_path: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    url = keyed_vllm.url
    assert httpx.get(f"{url}/health").status_code == 200  # liveness stays open
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    adapter = make_lora_version(tiny_model_dir(tmp_path_factory), tmp_path / "adapter")

    async def admin() -> None:
        without = VllmBackend(url)
        with pytest.raises(BackendError, match="401"):
            await without.load_lora("nokey", adapter)
        await without.close()
        keyed = VllmBackend(url, api_key=KEY)
        await keyed.load_lora("withkey", adapter)
        assert "withkey" in await keyed.models()
        await keyed.unload_lora("withkey")
        await keyed.close()
    asyncio.run(admin())


def test_sync_worker_loads_a_version_into_a_keyed_vllm(keyed_vllm: VllmServer, rl_config: RlstreamConfig,
                                                       created_topics: TopicNames, tmp_path: Path,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    base_dir = tiny_model_dir(tmp_path_factory)
    cfg = rl_config.model_copy(deep=True)
    cfg.inference = cfg.inference.model_validate({
        **cfg.inference.model_dump(), "url": keyed_vllm.url, "api_key": KEY, "worker_id": "w-key",
        "weights_roots": [str(tmp_path)], "served_model": SERVED_MODEL, "load_retries": 0})
    lora_dir = make_lora_version(base_dir, tmp_path / "v1-lora")

    async def scenario() -> None:
        control = ControlPlane(cfg.redis.url)
        lease = await control.acquire_lease(cfg.policy, "key-learner", ttl_s=600)
        assert lease is not None
        assert cfg.inference.api_key is not None
        backend = VllmBackend(cfg.inference.url, api_key=cfg.inference.api_key.get_secret_value())
        stop = asyncio.Event()
        task = asyncio.create_task(InferenceSyncWorker(cfg, backend, control).run(stop))
        try:
            await announce_versions(cfg, [policy_version(cfg.policy, 1, WeightsKind.lora, lora_dir, base_dir)],
                                    lease=lease)

            async def loaded() -> Any:
                info = (await control.workers(cfg.policy)).get("w-key")
                return info if info and int(info["version"]) == 1 else None
            info = await wait_until(loaded, 90, "version 1 loaded")
            assert info["name"] == adapter_name(cfg.policy, 1) and info["name"] in await backend.models()
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await backend.close()
            await control.close()
    asyncio.run(scenario())


async def test_gateway_sends_the_upstream_key(keyed_vllm: VllmServer, rl_config: RlstreamConfig,
                                              created_topics: TopicNames) -> None:
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    request = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    try:
        for key, want in ((None, 401), (KEY, 200)):  # the control first: without the key vLLM refuses
            gateway = Gateway(GatewaySettings(session_stitching="gateway",
                                              upstream_url=keyed_vllm.url, upstream_api_key=key,
                                            run_id=rl_config.run_id), publisher)
            await gateway.start()
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)),
                                             base_url="http://gw", timeout=60) as c:
                    r = await c.post("/v1/chat/completions", json=request)
                    assert r.status_code == want, r.text
                    if want == 200:
                        tid = r.headers["x-rlstream-trajectory-id"]
            finally:
                await gateway.stop()
    finally:
        await publisher.close()
    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=1)
    assert [e.trajectory_id for e in events] == [tid] and events[0].turns[0].completion_token_ids
