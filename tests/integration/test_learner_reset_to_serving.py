"""On the real broker and Redis, with the tiny model: a gate that rejects every candidate while serving stays at
version 0. The learner never gets more than ``learner.max_versions_ahead_of_serving`` versions ahead of serving: after
``learner.reset_after_rejections`` rejections (records on ``promotions``, as the gate writes them) it moves back to
version 0's published weights, resets its optimizer, says so (log, ``learner/resets_to_serving``, run status) and
publishes its next versions from there. Negative control: with the reset and the bound off, the same run drifts
past the bound."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlstream.learner.service import Learner
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, MetricEvent, PolicyVersion, PromotionDecision, TrajectoryGroup
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_producer
from rlstream.transport.serving import ServingControl, publish_decision
from tests.support.learner_helpers import random_group, read_topic, read_whole_topic, tiny_model

pytestmark = pytest.mark.integration

CODEC = AvroCodec()
BOUND = 3
STEPS = 8


def at_version_0(group: TrajectoryGroup) -> TrajectoryGroup:
    for trajectory in group.trajectories:
        trajectory.policy_version = 0
    return group.model_copy(update={"min_policy_version": 0, "max_policy_version": 0})


async def rejecting_gate(cfg: RlstreamConfig, topic: str, stop: asyncio.Event) -> list[int]:
    """Reject every version the learner announces (serving stays at 0), as the gate records its decisions."""
    control = ControlPlane(cfg.redis.url)
    producer = make_producer(cfg.kafka)
    await producer.start()
    judged = 0
    rejected: list[int] = []
    try:
        while not stop.is_set():
            latest = await control.latest_version(cfg.policy)
            for version in range(judged + 1, latest + 1):
                await publish_decision(producer, CODEC, topic, PromotionDecision(
                    policy=cfg.policy, version=version, decision=DecisionKind.reject, serving_before=0,
                    reason="candidate below serving", decided_by="test-gate"))
                rejected.append(version)
            judged = max(judged, latest)
            await asyncio.sleep(0.1)
        return rejected
    finally:
        await producer.stop()
        await control.close()


@pytest.mark.parametrize("reset", [True, False], ids=["reset-after-2-rejections", "control-no-reset-no-bound"])
def test_rejections_move_the_learner_back_to_serving_and_the_lag_stays_bounded(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path, reset: bool) -> None:
    cfg = rl_config.model_copy(update={
        "streams": rl_config.streams.model_copy(update={"max_policy_lag": 1000}),
        "learner": rl_config.learner.model_copy(update={
            "model": str(tiny_model(tmp_path)), "lora": rl_config.learner.lora.model_copy(update={"enabled": True}),
            "groups_per_step": 1, "publish_every": 1, "total_steps": STEPS, "device": "cpu", "lease_ttl_s": 5.0,
            "max_versions_ahead_of_serving": BOUND if reset else None,
            "reset_after_rejections": 2 if reset else 0})})
    groups = [at_version_0(random_group(cfg.policy, cfg.run_id, i)) for i in range(STEPS)]

    async def scenario() -> tuple[Learner, int, list[int], dict[str, str]]:
        control = ControlPlane(cfg.redis.url)
        try:
            serving = ServingControl(control)
            await serving.promote(cfg.policy, 0, token=await serving.issue_token(cfg.policy),
                                  reason="version 0 serves first", decided_by="test", expected_version=-1)
            producer = make_producer(cfg.kafka)
            await producer.start()
            try:
                for g in groups:
                    await producer.send_and_wait(created_topics.groups, CODEC.encode(g), key=g.example_id.encode(),
                                                 partition=0)
            finally:
                await producer.stop()
            stop = asyncio.Event()
            gate = asyncio.create_task(rejecting_gate(cfg, created_topics.promotions, stop))
            learner = Learner(cfg, holder="reset-test")
            run = asyncio.create_task(learner.run())
            done, _ = await asyncio.wait({run}, timeout=240)
            if not done:
                learner.request_stop()
            steps = (await run).step
            stop.set()
            rejected = await gate
            return learner, steps, rejected, await control.status(cfg.run_id)
        finally:
            await control.close()

    learner, steps, rejected, status = asyncio.run(scenario())
    versions = asyncio.run(read_topic(cfg, created_topics.policy_versions, PolicyVersion, expect=STEPS + 1))
    metrics = asyncio.run(read_whole_topic(cfg, created_topics.metrics, MetricEvent))
    ahead = [m.value for m in metrics if m.name == mn.LEARNER_VERSIONS_AHEAD_OF_SERVING]
    resets = [m.value for m in metrics if m.name == mn.LEARNER_RESETS_TO_SERVING]
    assert steps == STEPS and [v.version for v in versions] == list(range(STEPS + 1))
    assert rejected and ahead
    if reset:
        assert max(ahead) <= BOUND  # never more than the bound ahead of serving, through every rejection
        assert 0.0 in ahead  # right after a move back
        state_resets = resets[-1]
        assert state_resets >= 2  # 8 versions, a move back every two rejected ones at the latest
        assert status["learner_resets_to_serving"] == str(int(state_resets)) and status["learner_reset_to"] == "0"
        assert int(status["learner_versions_ahead_of_serving"]) <= BOUND
    else:
        assert max(ahead) == STEPS > BOUND  # the learner drifts on: every version one further from serving
        assert set(resets) == {0.0} and status["learner_reset_to"] == ""
