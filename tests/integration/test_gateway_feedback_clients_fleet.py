"""The real feedback clients (the Langfuse Python SDK, the LangSmith client, the OpenTelemetry SDK's OTLP/HTTP log
exporter) scoring calls by id on a gateway that did not serve them: two gateways sharing Redis behind the project's
round-robin balancer, then a restart of both between the calls and the last scores. Each client reports success and
each reward reaches ``rewards`` once with its value. The negative control, gateways that keep the ids in memory and
answer 404 on the other gateway and after a restart, is
``tests/integration/test_gateway_shared_state.py::test_control_ids_in_one_gateways_memory_are_404_elsewhere``."""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import httpx
import pytest

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import RewardEvent
from tests.integration.test_gateway_shared_state import ACME, chat, fleet, port_of
from tests.support.fleet_support import RoundRobinProxy, canned_replica
from tests.support.learner_helpers import read_topic
from tests.support.otel_feedback import otel_evaluation

pytestmark = pytest.mark.integration


def langfuse_score(base: str, trace_id: str, value: float) -> None:
    """One NUMERIC score by the Langfuse SDK (a client of its own: the SDK keeps one per public key)."""
    from langfuse import Langfuse

    client = Langfuse(public_key=f"pk-lf-{uuid.uuid4().hex[:8]}", secret_key=ACME, base_url=base)
    client.create_score(name="quality", value=value, trace_id=trace_id, data_type="NUMERIC")
    client.flush()
    client.shutdown()


def langsmith_feedback(base: str, run_id: str, score: float) -> None:
    """One LangSmith feedback on a run; raises what the client raises for a refusal."""
    import langsmith

    langsmith.Client(api_url=base, api_key=ACME).create_feedback(run_id=run_id, key="correctness", score=score)


async def score_with_clients(base: str, calls: list[httpx.Response], values: list[float]) -> tuple[bool, bool, bool]:
    """Langfuse on the first call, LangSmith on the second, OTel on the third, each at ``base``: whether each client
    reports success."""
    tids = [c.headers["x-rlstream-trajectory-id"] for c in calls]
    langfuse_logger = logging.getLogger("langfuse")
    errors: list[str] = []

    class Errors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record.getMessage())

    handler = Errors(level=logging.ERROR)
    langfuse_logger.addHandler(handler)
    try:
        await asyncio.to_thread(langfuse_score, base, tids[0], values[0])
    finally:
        langfuse_logger.removeHandler(handler)
    try:
        await asyncio.to_thread(langsmith_feedback, base, tids[1], values[1])
        langsmith_ok = True
    except Exception:  # the client's error for a refused feedback (LangSmithNotFoundError and kin)
        langsmith_ok = False
    otel_ok = await asyncio.to_thread(otel_evaluation, base, ACME, calls[2].json()["id"], "relevance",
                                      {"gen_ai.evaluation.score.value": values[2]})
    return not errors, langsmith_ok, otel_ok


async def test_real_clients_score_on_the_other_gateway_and_after_a_restart(
        rl_config: RlstreamConfig, created_topics: Any, tmp_path: Any) -> None:
    async with fleet(rl_config, tmp_path, shared=True) as gateways, canned_replica() as replica, \
            httpx.AsyncClient(timeout=30) as http:
        urls = [await gateways.start(replica), await gateways.start(replica)]
        served: list[tuple[int, httpx.Response]] = []
        async with RoundRobinProxy([("127.0.0.1", port_of(u)) for u in urls]).running() as proxy:
            for n in range(8):
                before = list(proxy.connections)
                answer = await chat(http, proxy.url, ACME, f"call {n}")
                served.append(([a - b for a, b in zip(proxy.connections, before)].index(1), answer))
        assert {s for s, _ in served} == {0, 1}
        # three calls one gateway served, scored by each client on the other one
        by_first = [c for s, c in served if s == 0][:3]
        by_second = [c for s, c in served if s == 1][:3]
        assert len(by_first) == 3 and len(by_second) == 3
        across = await score_with_clients(urls[1], by_first, [0.1, 0.2, 0.3])

        await gateways.stop_all()  # both gone: a fresh gateway on the same Redis
        fresh = await gateways.start(replica)
        restarted = await score_with_clients(fresh, by_second, [0.4, 0.5, 0.6])
        await gateways.stop_all()

    rewards = await read_topic(rl_config, created_topics.rewards, RewardEvent, expect=7, timeout_s=8)
    assert (across, restarted) == ((True, True, True), (True, True, True))
    want = {c.headers["x-rlstream-trajectory-id"]: v
            for c, v in zip(by_first + by_second, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])}
    assert sorted(r.trajectory_id for r in rewards) == sorted(want)  # each once
    assert {r.trajectory_id: r.reward for r in rewards} == pytest.approx(want)
