"""Gateway: the session token-prefix rule, field filtering, stream reassembly, feedback validation."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from rlstream.gateway.app import Gateway, create_app
from rlstream.rollout.streaming import StreamAccumulator
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.filtering import client_asked, filter_response, upstream_request
from rlstream.gateway.sessions import MESSAGES, TOKENS, SessionStore, continuation, extends, recorded_call
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


def test_a_tool_call_re_rendered_into_other_tokens_continues_by_messages_and_is_counted() -> None:
    """The model generated a bare tool call under a grammar; the chat template writes it back as <tool_call>...: the
    next prompt is no token prefix, but its messages continue the conversation."""
    tool_reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "pick_letter", "arguments": '{"letter": "c"}'}}]}
    first = recorded_call({"model": "m", "messages": [USER]}, tool_reply, [1, 2], [7, 8], None, "tool_calls", "m")
    echoed = [Message(role="user", content="hi"),
              Message.model_validate({"role": "assistant", "content": None, "tool_calls": [
                  {"id": "c1", "name": "pick_letter", "arguments": '{"letter": "c"}'}]}),
              Message(role="tool", content="ccc", tool_call_id="c1")]
    rendered = [1, 2, 30, 31, 8, 32, 40]  # the template's <tool_call> tokens, not 7, 8
    assert continuation(first, rendered, echoed) == MESSAGES
    assert continuation(first, [1, 2, 7, 8, 40], echoed) == TOKENS
    rewritten = [Message(role="user", content="something else"), *echoed[1:]]
    assert continuation(first, rendered, rewritten) is None
    store = SessionStore(idle_s=10)
    traj, _ = store.begin("s", [1, 2], [Message(role="user", content="hi")], 0)
    traj.add(first)
    again, closed = store.begin("s", rendered, echoed, 0)
    assert again is traj and closed is None and (store.retokenized, store.splits) == (1, 0)
    other, closed = store.begin("s", rendered, rewritten, 0)
    assert other is not traj and closed is traj and (store.retokenized, store.splits) == (1, 1)


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
    assert store.splits == 1  # the split is counted (GET /rlstream/stats: session_splits)
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
    acc = StreamAccumulator(None)
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
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="p", policy_version=7), publisher,
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

    gateway = Gateway(GatewaySettings(session_stitching="gateway"), FakePublisher(),
                      client=httpx.AsyncClient(transport=httpx.MockTransport(down)))
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

    gateway = Gateway(GatewaySettings(session_stitching="gateway", queue_size=1, drain_timeout_s=0.1), Stuck(),
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


def upstream_with_choices(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    n = int(body.get("n", 1))
    return httpx.Response(200, json={
        "model": "m", "prompt_token_ids": [1, 2],
        "choices": [{"index": i, "message": {"role": "assistant", "content": f"answer {i}"}, "finish_reason": "stop",
                     "token_ids": [10 + i, 20 + i],
                     "logprobs": {"content": [{"token": "a", "logprob": -0.1 * (i + 1)},
                                              {"token": "b", "logprob": -0.2}]}} for i in range(n)]})


async def test_n_choices_become_one_group_of_n_trajectories() -> None:
    publisher = FakePublisher()
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="p"), publisher,
                      client=httpx.AsyncClient(transport=httpx.MockTransport(upstream_with_choices)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER], "n": 3},
                             headers={"X-Rlstream-Task": "qa"})
            assert r.status_code == 200 and len(r.json()["choices"]) == 3
            ids = r.headers["x-rlstream-trajectory-ids"].split(",")
            assert len(ids) == 3 and r.headers["x-rlstream-trajectory-id"] == ids[0]
            for tid, reward in zip(ids, (0.0, 0.5, 1.0)):  # each choice is rewarded on its own
                assert (await c.post("/v1/feedback", json={"trajectory_id": tid, "reward": reward})).status_code == 202
    finally:
        await gateway.stop()
    trajs = [e for _, e in publisher.sent if isinstance(e, TrajectoryEvent)]
    rewards = [e for _, e in publisher.sent if isinstance(e, RewardEvent)]
    assert [t.trajectory_id for t in trajs] == ids
    assert {t.group_id for t in trajs} == {r.headers["x-rlstream-group-id"]} and {t.group_size for t in trajs} == {3}
    assert [t.generation_index for t in trajs] == [0, 1, 2] and {t.example_id for t in trajs} == {"qa"}
    assert [t.messages[-1].content for t in trajs] == ["answer 0", "answer 1", "answer 2"]
    assert [t.turns[0].completion_token_ids for t in trajs] == [[10, 20], [11, 21], [12, 22]]
    assert trajs[2].turns[0].completion_logprobs == pytest.approx([-0.3, -0.2])
    assert all(t.turns[0].prompt_token_ids == [1, 2] for t in trajs)
    assert {(r.trajectory_id, r.group_id) for r in rewards} == {(t.trajectory_id, t.group_id) for t in trajs}


def streamed_choices_upstream(request: httpx.Request) -> httpx.Response:
    """A streamed ``n``-choice answer as vLLM sends it: the choices' chunks interleaved, token ids and logprobs
    per chunk, ``prompt_token_ids`` in the first chunk."""
    n = int(json.loads(request.content)["n"])
    chunks: list[dict[str, Any]] = [{"prompt_token_ids": [1, 2], "choices": [
        {"index": i, "delta": {"role": "assistant", "content": ""}} for i in range(n)]}]
    for step in range(2):
        for i in reversed(range(n)):  # not in index order: each chunk must go to its own choice
            chunks.append({"choices": [{"index": i, "delta": {"content": f"{'ab'[step]}{i}"},
                                        "token_ids": [10 * (i + 1) + step],
                                        "logprobs": {"content": [{"token": "t", "logprob": -0.1 * (i + 1)}]}}]})
    chunks.append({"choices": [{"index": i, "delta": {}, "finish_reason": "stop"} for i in range(n)]})
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


async def test_streamed_n_choices_become_one_group_of_n_trajectories() -> None:
    publisher = FakePublisher()
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="p"), publisher,
                      client=httpx.AsyncClient(transport=httpx.MockTransport(streamed_choices_upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER], "n": 3, "stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            assert 'token_ids":[' not in r.text and '"logprob":' not in r.text  # the client did not ask for them
            ids = r.headers["x-rlstream-trajectory-ids"].split(",")
    finally:
        await gateway.stop()
    trajs = [e for _, e in publisher.sent if isinstance(e, TrajectoryEvent)]
    assert sorted(t.trajectory_id for t in trajs) == sorted(ids) and len(ids) == 3
    by_index = {t.generation_index: t for t in trajs}
    assert {t.group_id for t in trajs} == {r.headers["x-rlstream-group-id"]} and {t.group_size for t in trajs} == {3}
    assert [by_index[i].messages[-1].content for i in range(3)] == ["a0b0", "a1b1", "a2b2"]
    assert [by_index[i].turns[0].completion_token_ids for i in range(3)] == [[10, 11], [20, 21], [30, 31]]
    assert by_index[2].turns[0].completion_logprobs == pytest.approx([-0.3, -0.3])
    assert all(t.turns[0].prompt_token_ids == [1, 2] for t in trajs)


def completion_choices_upstream(request: httpx.Request) -> httpx.Response:
    """A Completions answer as vLLM writes it: choice ``i * n + j`` is sample ``j`` of prompt ``i``, each choice with its
    prompt's token ids; streamed, the choices' chunks interleaved and out of order, prompt ids in each first chunk;
    ``extra``: that many choices more than asked (a malformed answer)."""
    body = json.loads(request.content)
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    n, count = int(body.get("n", 1)), len(prompts) * int(body.get("n", 1)) + int(body.get("extra", 0))
    prompt_ids = [[1, 2 + (k // n)] for k in range(count)]
    if not body.get("stream"):
        return httpx.Response(200, json={"id": "cmpl-1", "model": body["model"], "choices": [
            {"index": k, "text": f"t{k}", "prompt_token_ids": prompt_ids[k], "token_ids": [10 + k, 20 + k],
             "logprobs": {"token_logprobs": [-0.1 * (k + 1), -0.2]}, "finish_reason": "stop"}
            for k in reversed(range(count))]})  # not in index order
    chunks: list[dict[str, Any]] = []
    for step in range(2):
        for k in reversed(range(count)):
            choice: dict[str, Any] = {"index": k, "text": f"{'ab'[step]}{k}", "token_ids": [10 * (k + 1) + step],
                                      "logprobs": {"token_logprobs": [-0.1 * (k + 1)]},
                                      "finish_reason": "length" if step else None}
            if step == 0:
                choice["prompt_token_ids"] = prompt_ids[k]
            chunks.append({"id": "cmpl-2", "model": body["model"], "choices": [choice]})
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


async def completions_captured(request: dict[str, Any],
                               headers: dict[str, str] | None = None) -> tuple[httpx.Response, list[TrajectoryEvent]]:
    """The answer to one Completions ``request`` through a gateway, and the trajectories it published."""
    publisher = FakePublisher()
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="p"), publisher,
                      client=httpx.AsyncClient(transport=httpx.MockTransport(completion_choices_upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            r = await c.post("/v1/completions", json=request, headers=headers or {})
            assert r.status_code == 200, r.text
            if headers:
                await c.post(f"/v1/sessions/{headers['X-Session-Id']}/end")
            for tid in r.headers["x-rlstream-trajectory-ids"].split(",") if not headers else []:
                assert (await c.post("/v1/feedback", json={"trajectory_id": tid, "reward": 1.0})).status_code == 202
    finally:
        await gateway.stop()
    return r, [e for _, e in publisher.sent if isinstance(e, TrajectoryEvent)]


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_choices_of_each_prompt_become_one_group(stream: bool) -> None:
    r, trajs = await completions_captured({"model": "m", "prompt": ["first", "second"], "n": 2, "stream": stream})
    ids = r.headers["x-rlstream-trajectory-ids"].split(",")
    assert len(ids) == 4 and sorted(t.trajectory_id for t in trajs) == sorted(ids)  # every choice, once
    by_id = {t.trajectory_id: t for t in trajs}
    groups = r.headers["x-rlstream-group-ids"].split(",")
    assert len(set(groups)) == 2 and r.headers["x-rlstream-group-id"] == groups[0]
    for k, tid in enumerate(ids):  # choice k: sample k % 2 of prompt k // 2
        traj = by_id[tid]
        assert (traj.group_id, traj.group_size, traj.generation_index) == (groups[k // 2], 2, k % 2)
        assert traj.messages[0].content == ["first", "second"][k // 2]
        assert traj.turns[0].prompt_token_ids == [1, 2 + k // 2]
        if stream:
            assert traj.messages[-1].content == f"a{k}b{k}"
            assert traj.turns[0].completion_token_ids == [10 * (k + 1), 10 * (k + 1) + 1]
            assert traj.turns[0].completion_logprobs == pytest.approx([-0.1 * (k + 1)] * 2)
        else:
            assert traj.messages[-1].content == f"t{k}"
            assert traj.turns[0].completion_token_ids == [10 + k, 20 + k]
            assert traj.turns[0].completion_logprobs == pytest.approx([-0.1 * (k + 1), -0.2])


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_prompts_asked_once_are_trajectories_of_their_own(stream: bool) -> None:
    r, trajs = await completions_captured({"model": "m", "prompt": ["first", "second", "third"], "stream": stream})
    ids = r.headers["x-rlstream-trajectory-ids"].split(",")
    assert len(ids) == 3 and "x-rlstream-group-id" not in r.headers
    by_id = {t.trajectory_id: t for t in trajs}
    assert [by_id[tid].messages[0].content for tid in ids] == ["first", "second", "third"]
    assert {t.group_size for t in trajs} == {1}


async def test_completion_choices_inside_a_session_keep_the_first() -> None:
    r, trajs = await completions_captured({"model": "m", "prompt": "first", "n": 3},
                                          headers={"X-Session-Id": "s1"})
    (traj,) = trajs
    assert traj.trajectory_id == r.headers["x-rlstream-trajectory-id"] and traj.messages[-1].content == "t0"


async def test_completion_choices_not_n_per_prompt_are_each_captured_alone() -> None:
    r, trajs = await completions_captured({"model": "m", "prompt": "first", "n": 2, "extra": 1})
    ids = r.headers["x-rlstream-trajectory-ids"].split(",")
    assert len(ids) == 3 and sorted(t.trajectory_id for t in trajs) == sorted(ids)
    assert {t.group_size for t in trajs} == {1}
    assert [{t.trajectory_id: t for t in trajs}[tid].messages[-1].content for tid in ids] == ["t0", "t1", "t2"]


def responses_upstream(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    if body["model"] == "no-api":
        return httpx.Response(404, json={"detail": "Not Found"})
    return httpx.Response(200, json={
        "id": "resp_1", "object": "response", "model": body["model"], "status": "completed",
        "output": [{"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "x"}'},
                   {"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": "the answer"}]}]})


async def test_responses_api_is_passed_through_and_recorded() -> None:
    publisher = FakePublisher()
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="p"), publisher,
                      client=httpx.AsyncClient(transport=httpx.MockTransport(responses_upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            r = await c.post("/v1/responses", json={
                "model": "m", "instructions": "be brief",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "what is x?"}]},
                          {"type": "function_call", "call_id": "c0", "name": "lookup", "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "c0", "output": "x is 1"}]})
            assert r.status_code == 200 and r.json()["output"][1]["content"][0]["text"] == "the answer"
            tid = r.headers["x-rlstream-trajectory-id"]
            assert (await c.post("/v1/responses", json={"model": "no-api", "input": "hi"})).status_code == 404
            bad = await c.post("/v1/responses", json={"model": "m", "input": 5})
            assert bad.status_code == 400 and "input" in bad.json()["error"]["message"]
    finally:
        await gateway.stop()
    (event,) = [e for _, e in publisher.sent if isinstance(e, TrajectoryEvent)]
    assert event.trajectory_id == tid
    assert [m.role for m in event.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert event.messages[1].content == "what is x?" and event.messages[3].tool_call_id == "c0"
    answer = event.messages[4]
    assert answer.content == "the answer" and answer.tool_calls[0].name == "lookup"
    assert event.turns[0].message_index == 4 and event.turns[0].completion_token_ids is None


def test_token_ids_only_leaves_logprobs_to_the_client() -> None:
    body = {"model": "m", "messages": [USER]}
    ids_only = upstream_request(body, request_logprobs=False)
    assert ids_only == {**body, "return_token_ids": True}
    # a client that asks for logprobs itself still gets them (and the capture records them)
    asked = upstream_request({**body, "logprobs": True, "top_logprobs": 2}, request_logprobs=False)
    assert asked["logprobs"] is True and asked["top_logprobs"] == 2 and asked["return_token_ids"] is True
    assert upstream_request(body, request_token_data=False, request_logprobs=False) == body


async def test_a_streamed_answer_is_handed_on_one_write_per_event() -> None:
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="p"), FakePublisher(),
                      client=httpx.AsyncClient(transport=httpx.MockTransport(streamed_choices_upstream)))
    app = create_app(gateway)
    request = json.dumps({"model": "m", "messages": [USER], "n": 1, "stream": True}).encode()
    received = [{"type": "http.request", "body": request, "more_body": False}]
    bodies: list[bytes] = []

    async def receive() -> dict[str, Any]:
        return received.pop(0) if received else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            bodies.append(message["body"])

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("gw", 80)}
    await gateway.start()
    try:
        await app(scope, receive, send)
    finally:
        await gateway.stop()
    events = b"".join(bodies).decode().split("\n\n")[:-1]
    assert len(events) == 5 and events[-1] == "data: [DONE]"  # the first chunk, two tokens, the finish, [DONE]
    # the first event goes on as soon as it is read (its blank line follows); every later one in one write
    assert bodies[0].decode().startswith("data: ") and bodies[1] == b"\n"
    assert len(bodies) == 2 + len(events) - 1 and all(b.endswith(b"\n\n") for b in bodies[2:])


def test_a_calls_size_counts_its_text_in_utf8_bytes() -> None:
    # the session bound keeps a session's record below what Kafka accepts: non-Latin text takes 2-4 bytes a character
    # there, so counting characters (the control) lets a session three times the bound through
    from rlstream.gateway.sessions import call_bytes
    from rlstream.rollout.capture import RecordedCall
    from rlstream.schemas.models import Message, Turn

    turn = Turn(model="m", prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-0.1])
    text = "語" * 1000  # 3 bytes each in UTF-8
    call = RecordedCall([Message(role="user", content=text)], Message(role="assistant", content="ok"), turn, "m")
    assert call_bytes(call) >= len(text.encode()) + len("ok") + 3 * 8
    assert len(text) < len(text.encode()) // 2  # what a count of characters would have taken
