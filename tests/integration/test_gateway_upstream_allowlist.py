"""A forged worker heartbeat in Redis (whoever can write Redis can forge one) pointing the gateway at a listener of
the forger's: with the upstream allowlist (by default the configured upstream's host) the listener receives
nothing, the heartbeat is ignored and counted, and every call goes to the real replica; the control, the allowlist
off ('*'), shows the listener receiving the clients' messages with the upstream key."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import httpx
import pytest

from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.rollout.routing import FleetRouter
from rlstream.schemas.config import RlstreamConfig
from rlstream.transport.control import ControlPlane
from rlstream.transport.serving import ReplicaAck, ServingControl
from tests.integration.test_gateway_replicas import Discard
from tests.support.fleet_support import canned_replica

UPSTREAM_KEY = "upstream-key-do-not-leak-0123"


@contextlib.asynccontextmanager
async def listener(host: str) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A server on ``host`` answering like a replica and recording each request's authorization and body."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[dict[str, Any]] = []

    async def chat(request: Request) -> JSONResponse:
        seen.append({"authorization": request.headers.get("authorization"), "body": await request.json()})
        return JSONResponse({"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "p-v2",
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                          "finish_reason": "stop"}]})

    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]),
                                           host=host, port=0, log_level="warning", access_log=False, lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "listener did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"http://{host}:{server.servers[0].sockets[0].getsockname()[1]}", seen
    finally:
        server.should_exit = True
        await task


async def _calls_with_a_forged_heartbeat(rl_config: RlstreamConfig, allowlist: list[str]) -> tuple[
        list[dict[str, Any]], int, Gateway]:
    policy = rl_config.policy
    control = ControlPlane(str(rl_config.redis.url))
    serving_control = ServingControl(control)
    try:
        async with canned_replica() as real, listener("127.0.0.2") as (forged_url, seen):
            await serving_control.record_replica(policy, ReplicaAck("real", 2, "p-v2", url=real.url,
                                                                    loaded={2: "p-v2"}), 60)
            await serving_control.record_replica(policy, ReplicaAck("forged", 2, "p-v2", url=forged_url,
                                                                    loaded={2: "p-v2"}), 60)
            await serving_control.promote(policy, 2, token=await serving_control.issue_token(policy), reason="t",
                                          decided_by="test")
            gateway = Gateway(GatewaySettings(session_stitching="gateway", port=0, policy=policy, served_model="base",
                                              run_id=rl_config.run_id, upstream_url="http://127.0.0.1:8000",
                                              upstream_api_key=UPSTREAM_KEY, upstream_allowlist=allowlist),
                              Discard(), fleet=FleetRouter(control, policy, "base", ttl_s=0.2))
            async with serving(gateway) as url, httpx.AsyncClient(timeout=30) as http:
                for i in range(8):
                    answer = await http.post(f"{url}/v1/chat/completions", json={
                        "model": policy, "messages": [{"role": "user", "content": f"secret conversation {i}"}]})
                    assert answer.status_code == 200, answer.text
                stats = (await http.get(f"{url}/rlstream/stats")).json()
                assert stats["upstreams_refused"] == gateway.upstreams.refused
            return list(seen), len(real.requests), gateway
    finally:
        await control.close()


@pytest.mark.integration
async def test_a_forged_heartbeat_outside_the_allowlist_receives_nothing(rl_config: RlstreamConfig) -> None:
    seen, real_calls, gateway = await _calls_with_a_forged_heartbeat(rl_config, [])
    assert seen == [] and real_calls == 8
    assert gateway.upstreams.refused >= 1


@pytest.mark.integration
async def test_control_with_the_allowlist_off_the_forged_listener_gets_messages_and_the_key(
        rl_config: RlstreamConfig) -> None:
    seen, real_calls, _ = await _calls_with_a_forged_heartbeat(rl_config, ["*"])
    assert seen and real_calls < 8
    assert seen[0]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert "secret conversation" in str(seen[0]["body"]["messages"])
