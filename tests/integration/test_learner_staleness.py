"""On the real broker: the learner drops, counts and consumes groups whose oldest trained turn is more than
``streams.max_policy_lag`` versions behind the version it trains on top of (a backlog left while it was down), and
judges a session that straddles a reload by each turn's own version. Negative control: with the limit out of reach
the same records all train (staleness decided only when streams emits a group)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlstream.learner.service import SKIP_STALE, Learner
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import MetricEvent, PolicyVersion, TrajectoryGroup
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.kafka import make_producer
from tests.support.learner_helpers import random_group, read_topic, read_whole_topic, tiny_model

CODEC = AvroCodec()
PARTITION = 0


def at_version(group: TrajectoryGroup, version: int) -> TrajectoryGroup:
    for trajectory in group.trajectories:
        trajectory.policy_version = version
    return group.model_copy(update={"min_policy_version": version, "max_policy_version": version})


async def place(cfg: RlstreamConfig, topic: str, groups: list[TrajectoryGroup]) -> list[int]:
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        return [(await producer.send_and_wait(topic, CODEC.encode(g), key=g.example_id.encode(),
                                              partition=PARTITION)).offset for g in groups]
    finally:
        await producer.stop()


@pytest.mark.parametrize("max_policy_lag", [0, 1000], ids=["lag-0", "control-no-limit"])
def test_stale_groups_are_dropped_counted_and_consumed(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                        tmp_path: Path, max_policy_lag: int) -> None:
    cfg = rl_config.model_copy(update={
        "streams": rl_config.streams.model_copy(update={"max_policy_lag": max_policy_lag}),
        "learner": rl_config.learner.model_copy(update={
            "model": str(tiny_model(tmp_path)), "lora": rl_config.learner.lora.model_copy(update={"enabled": True}),
            "groups_per_step": 1, "publish_every": 1, "total_steps": 3, "device": "cpu", "lease_ttl_s": 3.0})})
    fresh_0 = at_version(random_group(cfg.policy, cfg.run_id, 0), 0)  # step 1 trains on top of version 0
    stale_0 = at_version(random_group(cfg.policy, cfg.run_id, 1), 0)  # step 2 (version 1): one behind
    fresh_1 = at_version(random_group(cfg.policy, cfg.run_id, 2), 1)
    straddled = at_version(random_group(cfg.policy, cfg.run_id, 3), 2)  # step 3 (version 2)
    straddled.trajectories[1].turns[0].policy_version = 1  # its session's first call came before the reload
    untagged = at_version(random_group(cfg.policy, cfg.run_id, 4), 2)  # the same, turns without their version
    later = at_version(random_group(cfg.policy, cfg.run_id, 5), 2)
    offsets = asyncio.run(place(cfg, created_topics.groups, [fresh_0, stale_0, fresh_1, straddled, untagged, later]))

    learner = Learner(cfg, holder="staleness-test")
    state = asyncio.run(learner.run())

    versions = asyncio.run(read_topic(cfg, created_topics.policy_versions, PolicyVersion, expect=4))
    assert [v.version for v in versions] == [0, 1, 2, 3]  # the base weights, then one version per step
    trained = sorted(o for v in versions for r in v.trained_on for o in range(r.first, r.last + 1))
    metrics = asyncio.run(read_whole_topic(cfg, created_topics.metrics, MetricEvent))
    stale_counts = [m.value for m in metrics if m.name == mn.LEARNER_GROUPS_SKIPPED
                    and m.tags.get("reason") == SKIP_STALE]
    lag_max = [m.value for m in metrics if m.name == mn.LEARNER_POLICY_LAG_MAX]
    assert state.step == 3 and state.groups_trained == 3
    if max_policy_lag == 0:
        assert trained == [offsets[0], offsets[2], offsets[4]]
        assert dict(learner.skipped) == {SKIP_STALE: 2}
        assert state.offsets == {PARTITION: offsets[4] + 1}  # the dropped groups are consumed, never retried
        assert stale_counts[-1] == 2.0
        assert lag_max == [0.0, 0.0, 0.0]  # what trained was never behind
    else:  # the old behaviour: everything trains whatever its lag
        assert trained == [offsets[0], offsets[1], offsets[2]]
        assert not learner.skipped and not stale_counts
        assert lag_max == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("gate_holds_serving", [True, False], ids=["serving-held-at-0", "control-no-gate"])
def test_under_a_gate_groups_of_the_serving_version_are_not_stale(rl_config: RlstreamConfig,
                                                                  created_topics: TopicNames, tmp_path: Path,
                                                                  gate_holds_serving: bool) -> None:
    """A gate that keeps serving at version 0 while the learner moves on: the rollout can only sample version 0, so
    its groups train (judged against the serving version). Control: without a serving pointer the same groups are
    stale from the learner's second step on and the learner, with nothing it may train, makes no version."""
    from rlstream.transport.control import ControlPlane
    from rlstream.transport.serving import ServingControl

    cfg = rl_config.model_copy(update={
        "streams": rl_config.streams.model_copy(update={"max_policy_lag": 0}),
        "learner": rl_config.learner.model_copy(update={
            "model": str(tiny_model(tmp_path)), "lora": rl_config.learner.lora.model_copy(update={"enabled": True}),
            "groups_per_step": 1, "publish_every": 1, "total_steps": 3, "device": "cpu", "lease_ttl_s": 3.0})})
    groups = [at_version(random_group(cfg.policy, cfg.run_id, i), 0) for i in range(3)]

    async def scenario() -> tuple[Learner, int]:
        control = ControlPlane(cfg.redis.url)
        try:
            if gate_holds_serving:
                serving = ServingControl(control)
                await serving.promote(cfg.policy, 0, token=await serving.issue_token(cfg.policy),
                                      reason="the gate holds serving here", decided_by="test", expected_version=-1)
        finally:
            await control.close()
        await place(cfg, created_topics.groups, groups)
        learner = Learner(cfg, holder="gate-staleness-test")
        run = asyncio.create_task(learner.run())
        deadline = asyncio.get_running_loop().time() + 120
        while not run.done() and learner.skipped[SKIP_STALE] < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
        learner.request_stop()
        return learner, (await run).step

    learner, steps = asyncio.run(scenario())
    if gate_holds_serving:
        assert steps == 3 and not learner.skipped
    else:
        assert steps == 1 and learner.skipped[SKIP_STALE] == 2


def test_the_streams_tracker_follows_the_serving_pointer(rl_config: RlstreamConfig,
                                                         created_topics: TopicNames) -> None:
    """Streams judges staleness the way the learner does: it reads the gate's serving pointer from Redis (gone
    again when there is none), next to the latest version."""
    from rlstream.streams.policy import PolicyTracker
    from rlstream.transport.control import ControlPlane
    from rlstream.transport.serving import ServingControl

    async def scenario() -> tuple[int | None, int | None, int | None]:
        control = ControlPlane(rl_config.redis.url)
        serving = ServingControl(control)
        tracker = PolicyTracker(rl_config, created_topics.policy_versions, CODEC, redis_poll_s=0.1)
        task = asyncio.create_task(tracker.run())

        async def seen(expected: int | None) -> int | None:
            for _ in range(100):
                if tracker.serving_of(rl_config.policy) == expected:
                    break
                await asyncio.sleep(0.05)
            return tracker.serving_of(rl_config.policy)

        try:
            before = await seen(None)
            await serving.promote(rl_config.policy, 3, token=await serving.issue_token(rl_config.policy),
                                  reason="promoted", decided_by="test", expected_version=-1)
            held = await seen(3)
            await serving.promote(rl_config.policy, 5, token=await serving.issue_token(rl_config.policy),
                                  reason="promoted", decided_by="test", expected_version=3)
            return before, held, await seen(5)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await control.close()

    assert asyncio.run(scenario()) == (None, 3, 5)
