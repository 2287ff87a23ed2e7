"""Gateway: the session token-prefix rule, field filtering, stream reassembly, feedback validation."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from rlstream.rollout.gateway.app import Gateway, _StreamAccumulator, create_app
from rlstream.rollout.gateway.config import GatewayConfig
from rlstream.rollout.gateway.filtering import client_asked, filter_response, upstream_request
from rlstream.rollout.gateway.sessions import SessionStore, extends, recorded_call
from rlstream.schemas.models import Message, RewardEvent, TrajectoryEvent, TrajectorySource

USER = {"role": "user", "content": "hi"}
REPLY = {"role": "assistant", "content": "hello"}


def call(prompt: list[int] | None, completion: list[int] | None, messages: list[dict[str, Any]] | None = None):
    return recorded_call({"model": "m", "messages": messages or [USER]}, REPLY, prompt, completion,
                         [-0.5] * len(completion or []), "stop", "m")


def test_prompt_extending_previous_prompt_and_completion_joins() -> None:
    prev = call([1, 2, 3], [4, 5])
    assert extends(prev, [1, 2, 3, 4, 5, 9, 10], [])
    assert not extends(prev, [1, 2, 3, 4, 6, 9], [])          # re-tokenized reply differs
    assert not extends(prev, [1, 2, 3, 4, 5], [])             # no new tokens
    assert not extends(prev, [7, 2, 3, 4, 5, 9], [])


def test_without_token_ids_messages_decide() -> None:
    prev = call(None, None)
    more = [Message(role="user", content="hi"), Message(role="assistant", content="hello"),
            Message(role="user", content="again")]
    assert extends(prev, None, more)
    assert not extends(prev, None, [Message(role="user", content="other"), *more[1:]])


def test_session_store_joins_then_splits_and_idles() -> None:
    store = SessionStore(idle_s=10)
    t1, closed = store.begin("s", [1, 2], [], 3)
    assert closed is None
    t1.add(call([1, 2], [3]))
    t2, closed = store.begin("s", [1, 2, 3, 4], [], 3)
    assert t2 is t1 and closed is None
    t2.add(call([1, 2, 3, 4], [5]))
    t3, closed = store.begin("s", [9, 9], [], 4)
    assert t3 is not t1 and closed is t1 and t1.closed
    event = t1.to_event(run_id="r", policy="p", producer_id="g")
    assert event.trajectory_id == t1.trajectory_id and event.source == TrajectorySource.production
    assert event.group_size == 1 and len(event.turns) == 2 and event.policy_version == 3
    assert event.metadata["session_id"] == "s"
    t3.add(call([9, 9], [1]))
    assert store.lookup(session_id="s").trajectory_id == t3.trajectory_id
    assert store.lookup(trajectory_id=t1.trajectory_id) is not None
    assert store.idle(now=t3.last_active + 11) == [t3] and not store.open


def test_filtering_removes_only_what_the_gateway_added() -> None:
    body = {"model": "m", "messages": [USER]}
    sent = upstream_request(body)
    assert sent["logprobs"] is True and sent["return_token_ids"] is True and "logprobs" not in body
    payload = {"prompt_token_ids": [1], "choices": [{"index": 0, "logprobs": {"content": []}, "token_ids": [2]}]}
    plain = filter_response(payload, client_asked(body))
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["token_ids"] is None and payload["choices"][0]["token_ids"] == [2]
    asked = filter_response(payload, client_asked({**body, "logprobs": True}))
    assert asked["choices"][0]["logprobs"] == {"content": []} and asked["choices"][0]["token_ids"] is None
    assert upstream_request(body, request_token_data=False) == body


def test_stream_accumulator_rebuilds_text_tokens_logprobs_and_tool_calls() -> None:
    acc = _StreamAccumulator(None)
    acc.add({"prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    acc.add({"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [5],
                          "logprobs": {"content": [{"logprob": -1.0}]}}]})
    acc.add({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f",
                                                                                                     "arguments": "{"}}]},
                          "token_ids": [6], "logprobs": {"content": [{"logprob": -2.0}]}, "finish_reason": "stop"}]})
    assert acc.prompt_ids == [1, 2] and acc.completion_ids() == [5, 6] and acc.logprobs() == [-1.0, -2.0]
    msg = acc.message()
    assert msg["content"] == "a" and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": "{"}
    assert acc.finish_reason == "stop"


class FakePublisher:
    trajectories_topic, rewards_topic = "traj", "rew"

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    async def submit(self, topic: str, key: str, event: Any) -> "asyncio.Future[Any]":
        self.sent.append((topic, event))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def fake_upstream(request: httpx.Request) -> httpx.Response:
    if request.url.path.endswith("/models"):
        return httpx.Response(200, json={"data": [{"id": "m"}]})
    body = json.loads(request.content)
    assert body["logprobs"] is True and body["return_token_ids"] is True
    return httpx.Response(200, json={
        "model": "m", "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                     "token_ids": [3], "logprobs": {"content": [{"token": "ok", "logprob": -0.25}]}}]})


async def test_app_captures_filters_and_takes_feedback() -> None:
    publisher = FakePublisher()
    gateway = Gateway(GatewayConfig(policy="p", policy_version=7), publisher,
                      client=httpx.AsyncClient(transport=httpx.MockTransport(fake_upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER]})
            assert r.status_code == 200 and r.headers["x-rlstream-policy-version"] == "7"
            assert r.json()["choices"][0]["logprobs"] is None and r.json()["prompt_token_ids"] is None
            tid = r.headers["x-rlstream-trajectory-id"]
            assert (await c.get("/v1/models")).json()["data"][0]["id"] == "m"
            assert (await c.post("/v1/feedback", content=b"{nope")).status_code == 400
            bad = await c.post("/v1/feedback", json={"trajectory_id": tid, "reward": "high"})
            assert bad.status_code == 422 and "reward" in bad.json()["error"]["message"]
            assert (await c.post("/v1/feedback", json={"reward": 1.0})).status_code == 422
            assert (await c.post("/v1/feedback", json={"trajectory_id": "nope", "reward": 1.0})).status_code == 404
            ok = await c.post("/v1/feedback", json={"trajectory_id": tid, "reward": 1.0, "components": {"a": 1.0}})
            assert ok.status_code == 202
            s = await c.post("/s/sess/v1/chat/completions", json={"model": "m", "messages": [USER]})
            assert s.headers["x-rlstream-session-id"] == "sess"
            assert (await c.post("/v1/sessions/sess/end")).json()["published"] is True
            assert (await c.post("/v1/sessions/other/end")).status_code == 404
    finally:
        await gateway.stop()
    events = [e for _, e in publisher.sent]
    trajs = [e for e in events if isinstance(e, TrajectoryEvent)]
    rewards = [e for e in events if isinstance(e, RewardEvent)]
    assert len(trajs) == 2 and trajs[0].trajectory_id == tid and trajs[0].policy == "p"
    assert trajs[0].turns[0].completion_token_ids == [3] and trajs[0].turns[0].completion_logprobs == [-0.25]
    assert [m.role for m in trajs[0].messages] == ["user", "assistant"] and trajs[0].turns[0].message_index == 1
    assert rewards[0].trajectory_id == tid and rewards[0].components == {"a": 1.0}


async def test_upstream_down_is_502_with_openai_error() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    gateway = Gateway(GatewayConfig(), FakePublisher(), client=httpx.AsyncClient(transport=httpx.MockTransport(down)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER]})
            assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    finally:
        await gateway.stop()


async def test_full_queue_drops_without_failing_the_response() -> None:
    class Stuck(FakePublisher):
        async def submit(self, topic: str, key: str, event: Any) -> Any:
            await asyncio.sleep(3600)

    gateway = Gateway(GatewayConfig(queue_size=1, drain_timeout_s=0.1), Stuck(),
                      client=httpx.AsyncClient(transport=httpx.MockTransport(fake_upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            for _ in range(4):
                r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER]})
                assert r.status_code == 200
    finally:
        await gateway.stop()
    assert gateway.capture.stats.dropped_full >= 2
