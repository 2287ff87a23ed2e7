"""Hostile rewards from a foreign producer (confluent-kafka's Producer, not rlstream's client) written straight to
``rewards``: 1e200, -1e200, NaN, a reward and a component outside ``streams.reward_range``, and raw garbage. Each
reaches ``dlq`` with its reason, and the task they named keeps training: the later valid rewards of that
(policy, task) are grouped and reach ``groups`` with the baselines of the valid rewards alone, before and after a
restart of the worker. (Before ``streams.reward_range`` existed, 1e200 passed validation, entered the key's baseline
window, and every later reward of the key was dead-lettered for an OverflowError, across restarts: pinned at unit
level in tests/unit/test_streams_reward_range.py.)"""
from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from rlstream.streams import validation as v
from rlstream.streams.app import prepare_topics
from tests.support.factories import make_reward, make_trajectory
from tests.integration.test_streams_poison_pills import watch_dlq
from tests.support.streams_helpers import CODEC, Worker, publish, read_groups

TASK = "hostile"


def foreign_send(cfg: RlstreamConfig, topic: str, records: list[tuple[bytes, bytes]]) -> list[int]:
    """Send (key, value) records in order with librdkafka, partitioned as Kafka's Java client and aiokafka do
    (murmur2), so they land beside their trajectories; returns their offsets."""
    producer = Producer({"bootstrap.servers": cfg.kafka.bootstrap_servers, "partitioner": "murmur2_random",
                         "enable.idempotence": True, "linger.ms": 5})
    offsets: list[int] = []
    errors: list[str] = []

    def delivered(err: object, msg: object) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            offsets.append(msg.offset())  # type: ignore[attr-defined]

    for key, value in records:
        producer.produce(topic, value=value, key=key, on_delivery=delivered)
    assert producer.flush(30) == 0 and not errors, errors
    return offsets


def single(cfg: RlstreamConfig, i: int) -> TrajectoryEvent:
    return make_trajectory(run_id=cfg.run_id, example_id=TASK, group_id=f"req-{i}", group_size=1, reward=None,
                           policy=cfg.policy).model_copy(update={"metadata": {"task": TASK}})


def reward(t: TrajectoryEvent, value: float, **fields: object) -> tuple[bytes, bytes]:
    return TASK.encode(), CODEC.encode(make_reward(t, value).model_copy(update=fields))


def test_hostile_rewards_are_dead_lettered_and_their_task_keeps_training(rl_config: RlstreamConfig,
                                                                         tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    overrides = {"streams.group_timeout_s": 2, "streams.min_reward_diff": 0, "learner.baseline_min_count": 1}
    worker = Worker(rl_config, "w1", tmp_path, **overrides).start()
    try:
        singles = [single(rl_config, i) for i in range(5)]
        asyncio.run(publish(rl_config, [(names.trajectories, TASK.encode(), CODEC.encode(t)) for t in singles[:4]]))
        first = foreign_send(rl_config, names.rewards, [reward(singles[0], 0.2)])  # filtered: nothing before it
        hostile = {
            "1e200": reward(singles[1], 1e200),
            "-1e200": reward(singles[1], -1e200),
            "nan": reward(singles[1], math.nan),
            "out of range": reward(singles[1], 10.5),
            "component 1e200": reward(singles[1], 0.5, components={"judge": 1e200}),
            "1e200, another member": reward(singles[2], 1e200),
            "garbage": (TASK.encode(), b"\x00\x00\x00\x00\x07" + b"\xff" * 40),
        }
        reasons = {"nan": v.NON_FINITE_REWARD, "garbage": v.UNKNOWN_SCHEMA}
        offsets = dict(zip(hostile, foreign_send(rl_config, names.rewards, list(hostile.values()))))
        valid = foreign_send(rl_config, names.rewards, [reward(t, r) for t, r in zip(singles[1:4], [0.8, 0.5, 0.9])])
        assert first[0] < min(offsets.values()) < max(offsets.values()) < valid[0]

        letters = asyncio.run(watch_dlq(rl_config, names.dlq, {(names.rewards, o) for o in offsets.values()}, 60))
        for name, offset in offsets.items():
            assert (names.rewards, offset) in letters, f"{name}: no dead letter\n{worker.log_tail()}"
            letter = letters[(names.rewards, offset)][1]
            assert letter.error_type == reasons.get(name, v.REWARD_OUT_OF_RANGE), (name, letter.error_message)
            assert letter.value == hostile[name][1]  # the record as written, for a replay
        assert len(letters) == len(hostile), "a valid reward was dead-lettered"

        # the key trains on: each valid reward is scored against the valid ones before it (hand-computed:
        # [0.2] -> 0.2; [0.2, 0.8] -> 0.5, sqrt(0.18); [0.2, 0.8, 0.5] -> 0.5, 0.3)
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=3, timeout_s=60, quiet_s=2))
        assert worker.alive(), worker.log_tail()
        expected = {"req-1": (0.8, 0.2, 0.0, 1), "req-2": (0.5, 0.5, math.sqrt(0.18), 2), "req-3": (0.9, 0.5, 0.3, 3)}
        assert sorted(g.group_id for g in groups) == sorted(expected)
        for g in groups:
            r, mean, std, count = expected[g.group_id]
            assert g.trajectories[0].reward == r and g.baseline is not None
            assert (g.baseline.mean, g.baseline.std, g.baseline.count) == pytest.approx((mean, std, count))

        # and after a restart: the recovered baseline holds the four valid rewards only
        worker.stop()
        worker = Worker(rl_config, "w1", tmp_path, **overrides).start()
        asyncio.run(publish(rl_config, [(names.trajectories, TASK.encode(), CODEC.encode(singles[4]))]))
        time.sleep(1)
        foreign_send(rl_config, names.rewards, [reward(singles[4], 1e200), reward(singles[4], 0.1)])
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=4, timeout_s=90, quiet_s=2))
        after = [g for g in groups if g.group_id == "req-4"]
        assert len(after) == 1 and len(groups) == 4, worker.log_tail()
        b = after[0].baseline
        assert b is not None and (b.mean, b.count) == pytest.approx((0.6, 4)) and after[0].trajectories[0].reward == 0.1
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()
