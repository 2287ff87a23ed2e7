"""A session's calls stitched in the stream app keep the tool schemas their requests offered: the gateway puts them on
each ``calls`` record (real broker), so the stitched trajectory and the export's ``tools`` column have them."""
from __future__ import annotations

import json

import httpx
import pytest

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import CallEvent, CallKind
from rlstream.schemas.topics import TopicNames
from tests.support.learner_helpers import read_whole_topic

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "function": {"name": "weather", "description": "today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def upstream(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={
        "id": "c", "model": "m", "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "sunny"}, "finish_reason": "stop",
                     "token_ids": [3], "logprobs": {"content": [{"token": "x", "logprob": -0.5}]}}]})


async def test_calls_records_carry_the_requests_tool_schemas(rl_config: RlstreamConfig,
                                                            created_topics: TopicNames) -> None:
    config = GatewaySettings.resolve(rl_config).model_copy(update={
        "policy": "m", "served_model": "m", "spool_dir": None, "session_stitching": "streams"})
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards,
                                                calls_topic=created_topics.calls)
    await publisher.start()
    gateway = Gateway(config, publisher, client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            for session, tools in (("with-tools", [WEATHER]), ("without", None)):
                body = {"model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}]}
                if tools:
                    body["tools"] = tools
                answer = await c.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
                assert answer.status_code == 200, answer.text
    finally:
        await gateway.stop()
        await publisher.close()
    calls = [e for e in await read_whole_topic(rl_config, created_topics.calls, CallEvent) if e.kind == CallKind.call]
    by_session = {e.session_id.rsplit(":", 1)[-1]: e for e in calls}
    assert json.loads(by_session["with-tools"].tools) == [WEATHER]
    assert by_session["without"].tools is None
