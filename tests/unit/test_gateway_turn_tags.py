"""Gateway: each captured turn carries the policy version its call was routed to and the sampling temperature of its
request, so a session that straddles a reload is judged turn by turn."""
from __future__ import annotations

import json
from typing import Any

import httpx

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.sessions import recorded_call
from rlstream.schemas.models import TrajectoryEvent
from tests.unit.test_gateway_sessions import USER, FakePublisher


def session_upstream(request: httpx.Request) -> httpx.Response:
    """Two calls of one session: the second prompt extends the first prompt and completion token for token; the
    second call is streamed."""
    body = json.loads(request.content)
    if not body.get("stream"):
        return httpx.Response(200, json={
            "model": body["model"], "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop",
                         "token_ids": [3], "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}}]})
    chunks: list[dict[str, Any]] = [
        {"prompt_token_ids": [1, 2, 3, 4], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [5],
                      "logprobs": {"content": [{"token": "b", "logprob": -0.25}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


async def test_a_session_that_straddles_a_reload_is_tagged_turn_by_turn() -> None:
    served = iter([("p-v3", 3), ("p-v4", 4)])  # the router moves to version 4 between the two calls

    async def route() -> tuple[str, int]:
        return next(served)

    publisher = FakePublisher()
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="p"), publisher, route=route,
                      client=httpx.AsyncClient(transport=httpx.MockTransport(session_upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            first = await c.post("/s/sess/v1/chat/completions",
                                 json={"model": "p", "messages": [USER], "temperature": 0.7})
            assert first.status_code == 200 and first.headers["x-rlstream-policy-version"] == "3"
            messages = [USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
            second = await c.post("/s/sess/v1/chat/completions",
                                  json={"model": "p", "messages": messages, "stream": True})
            assert second.status_code == 200 and second.headers["x-rlstream-policy-version"] == "4"
            assert (await c.post("/v1/sessions/sess/end")).json()["published"] is True
    finally:
        await gateway.stop()
    (traj,) = [e for _, e in publisher.sent if isinstance(e, TrajectoryEvent)]
    assert traj.policy_version == 3  # the session's first call
    assert [(t.policy_version, t.temperature) for t in traj.turns] == [(3, 0.7), (4, 1.0)]
    assert [t.completion_token_ids for t in traj.turns] == [[3], [5]]


def test_recorded_call_temperature_defaults_to_one() -> None:
    def temperature(request: dict[str, Any]) -> float | None:
        return recorded_call({"model": "m", "messages": [USER], **request}, {"role": "assistant", "content": "x"},
                             [1], [2], [-0.1], "stop", "m").turn.temperature

    assert temperature({}) == 1.0 and temperature({"temperature": None}) == 1.0
    assert temperature({"temperature": "hot"}) == 1.0  # not a number: the upstream's default applied
    assert temperature({"temperature": 0.3}) == 0.3 and temperature({"temperature": 0}) == 0.0
