"""The gate's real evaluation against a replica whose server fails (real broker and Redis; the replica is a scripted
OpenAI-compatible upstream): failed requests are retried and counted in ``gate/evaluation_request_failures``, the
evaluation fails and decides nothing; once the server answers, the same candidate is decided."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlstream.gate import service as gate_service
from rlstream.gate.evaluation import EvaluationSet
from rlstream.gate.service import PromotionGate
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, MetricEvent, PolicyVersion, PromotionDecision
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from tests.support.gate_helpers import serving_fleet
from tests.support.scripted_upstream import Reply, completion, scripted_upstream
from tests.support.learner_helpers import read_whole_topic

pytestmark = pytest.mark.integration
CODEC = AvroCodec()
EXAMPLES = 4


def reward(example: dict[str, Any], text: str) -> float:
    return 1.0 if "yes" in text else 0.0


def test_a_failing_replica_decides_nothing_and_counts_its_failed_requests_then_a_healthy_one_decides(
        rl_config: RlstreamConfig, created_topics: TopicNames, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = rl_config.model_copy(update={"gate": rl_config.gate.model_copy(update={
        "canary_share": 0.0, "load_timeout_s": 10.0, "examples": EXAMPLES, "samples": 1})})
    monkeypatch.setattr(gate_service, "ERROR_BACKOFF_S", 0.0)
    healthy = {"now": False}

    def server(body: dict[str, Any]) -> Reply:
        # half the answers earn 1, by seed: the same for both versions, so they pair exactly
        return completion(body["model"], "yes" if body["seed"] % 2 else "no") if healthy["now"] else 500

    async def scenario() -> tuple[list[PromotionDecision], list[PromotionDecision], int]:
        async with scripted_upstream(server) as upstream:
            control = ControlPlane(str(cfg.redis.url))
            await serving_fleet(cfg, control, url=upstream.url.removesuffix("/v1"))
            evaluation = EvaluationSet(examples=[{"id": str(i), "prompt": f"q{i}"} for i in range(EXAMPLES)],
                                       reward_function=reward, samples=1, retries=2, retry_backoff_s=0.01)
            gate = PromotionGate(cfg, control, evaluation, codec=CODEC)
            await gate._start()
            try:
                gate.known[2] = PolicyVersion(policy=gate.policy, version=2, base_model="m", uri="/v2",
                                              learner_step=2)
                await gate.step()
                after_failure = list(gate.decisions)
                failed_requests = len(upstream.requests)
                healthy["now"] = True
                await gate.step()
            finally:
                await gate._stop()
                await control.close()
            return after_failure, gate.decisions, failed_requests

    after_failure, decided, failed_requests = asyncio.run(scenario())
    assert after_failure == []  # the failed evaluation decided nothing
    assert [(d.version, d.decision) for d in decided] == [(2, DecisionKind.promote)], [d.reason for d in decided]
    metrics = asyncio.run(read_whole_topic(cfg, created_topics.metrics, MetricEvent))
    requests = [m for m in metrics if m.name == mn.GATE_EVALUATION_REQUEST_FAILURES]
    assert requests and {(m.step, m.tags.get("role"), m.tags.get("reason")) for m in requests} == {
        (2, "candidate", "status_500")}
    # every failed attempt answered is counted: at least one sample's first try and its two retries (requests still
    # in flight when the evaluation gave up are cancelled)
    assert 3 <= len(requests) <= failed_requests
    assert [(m.step, m.tags.get("role")) for m in metrics if m.name == mn.GATE_EVALUATION_FAILURES] == [
        (2, "candidate")]
