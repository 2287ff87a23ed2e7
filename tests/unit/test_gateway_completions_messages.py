"""The gateway's legacy Completions and Anthropic Messages endpoints, piece by piece: the token data asked for and
taken back out, the Messages request as a chat completion and the answer back in Anthropic's shape (streamed too),
the turn whose logprobs miss a token counted (never dropped silently), Responses' ``top_logprobs`` not leaked, and an
endpoint the upstream lacks answered with the upstream's status."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.completions import (CompletionsAsked, CompletionStream, completion_tokens, completions_asked,
                                          completions_upstream_request, filter_completion)
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.messages import MessagesStream, anthropic_message, chat_request, stop_reason
from rlstream.gateway.responses import ResponsesAsked, filter_response_payload
from rlstream.gateway.sessions import Trajectory
from rlstream.schemas.models import Turn
from tests.unit.test_gateway_sessions import FakePublisher

pytestmark = pytest.mark.unit

WEATHER = {"name": "weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_completions_ask_for_token_data_and_hand_back_only_what_the_client_asked() -> None:
    sent = completions_upstream_request({"model": "m", "prompt": "a"}, True, True)
    assert sent["return_token_ids"] is True and sent["logprobs"] == 0
    assert completions_upstream_request({"prompt": "a", "logprobs": 3}, True, True)["logprobs"] == 3
    assert "logprobs" not in completions_upstream_request({"prompt": "a"}, True, False)
    assert completions_upstream_request({"prompt": "a"}, False, True) == {"prompt": "a"}
    assert completions_asked({"logprobs": 0}) == CompletionsAsked(logprobs=True)  # 0: the sampled tokens' own
    assert completions_asked({}) == CompletionsAsked()
    choice = {"index": 0, "text": "cc", "token_ids": [9, 9], "prompt_token_ids": [1, 2],
              "logprobs": {"tokens": ["c", "c"], "token_logprobs": [-0.5, -0.25], "top_logprobs": [None, None],
                           "text_offset": [0, 1]}, "finish_reason": "length"}
    tokens = completion_tokens(choice)
    assert (tokens.prompt_ids, tokens.completion_ids, tokens.logprobs) == ([1, 2], [9, 9], [-0.5, -0.25])
    out = filter_completion({"choices": [dict(choice)]}, CompletionsAsked())
    assert out["choices"][0]["logprobs"] is None and out["choices"][0]["token_ids"] is None
    assert out["choices"][0]["prompt_token_ids"] is None and out["choices"][0]["text"] == "cc"
    kept = filter_completion({"choices": [dict(choice)]}, CompletionsAsked(logprobs=True, token_ids=True))
    assert kept["choices"][0] == choice


def test_a_streamed_completion_is_followed_and_filtered() -> None:
    follow = CompletionStream(CompletionsAsked(), "policy-v3", "policy")
    chunks = [{"id": "cmpl-1", "model": "policy-v3", "choices": [
        {"index": 0, "text": "c", "prompt_token_ids": [1, 2], "token_ids": [9],
         "logprobs": {"tokens": ["c"], "token_logprobs": [-0.5], "top_logprobs": [None], "text_offset": [0]}}]},
        {"id": "cmpl-1", "model": "policy-v3", "choices": [
            {"index": 0, "text": "", "token_ids": [2], "finish_reason": "stop",
             "logprobs": {"tokens": [""], "token_logprobs": [-0.125], "top_logprobs": [None], "text_offset": [1]}}]}]
    rendered = [follow.render("data: " + json.dumps(c)) for c in chunks]
    assert follow.render("data: [DONE]") == "data: [DONE]\n"
    first = json.loads(rendered[0][5:])
    assert first["model"] == "policy" and first["choices"][0]["logprobs"] is None
    assert first["choices"][0]["token_ids"] is None and first["choices"][0]["prompt_token_ids"] is None
    tokens = follow.tokens()
    assert (tokens.prompt_ids, tokens.completion_ids, tokens.logprobs) == ([1, 2], [9, 2], [-0.5, -0.125])
    assert follow.response_id == "cmpl-1" and follow.choice(0).finish_reason == "stop"
    assert "".join(follow.choice(0).text) == "c"


def test_a_messages_request_becomes_the_chat_request_vllm_makes_of_it() -> None:
    body = {"model": "policy", "max_tokens": 32, "system": [{"type": "text", "text": "Be terse."}],
            "stop_sequences": ["END"], "temperature": 0.5, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                                   "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "rain"}]},
                                             {"type": "text", "text": "So?"}]}]}
    chat = chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "user", "content": "So?"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "description": WEATHER["description"],
                                                               "parameters": WEATHER["input_schema"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["parallel_tool_calls"] is False and chat["stop"] == ["END"] and chat["max_tokens"] == 32
    assert chat["temperature"] == 0.5 and "stream" not in chat
    assert chat_request({**body, "tool_choice": {"type": "any"}})["tool_choice"] == "required"
    assert chat_request({**body, "stream": True})["stream_options"]["include_usage"] is True
    for bad in ({**body, "max_tokens": 0}, {**body, "messages": [{"role": "tool", "content": "x"}]},
                {**body, "tool_choice": {"type": "tool"}}):
        with pytest.raises(ValueError):
            chat_request(bad)


def test_a_chat_answer_goes_back_in_the_messages_shape() -> None:
    payload = {"id": "chatcmpl-1", "model": "policy-v3", "usage": {"prompt_tokens": 20, "completion_tokens": 7},
               "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                   "role": "assistant", "content": "Looking.", "tool_calls": [
                       {"id": "call_1", "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}}]}
    out = anthropic_message(payload, "policy")
    assert out == {"id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "policy",
                   "content": [{"type": "text", "text": "Looking."},
                               {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}}],
                   "stop_reason": "tool_use", "stop_sequence": None,
                   "usage": {"input_tokens": 20, "output_tokens": 7}}
    assert stop_reason("length", None, True, True) == ("max_tokens", None)
    assert stop_reason("stop", "END", False, False) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, False, False) == ("end_turn", None)
    empty = anthropic_message({"choices": [{"message": {"role": "assistant", "content": ""},
                                            "finish_reason": "stop"}]}, "policy")
    assert empty["content"] == [{"type": "text", "text": ""}] and empty["stop_reason"] == "end_turn"


def events(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[6:])
        assert event["type"] == kind[7:]
        out.append(event)
    return out


def test_a_streamed_chat_answer_becomes_the_messages_stream_and_is_accumulated() -> None:
    head = {"id": "chatcmpl-2", "model": "policy-v3", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}
    chunks = [head,
              {"choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [7],
                            "logprobs": {"content": [{"token": "Hi", "logprob": -0.5}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "id": "call_9", "type": "function",
                   "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}, "token_ids": [8],
                  "logprobs": {"content": [{"token": "w", "logprob": -0.25}]}}]},
              {"choices": [{"index": 0, "delta": {}, "token_ids": [2], "finish_reason": "tool_calls",
                            "logprobs": {"content": [{"token": "", "logprob": -0.125}]}}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}]
    stream = MessagesStream("policy")
    text = "".join(stream.render("data: " + json.dumps(c)) for c in chunks) + stream.render("data: [DONE]")
    got = events(text)
    assert [e["type"] for e in got] == ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"]
    assert got[0]["message"]["id"] == "chatcmpl-2" and got[0]["message"]["model"] == "policy"
    assert got[0]["message"]["usage"]["input_tokens"] == 3
    assert got[2]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert got[4]["content_block"] == {"type": "tool_use", "id": "call_9", "name": "weather", "input": {}}
    assert got[5]["index"] == 1 and got[5]["delta"]["partial_json"] == '{"city": "Oslo"}'
    assert got[7]["delta"]["stop_reason"] == "tool_use" and got[7]["usage"]["output_tokens"] == 3
    acc = stream.accumulator
    assert acc.prompt_ids == [1, 2, 3] and acc.completion_ids() == [7, 8, 2]
    assert acc.logprobs() == [-0.5, -0.25, -0.125]


def turn_of(traj: Trajectory) -> Turn:
    (turn,) = traj.to_event(run_id="run", policy="policy", producer_id="gw").turns
    return turn


def test_a_turn_whose_logprobs_miss_a_token_is_counted_and_kept_without_them() -> None:
    gateway = Gateway(GatewaySettings(session_stitching="gateway"), FakePublisher())
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    message = {"role": "assistant", "content": "cc"}
    whole = Trajectory(session_id=None, policy_version=0, task=None)
    gateway.finish(whole, body, message, [1, 2], [9, 9, 2], [-0.5, -0.25, -0.125], "stop", "policy", 0)
    assert gateway.logprobs_incomplete == 0  # negative control: every token has its logprob, kept
    assert turn_of(whole).completion_logprobs == [-0.5, -0.25, -0.125]
    short = Trajectory(session_id=None, policy_version=0, task=None)
    gateway.finish(short, body, message, [1, 2], [9, 9, 2], [-0.5, -0.25], "stop", "policy", 0)
    assert gateway.logprobs_incomplete == 1
    assert turn_of(short).completion_token_ids == [9, 9, 2] and turn_of(short).completion_logprobs is None


def test_responses_hand_back_top_logprobs_only_when_the_client_asked_for_logprobs() -> None:
    answer = {"id": "resp_1", "top_logprobs": 0, "output": []}
    assert filter_response_payload(dict(answer), ResponsesAsked())["top_logprobs"] is None  # vLLM's null
    assert filter_response_payload(dict(answer), ResponsesAsked(logprobs=True))["top_logprobs"] == 0
    assert filter_response_payload({"output": []}, ResponsesAsked()) == {"output": []}


async def chat(request: Request) -> JSONResponse:
    return JSONResponse({"id": "chatcmpl-3", "model": "policy", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})


async def no_completions(request: Request) -> PlainTextResponse:
    return PlainTextResponse("Not Implemented", status_code=501)


async def test_an_endpoint_the_upstream_lacks_answers_the_upstreams_status() -> None:
    async def answers(routes: list[Route]) -> dict[str, httpx.Response]:
        gateway = Gateway(GatewaySettings(session_stitching="gateway"), FakePublisher(), client=httpx.AsyncClient(
            transport=httpx.ASGITransport(Starlette(routes=routes)), base_url="http://up"))
        await gateway.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)),
                                         base_url="http://gw") as c:
                return {"completions": await c.post("/v1/completions", json={"model": "policy", "prompt": "a"}),
                        "messages": await c.post("/v1/messages", json={
                            "model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]})}
        finally:
            await gateway.stop()

    lacking = await answers([])  # an upstream without either endpoint: its 404, in each API's error shape
    assert lacking["completions"].status_code == 404, lacking["completions"].text
    assert lacking["completions"].json()["error"]["type"] == "not_found_error"
    assert lacking["messages"].status_code == 404, lacking["messages"].text
    assert lacking["messages"].json() == {"type": "error", "error": {"type": "not_found_error",
                                                                     "message": lacking["messages"].json()["error"][
                                                                         "message"]}}
    refusing = await answers([Route("/v1/completions", no_completions, methods=["POST"])])
    assert refusing["completions"].status_code == 501 and refusing["completions"].json()["error"]["code"] == 501
    served = await answers([Route("/v1/chat/completions", chat, methods=["POST"])])  # negative control
    assert served["messages"].status_code == 200, served["messages"].text
    assert served["messages"].json()["content"] == [{"type": "text", "text": "ok"}]
    assert served["messages"].headers["x-rlstream-trajectory-id"]


def test_a_tool_call_sent_back_reserialized_continues_its_session() -> None:
    from rlstream.schemas.models import Message, ToolCall
    from rlstream.schemas.sessions import same_message

    def call(arguments: str) -> Message:
        return Message(role="assistant", content=None, tool_calls=[ToolCall(id="t", name="pick", arguments=arguments)])

    # vLLM wrote '{"letter":"b"}'; an Anthropic client sends the input object back, re-serialized with spaces
    assert same_message(call('{"letter":"b"}'), call('{"letter": "b"}'))
    assert not same_message(call('{"letter":"b"}'), call('{"letter": "c"}'))  # other arguments: a rewritten history
    assert not same_message(call("b"), call(" b"))  # not JSON: compared as sent


async def test_the_anthropic_sdks_x_api_key_is_the_key_on_the_messages_path_only() -> None:
    from pydantic import SecretStr

    from rlstream.gateway.auth import AccessConfig

    key = "messages-key-" + "0" * 32
    gateway = Gateway(GatewaySettings(session_stitching="gateway"), FakePublisher(), client=httpx.AsyncClient(
        transport=httpx.ASGITransport(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])),
        base_url="http://up"), access=AccessConfig(api_keys=[SecretStr(key)]))
    await gateway.start()
    ask = {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            assert (await c.post("/v1/messages", json=ask, headers={"x-api-key": key})).status_code == 200
            assert (await c.post("/v1/messages", json=ask, headers={"x-api-key": "wrong"})).status_code == 401
            assert (await c.post("/v1/messages", json=ask)).status_code == 401
            # negative control: the other inference paths take the key as a bearer token only
            chat_call = {"model": "policy", "messages": [{"role": "user", "content": "a"}]}
            assert (await c.post("/v1/chat/completions", json=chat_call, headers={"x-api-key": key})).status_code == 401
            assert (await c.post("/v1/chat/completions", json=chat_call,
                                 headers={"authorization": f"Bearer {key}"})).status_code == 200
    finally:
        await gateway.stop()
