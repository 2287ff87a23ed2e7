"""A 2xx always means captured: a call whose capture is larger than a Kafka record (``kafka.max_message_bytes``) is
refused with 413 at the door (body), or once the upstream answered (non-streamed: 413; streamed: the stream ends with
an error event before ``[DONE]``), and nothing half-captured reaches the real broker. The control raises the gateway's
own record limit above what the producer and broker take: the same call is answered 200 and never reaches the topic.
"""
from __future__ import annotations

import json

import httpx
import pytest

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from tests.support.learner_helpers import read_whole_topic
from tests.unit.test_gateway_sessions import USER

pytestmark = pytest.mark.integration

HUGE = "x" * 2_000_000  # 2 MB: twice a Kafka record


def completion_upstream(body: dict) -> httpx.Response:
    """vLLM's streamed Completions answer: 2 MB of text for the prompt ``big``, else ``ok``."""
    text = HUGE if body["prompt"] == "big" else "ok"
    chunks = [{"id": "cmpl", "model": "m", "choices": [{"index": 0, "text": text, "prompt_token_ids": [1, 2],
                                                        "token_ids": [3], "logprobs": {"token_logprobs": [-0.5]}}]},
              {"id": "cmpl", "model": "m", "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})


def upstream(request: httpx.Request) -> httpx.Response:
    """vLLM's answer: 2 MB of text for a prompt that asks for ``big``, else ``ok``; streamed when asked."""
    body = json.loads(request.content)
    if request.url.path.endswith("/v1/completions"):
        return completion_upstream(body)
    text = HUGE if body["messages"][-1]["content"] == "big" else "ok"
    if body.get("stream"):
        chunks = [{"id": "c", "model": "m", "prompt_token_ids": [1, 2],
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "token_ids": [3],
                                "logprobs": {"content": [{"token": "x", "logprob": -0.5}]}}]},
                  {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json={
        "id": "c", "model": "m", "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                     "token_ids": [3], "logprobs": {"content": [{"token": "x", "logprob": -0.5}]}}]})


async def calls(config: GatewaySettings, publisher: TrajectoryPublisher) -> tuple[dict[str, httpx.Response], Gateway]:
    """The four calls (a 2 MB body, a 2 MB answer, a 2 MB streamed answer, a small one) through one gateway."""
    gateway = Gateway(config, publisher, client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw",
                                     timeout=60) as c:
            async def chat(content: str, **extra: object) -> httpx.Response:
                return await c.post("/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": content}], **extra})
            return {"body": await chat(HUGE), "answer": await chat("big"),
                    "streamed": await chat("big", stream=True), "small": await chat(USER["content"]),
                    "completion_streamed": await c.post("/v1/completions", json={
                        "model": "m", "prompt": "big", "stream": True}),
                    "messages_streamed": await c.post("/v1/messages", json={
                        "model": "m", "max_tokens": 8, "stream": True,
                        "messages": [{"role": "user", "content": "big"}]})}, gateway
    finally:
        await gateway.stop()


async def on_topic(rl_config: RlstreamConfig, topics: TopicNames) -> list[TrajectoryEvent]:
    return list(await read_whole_topic(rl_config, topics.trajectories, TrajectoryEvent))


def trajectory_id(answer: httpx.Response) -> str | None:
    return answer.headers.get("x-rlstream-trajectory-id")


async def test_a_call_kafka_cannot_take_is_never_answered_2xx(rl_config: RlstreamConfig,
                                                              created_topics: TopicNames) -> None:
    record_max = rl_config.kafka.max_message_bytes
    assert record_max < len(HUGE)
    config = GatewaySettings.resolve(rl_config).model_copy(update={
        "policy": "m", "served_model": "m", "spool_dir": None, "session_stitching": "streams"})
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    try:
        answers, gateway = await calls(config, publisher)
    finally:
        await publisher.close()
    assert answers["body"].status_code == 413  # refused at the door: the body alone is over gateway.max_body_bytes
    assert answers["answer"].status_code == 413 and "cannot be captured" in answers["answer"].text
    streamed = answers["streamed"]
    assert streamed.status_code == 200  # the headers went out with the first event; the end tells the client
    events = [line[5:].strip() for line in streamed.text.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 413
    completion = answers["completion_streamed"]  # Completions: the same error event before [DONE]
    events = [line[5:].strip() for line in completion.text.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 413
    messages = answers["messages_streamed"]  # Anthropic Messages: an error event instead of message_stop
    kinds = [line[6:].strip() for line in messages.text.splitlines() if line.startswith("event:")]
    assert kinds[-1] == "error" and "message_stop" not in kinds
    assert json.loads(messages.text.strip().splitlines()[-1][5:])["error"]["type"] == "request_too_large"
    assert answers["small"].status_code == 200
    captured = {e.trajectory_id for e in await on_topic(rl_config, created_topics)}
    assert trajectory_id(answers["small"]) in captured  # what was answered 2xx is on the topic
    assert not {trajectory_id(streamed), trajectory_id(completion), trajectory_id(messages)} & captured
    assert len(captured) == 1
    assert gateway.capture.stats.refused == 4 and gateway.capture.stats.failed == 0


async def test_control_a_gateway_limit_above_kafkas_answers_200_and_loses_the_call(
        rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    config = GatewaySettings.resolve(rl_config).model_copy(update={
        "policy": "m", "served_model": "m", "spool_dir": None, "session_stitching": "streams",
        "max_body_bytes": 8_000_000})
    # the gateway's own record limit raised above what the producer (max_request_size) and the broker take
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards,
                                                codec=AvroCodec(max_bytes=8_000_000))
    await publisher.start()
    try:
        gateway_answers, gateway = await calls(config, publisher)
    finally:
        await publisher.close()
    big = gateway_answers["answer"]
    assert big.status_code == 200 and gateway_answers["body"].status_code == 200
    captured = {e.trajectory_id for e in await on_topic(rl_config, created_topics)}
    assert trajectory_id(big) not in captured and trajectory_id(gateway_answers["body"]) not in captured
    assert trajectory_id(gateway_answers["small"]) in captured  # the broker itself was working
    for streamed in ("streamed", "completion_streamed", "messages_streamed"):  # ended as if captured
        assert "error" not in gateway_answers[streamed].text and "413" not in gateway_answers[streamed].text
        assert trajectory_id(gateway_answers[streamed]) not in captured
    assert gateway.capture.stats.failed == 5  # the producer refused the five 2 MB records after the 200s
