"""Fuzzing the gateway's ASGI app (hypothesis): no generated request gets a 500 or takes the app down.

Methods, paths (the routes, with good and bad session ids, and random ones), headers (session ids, task names,
content types, sizes), bodies (chat requests with deep JSON, NaN / Infinity, huge and odd ``n``, streamed or not,
feedback with any values, random bytes). In-process (httpx.ASGITransport) against a canned upstream that answers
like vLLM, streamed and not; capture goes to an in-memory publisher (the queue and sessions are the real ones).
"""
from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from tests.unit.test_gateway_sessions import FakePublisher

FUZZ = settings(max_examples=int(os.environ.get("RLSTREAM_FUZZ_EXAMPLES", "300")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def canned_upstream(request: httpx.Request) -> httpx.Response:
    """vLLM's answers: a chat completion (streamed when asked), the models, a Responses result."""
    if request.url.path.endswith("/models"):
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
    body = json.loads(request.content)
    if request.url.path.endswith("/responses"):
        return httpx.Response(200, json={"id": "resp_1", "status": "completed", "model": body.get("model"),
                                         "output": [{"type": "message", "content": [{"text": "ok"}]}]})
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    if body.get("stream"):
        lines = [f'data: {json.dumps({"prompt_token_ids": [1, 2], "choices": [{"index": i, "delta": {"role": "assistant", "content": "o"}, "token_ids": [3]} for i in range(n)]})}',
                 "", f'data: {json.dumps({"choices": [{"index": i, "delta": {}, "finish_reason": "stop"} for i in range(n)]})}',
                 "", "data: [DONE]", ""]
        return httpx.Response(200, text="\n".join(lines), headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json={
        "model": body.get("model"), "prompt_token_ids": [1, 2],
        "choices": [{"index": i, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                     "token_ids": [3], "logprobs": {"content": [{"token": "ok", "logprob": -0.25}]}}
                    for i in range(n)]})


# --- strategies ---------------------------------------------------------------------------------------------
ids = st.one_of(st.text(min_size=0, max_size=40), st.text(alphabet="abc-_.:", min_size=1, max_size=12),
                st.just("x" * 300), st.sampled_from(["ok-1", "a\x00b", "a\r\nb", "%00", "é", "..", " "]))
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                      st.text(max_size=20))
json_values = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=20)
messages = st.one_of(
    st.just([{"role": "user", "content": "hi"}]),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                    "content": st.one_of(st.text(max_size=20), st.none(), json_values)}), max_size=4),
    json_values)
chat_bodies = st.fixed_dictionaries(
    {"model": st.one_of(st.just("m"), json_values), "messages": messages},
    optional={"n": st.one_of(st.integers(-5, 300), st.just(110_000), st.floats(allow_nan=True), st.text(max_size=3),
                             st.booleans()),
              "stream": st.one_of(st.booleans(), json_values), "logprobs": st.booleans(),
              "temperature": st.floats(allow_nan=True, allow_infinity=True), "extra": json_values})
feedback_bodies = st.fixed_dictionaries(
    {}, optional={"trajectory_id": st.one_of(ids, json_values), "session_id": st.one_of(ids, json_values),
                  "reward": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                                      st.booleans(), st.integers(), st.none()),
                  "components": json_values})
responses_bodies = st.fixed_dictionaries({"model": st.just("m"), "input": st.one_of(st.text(max_size=10),
                                                                                  json_values)},
                                         optional={"stream": st.booleans(), "instructions": json_values})


def deep(depth: int) -> bytes:
    return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # NaN / Infinity as Python writes them


bodies = st.one_of(chat_bodies.map(encode), feedback_bodies.map(encode), responses_bodies.map(encode),
                   st.integers(1, 60_000).map(deep), st.binary(max_size=200),
                   st.sampled_from([b"", b"null", b"[]", b'{"messages": NaN}', b'{"n": 1e400, "messages": []}']))
ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/feedback"]
paths = st.one_of(
    st.sampled_from(ROUTES * 4 + ["/v1/models", "/rlstream/stats", "/health", "/", "/v1", "/s//v1/chat/completions"]),
    ids.map(lambda sid: f"/s/{quote(sid, safe='')}/v1/chat/completions"),
    ids.map(lambda sid: f"/v1/sessions/{quote(sid, safe='')}/end"),
    st.text(alphabet="/abcsv1%0-_.", max_size=30).map(lambda p: "/" + p))
header_sets = st.dictionaries(
    st.sampled_from(["x-session-id", "x-rlstream-task", "content-type", "x-other", "accept"]),
    st.one_of(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xff), max_size=30),
              st.just("y" * 70_000), st.just("ok")), max_size=4)


@pytest.fixture(scope="module")
def app_under_fuzz() -> Iterator[tuple[asyncio.Runner, Gateway, httpx.AsyncClient]]:
    config = GatewaySettings(session_stitching="gateway",
                             max_choices=256, max_open_sessions=50, remembered_trajectories=1000, queue_size=100_000)
    runner = asyncio.Runner()
    gateway = Gateway(config, FakePublisher(), client=httpx.AsyncClient(transport=httpx.MockTransport(canned_upstream)))
    runner.run(gateway.start())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw", timeout=30)
    try:
        yield runner, gateway, client
    finally:
        runner.run(client.aclose())
        runner.run(gateway.stop())
        runner.close()


@FUZZ
@given(method=st.sampled_from(["POST"] * 8 + ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]), path=paths,
       headers=header_sets, body=bodies)
def test_no_request_gets_a_500_and_the_app_stays_up(app_under_fuzz: tuple[asyncio.Runner, Gateway, httpx.AsyncClient],
                                                    method: str, path: str, headers: dict[str, str],
                                                    body: bytes) -> None:
    runner, gateway, client = app_under_fuzz
    encoded = {k: v.encode("latin-1") for k, v in headers.items()}

    async def one() -> tuple[httpx.Response, httpx.Response]:
        try:
            answer = await client.request(method, path, content=body if method not in ("GET", "HEAD") else None,
                                          headers=encoded)
        except httpx.InvalidURL:  # the client itself refuses the URL: nothing reached the app
            answer = httpx.Response(400)
        return answer, await client.get("/health")

    answer, health = runner.run(one())
    assert answer.status_code < 500, (method, path, headers, body[:200], answer.text[:500])
    assert health.status_code == 200
    assert gateway.limit_stats.in_flight == 0
