"""Feedback from the real clients (the Langfuse Python SDK, the LangSmith client, the OpenTelemetry SDK's OTLP/HTTP log
exporter) to a gateway served on a port (canned upstream, real broker): each client makes its call, sends its
feedback, and the reward reaches ``rewards`` once with the right value; a score the gateway cannot use is a 4xx the
client surfaces, and nothing reaches ``rewards`` for it."""
from __future__ import annotations

import asyncio
import base64
import gzip
import json
import logging
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import uvicorn
from pydantic import SecretStr

from bench.canned_upstream import app as canned_upstream
from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import AccessConfig
from rlstream.gateway.config import GatewaySettings
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import RewardEvent
from tests.support.learner_helpers import read_topic
from tests.support.otel_feedback import otel_evaluation

pytestmark = pytest.mark.integration

POLICY = "toy"
KEY = "acme-key-0123456789abcdef"
CHAT = {"model": POLICY, "messages": [{"role": "user", "content": "Repeat the letter c."}], "max_tokens": 8}


@asynccontextmanager
async def served_gateway(rl_config: Any, topics: Any, tmp_path: Path,
                         **settings: Any) -> AsyncIterator[tuple[str, Gateway]]:
    """A keyed gateway in front of the canned upstream, served by uvicorn on a free loopback port."""
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"keys": [{"key": KEY, "tenant": "acme"}]}))
    keys_file.chmod(0o600)
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, topics.trajectories, topics.rewards)
    await publisher.start()
    access = AccessConfig(api_keys_file=keys_file, feedback_secret=SecretStr("s" * 32), reward_range=(-1.0, 1.0))
    config = GatewaySettings(session_stitching="gateway", policy=POLICY, served_model=POLICY, run_id=rl_config.run_id,
                             feedback_categories={"thumbs_up": 1.0, "thumbs_down": -1.0}, **settings)
    gw = Gateway(config, publisher, access=access,
                 client=httpx.AsyncClient(transport=httpx.ASGITransport(canned_upstream), base_url="http://up"))
    server = uvicorn.Server(uvicorn.Config(create_app(gw), host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False))
    task = asyncio.create_task(server.serve())  # its lifespan starts and stops the gateway
    try:
        while not server.started:
            assert not task.done(), "the gateway did not start"
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", gw
    finally:
        server.should_exit = True
        await task
        await publisher.close()


async def call(base: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base) as client:
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r


async def rewards_exactly(rl_config: Any, topics: Any, count: int) -> list[tuple[str, float, dict[str, float]]]:
    """The rewards on the topic, after waiting for one more than ``count`` (so a surplus shows)."""
    events = await read_topic(rl_config, topics.rewards, RewardEvent, expect=count + 1, timeout_s=4.0)
    return [(e.trajectory_id, e.reward, dict(e.components)) for e in events]


async def test_langfuse_sdk_scores_and_the_ingestion_batch(rl_config: Any, created_topics: Any, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from langfuse import Langfuse

    async with served_gateway(rl_config, created_topics, tmp_path) as (base, _):
        tid = (await call(base)).headers["x-rlstream-trajectory-id"]
        langfuse = Langfuse(public_key="pk-lf-rlstream", secret_key=KEY, base_url=base)

        def scores() -> None:
            langfuse.create_score(name="quality", value=0.5, trace_id=tid, data_type="NUMERIC")
            langfuse.create_score(name="resolved", value=True, trace_id=tid, data_type="BOOLEAN")
            langfuse.create_score(name="verdict", value="Thumbs_Up", trace_id=tid, data_type="CATEGORICAL")
            langfuse.create_score(name="typo", value="good", trace_id=tid, data_type="NUMERIC")  # wrong type
            langfuse.flush()

        with caplog.at_level(logging.ERROR, logger="langfuse"):
            await asyncio.to_thread(scores)
            await asyncio.to_thread(langfuse.shutdown)
        surfaced = [r.getMessage() for r in caplog.records if r.name.startswith("langfuse")]
        assert any("rejected 1 of 4" in m and "NUMERIC" in m for m in surfaced), surfaced

        # the batch ingestion API of the 2.x-3.x SDKs: one result per event, as Langfuse answers (207)
        lf_auth = {"authorization": "Basic " + base64.b64encode(f"pk:{KEY}".encode()).decode()}
        batch = {"batch": [
            {"id": "ev-1", "type": "score-create", "timestamp": "2026-11-27T00:00:00Z",
             "body": {"id": "sc-1", "traceId": tid, "name": "ingested", "value": 0.25}},
            {"id": "ev-2", "type": "score-create", "timestamp": "2026-11-27T00:00:00Z",
             "body": {"traceId": tid, "name": "flag", "value": 0.7, "dataType": "BOOLEAN"}},  # not 0 or 1
            {"id": "ev-3", "type": "trace-create", "timestamp": "2026-11-27T00:00:00Z", "body": {"id": "t"}}]}
        async with httpx.AsyncClient(base_url=base) as client:
            r = await client.post("/api/public/ingestion", json=batch, headers=lf_auth)
            assert r.status_code == 207, r.text
            assert r.json()["successes"] == [{"id": "ev-1", "status": 201}]
            assert [(e["id"], e["status"]) for e in r.json()["errors"]] == [("ev-2", 400), ("ev-3", 400)]
            one = await client.post("/api/public/scores", headers=lf_auth,
                                    json={"traceId": tid, "name": "single", "value": 0.125})
            assert one.status_code == 200 and uuid.UUID(one.json()["id"]), one.text  # the id Langfuse would create

    got = await rewards_exactly(rl_config, created_topics, 5)
    assert sorted(got, key=lambda g: next(iter(g[2]))) == sorted([
        (tid, 0.5, {"quality": 0.5}), (tid, 1.0, {"resolved": 1.0}), (tid, 1.0, {"verdict": 1.0}),
        (tid, 0.25, {"ingested": 0.25}), (tid, 0.125, {"single": 0.125})], key=lambda g: next(iter(g[2])))


async def test_langsmith_client_feedback_with_its_config_and_update(rl_config: Any, created_topics: Any,
                                                                    tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    import langsmith
    from langsmith.utils import LangSmithError

    async with served_gateway(rl_config, created_topics, tmp_path, correction_window_s=600) as (base, _):
        tid = (await call(base)).headers["x-rlstream-trajectory-id"]
        client = langsmith.Client(api_url=base, api_key=KEY)
        helpful_id, verdict_id = uuid.uuid4(), uuid.uuid4()
        project = uuid.uuid4()

        def feedback() -> None:
            assert client.info.version  # GET /info answered, not 401
            client.create_feedback(run_id=tid, key="helpfulness", score=4, feedback_id=helpful_id, session_id=project,
                                   feedback_config={"type": "continuous", "min": 1, "max": 5})
            client.create_feedback(run_id=tid, key="verdict", value="good", feedback_id=verdict_id,
                                   session_id=project,
                                   feedback_config={"type": "categorical", "min": 0, "max": 2, "categories": [
                                       {"value": 0, "label": "bad"}, {"value": 1, "label": "ok"},
                                       {"value": 2, "label": "good"}]})
            client.update_feedback(helpful_id, score=5)  # a correction, on the same 1..5 scale

        with caplog.at_level(logging.WARNING, logger="langsmith"):
            await asyncio.to_thread(feedback)
            with pytest.raises(LangSmithError, match="422"):  # 7 on 1..5: surfaced, not dropped
                await asyncio.to_thread(client.create_feedback, run_id=tid, key="helpfulness", score=7,
                                        session_id=project, feedback_config={"type": "continuous", "min": 1,
                                                                             "max": 5})
        assert not [r for r in caplog.records if "Failed to get info" in r.getMessage()]

    got = await rewards_exactly(rl_config, created_topics, 3)
    assert got == [(tid, 0.75, {"helpfulness": 0.75}), (tid, 1.0, {"verdict": 1.0}),
                   (tid, 1.0, {"helpfulness": 1.0})]


async def test_otel_log_exporter_over_http_protobuf_and_json_gzip(rl_config: Any, created_topics: Any,
                                                                  tmp_path: Path) -> None:
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai

    async with served_gateway(rl_config, created_topics, tmp_path) as (base, _):
        first = await call(base)
        tid, response_id = first.headers["x-rlstream-trajectory-id"], first.json()["id"]

        async def evaluate(name: str, score: dict[str, Any], compressed: bool = True) -> bool:
            return await asyncio.to_thread(otel_evaluation, base, KEY, response_id, name, score, compressed)

        results = [await evaluate("relevance", {gen_ai.GEN_AI_EVALUATION_SCORE_VALUE: 0.5}, compressed=False),
                   await evaluate("tone", {gen_ai.GEN_AI_EVALUATION_SCORE_LABEL: "thumbs_down"}),
                   await evaluate("style", {gen_ai.GEN_AI_EVALUATION_SCORE_LABEL: "so-so"}),
                   # the same evaluator again is a correction: the single left at its reward (no correction
                   # window): 409
                   await evaluate("relevance", {gen_ai.GEN_AI_EVALUATION_SCORE_VALUE: 0.9})]
        assert results == [True, True, False, False]  # unknown label, late correction: the exporter reports both

        record = {"eventName": "gen_ai.evaluation.result", "attributes": [
            {"key": "gen_ai.response.id", "value": {"stringValue": tid}},
            {"key": "gen_ai.evaluation.name", "value": {"stringValue": "faithfulness"}},
            {"key": "gen_ai.evaluation.score.value", "value": {"doubleValue": 0.25}}]}
        body = gzip.compress(json.dumps({"resourceLogs": [{"scopeLogs": [{"logRecords": [record]}]}]}).encode())
        async with httpx.AsyncClient(base_url=base) as client:  # the Collector's otlphttp: JSON, gzip
            r = await client.post("/v1/logs", content=body, headers={
                "authorization": f"Bearer {KEY}", "content-type": "application/json", "content-encoding": "gzip"})
            assert r.status_code == 200, r.text
            r = await client.post("/v1/logs", content=b"not gzip", headers={
                "authorization": f"Bearer {KEY}", "content-type": "application/json", "content-encoding": "gzip"})
            assert r.status_code == 400, r.text

    got = await rewards_exactly(rl_config, created_topics, 3)
    assert got == [(tid, 0.5, {"relevance": 0.5}), (tid, -1.0, {"tone": -1.0}),
                   (tid, 0.25, {"faithfulness": 0.25})]
