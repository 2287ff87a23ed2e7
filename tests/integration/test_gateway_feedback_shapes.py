"""Feedback in the shapes observability tools send (Langfuse scores, LangSmith feedback, OpenTelemetry
gen_ai.evaluation.result over OTLP/HTTP JSON) through the real gateway endpoints to the real broker: each a RewardEvent
for the right trajectory, a repeated id a correction (same feedback_id), categorical values through the table, the
same auth as /v1/feedback, and a feedback for a session still open (its trajectory not yet published) joining it."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
from pydantic import SecretStr

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import AccessConfig
from rlstream.gateway.config import GatewaySettings
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from tests.integration.test_gateway_auth import canned_upstream
from tests.support.learner_helpers import read_topic

POLICY = "toy"
ACME = "acme-key-0123456789abcd"
GLOBEX = "globex-key-0123456789ab"
INFER_ONLY = "acme-inference-only-0123"
KEYS = {"keys": [{"key": ACME, "tenant": "acme"}, {"key": GLOBEX, "tenant": "globex"},
                 {"key": INFER_ONLY, "tenant": "acme", "scopes": ["inference"]}]}
CHAT = {"model": POLICY, "messages": [{"role": "user", "content": "Repeat the letter c."}], "max_tokens": 8}


def basic(public: str, secret: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{public}:{secret}".encode()).decode()}


def otlp(*records: dict[str, Any]) -> dict[str, Any]:
    def attribute(key: str, value: Any) -> dict[str, Any]:
        kind = "doubleValue" if isinstance(value, float) else "stringValue"
        return {"key": key, "value": {kind: value}}

    return {"resourceLogs": [{"resource": {"attributes": [attribute("service.name", "evaluator")]}, "scopeLogs": [
        {"scope": {"name": "evals"}, "logRecords": [
            {"timeUnixNano": "1795622749000000000", "eventName": r.pop("event", "gen_ai.evaluation.result"),
             "attributes": [attribute(k, v) for k, v in r.items()]} for r in records]}]}]}


@pytest.fixture
async def gateway(rl_config: Any, created_topics: Any, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    keys_file.chmod(0o600)
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    access = AccessConfig(api_keys_file=keys_file, feedback_secret=SecretStr("s" * 32), reward_range=(-1.0, 1.0))
    config = GatewaySettings(session_stitching="gateway",
                             policy=POLICY, served_model=POLICY, run_id=rl_config.run_id, session_idle_s=600,
                             correction_window_s=600,
                           feedback_categories={"thumbs_up": 1.0, "thumbs_down": -1.0, "meh": 0.0})
    gw = Gateway(config, publisher, access=access,
                 client=httpx.AsyncClient(transport=httpx.ASGITransport(canned_upstream()), base_url="http://up"))
    await gw.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gw)), base_url="http://gw") as client:
            yield client
    finally:
        await gw.stop()
        await publisher.close()


async def test_langfuse_langsmith_and_otel_feedback_become_rewards_with_corrections(
        gateway: httpx.AsyncClient, rl_config: Any, created_topics: Any) -> None:
    c, key = gateway, {"authorization": f"Bearer {ACME}"}
    chat = await c.post("/v1/chat/completions", json=CHAT, headers=key)
    single = chat.headers["x-rlstream-trajectory-id"]
    responses = await c.post("/v1/responses", json={"model": POLICY, "input": "hi"}, headers=key)
    response_id, answered = responses.json()["id"], responses.headers["x-rlstream-trajectory-id"]
    opened = await c.post("/s/open-1/v1/chat/completions", json=CHAT, headers=key)
    open_tid = opened.headers["x-rlstream-trajectory-id"]

    # Langfuse: Basic public:secret with the key as the secret; a repeated id corrects the score
    lf = basic("pk-lf-anything", ACME)
    r = await c.post("/api/public/scores", headers=lf, json={"id": "score-1", "traceId": single, "name": "quality",
                                                             "value": 0.25, "dataType": "NUMERIC"})
    assert r.status_code == 200 and r.json()["id"] == "score-1", r.text
    assert (await c.post("/api/public/scores", headers=lf, json={
        "id": "score-1", "traceId": single, "name": "quality", "value": 0.75})).status_code == 200
    assert (await c.post("/api/public/scores", headers=lf, json={  # a response id as the observation, categorical
        "id": "score-2", "observationId": response_id, "name": "verdict", "value": "Thumbs_Up",
        "dataType": "CATEGORICAL"})).status_code == 200
    r = await c.post("/api/public/scores", headers=lf, json={"traceId": single, "name": "verdict", "value": "great"})
    assert r.status_code == 400 and "unknown category" in r.json()["error"]["message"]  # not in the table
    # the trajectory of a session still open: its reward goes out before the trajectory does
    assert (await c.post("/api/public/scores", headers=lf, json={
        "id": "early-1", "sessionId": "open-1", "name": "resolved", "value": True,
        "dataType": "BOOLEAN"})).status_code == 200

    # LangSmith: x-api-key, run_id (here a trajectory id), key, score; the same id again corrects it
    ls = {"x-api-key": ACME}
    r = await c.post("/feedback", headers=ls, json={"id": "ls-1", "run_id": answered, "key": "correctness",
                                                     "score": 0, "comment": "wrong"})
    assert r.status_code == 200 and r.json()["id"] == "ls-1", r.text
    assert (await c.post("/api/v1/feedback", headers=ls, json={
        "feedback_id": "ls-1", "run_id": answered, "key": "correctness", "score": 1,
        "correction": {"answer": "ccc"}})).status_code == 200
    assert (await c.post("/feedback", headers=ls, json={"run_id": answered, "key": "c",
                                                        "correction": "x"})).status_code == 422
    r = await c.patch("/feedback/ls-1", headers=ls, json={"score": 0.5})  # Client.update_feedback
    assert r.status_code == 200 and r.json()["run_id"] == answered, r.text
    assert (await c.patch("/feedback/ls-unknown", headers=ls, json={"score": 0.5})).status_code == 404
    assert (await c.patch("/feedback/ls-1", json={"score": 0.5})).status_code == 401

    # OpenTelemetry: gen_ai.evaluation.result matched by gen_ai.response.id; the same evaluator again corrects
    r = await c.post("/v1/logs", headers=key, json=otlp(
        {"gen_ai.response.id": response_id, "gen_ai.evaluation.name": "relevance", "gen_ai.evaluation.score.value": 0.5},
        {"gen_ai.response.id": response_id, "gen_ai.evaluation.name": "relevance",
         "gen_ai.evaluation.score.label": "meh"},
        {"gen_ai.response.id": "resp_unknown", "gen_ai.evaluation.name": "relevance",
         "gen_ai.evaluation.score.value": 0.9},
        {"event": "some.other.event", "gen_ai.response.id": response_id}))
    # one record names no known response: the request is refused (400) naming it, the others were taken
    assert r.status_code == 400 and r.json()["error"]["rejectedLogRecords"] == 1, r.text
    assert "resp_unknown" in r.json()["error"]["message"]

    # the same auth as /v1/feedback: no key, a wrong secret, another tenant, a key without the feedback scope
    assert (await c.post("/api/public/scores", json={"traceId": single, "name": "q", "value": 1})).status_code == 401
    assert (await c.post("/api/public/scores", headers=basic("pk", "wrong-secret-0123456789"),
                         json={"traceId": single, "name": "q", "value": 1})).status_code == 401
    assert (await c.post("/feedback", headers={"x-api-key": GLOBEX},
                         json={"run_id": single, "key": "q", "score": 1})).status_code == 404
    assert (await c.post("/v1/logs", headers={"authorization": f"Bearer {INFER_ONLY}"},
                         json=otlp())).status_code == 403
    # a feedback token of the trajectory works as the Langfuse secret too
    token = chat.headers["x-rlstream-feedback-token"]
    r = await c.post("/api/public/scores", headers=basic("pk", token), json={
        "traceId": single, "name": "token", "value": 0.1})
    assert r.status_code == 200, r.text
    created = r.json()["id"]  # created by the gateway, as Langfuse creates it

    expected = 10
    rewards = await read_topic(rl_config, created_topics.rewards, RewardEvent, expect=expected)
    got = [(r.trajectory_id, r.reward, r.components, r.feedback_id) for r in rewards]
    assert got == [
        (single, 0.25, {"quality": 0.25}, "score-1"), (single, 0.75, {"quality": 0.75}, "score-1"),
        (answered, 1.0, {"verdict": 1.0}, "score-2"),
        (open_tid, 1.0, {"resolved": 1.0}, "early-1"),
        (answered, 0.0, {"correctness": 0.0}, "ls-1"), (answered, 1.0, {"correctness": 1.0}, "ls-1"),
        (answered, 0.5, {"correctness": 0.5}, "ls-1"),
        (answered, 0.5, {"relevance": 0.5}, f"otel:{response_id}:relevance"),
        (answered, 0.0, {"relevance": 0.0}, f"otel:{response_id}:relevance"),
        (single, 0.1, {"token": 0.1}, created)], got
    # the open session's trajectory is published only now, after its reward, and carries it too
    trajectories = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=2)
    assert open_tid not in {t.trajectory_id for t in trajectories}
    assert (await c.post("/v1/sessions/open-1/end", headers=key)).status_code == 200
    trajectories = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=3)
    (late,) = [t for t in trajectories if t.trajectory_id == open_tid]
    assert late.reward == 1.0
