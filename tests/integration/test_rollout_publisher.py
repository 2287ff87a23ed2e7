"""The publisher against a real broker: acknowledgements, backpressure, failures, broker restart."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlstream.ops.infra import start_kafka
from rlstream.ops.ports import free_port
from rlstream.transport.kafka import create_topics
from rlstream.transport.topic_reader import open_reader, read_to_end
from rlstream.rollout.publisher import PublishError, TrajectoryPublisher
from rlstream.schemas.codec import AvroCodec, PayloadTooLargeError
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from tests.support.factories import make_reward, make_trajectory


async def read_all(cfg: RlstreamConfig, topic: str) -> list[tuple[bytes, bytes]]:
    """Every (key, value) on ``topic`` up to its end offsets of now (the publisher waited for its acks)."""
    reader = await open_reader(cfg.kafka)
    try:
        return [(r.key, r.value) async for r in read_to_end(reader, topic)]
    finally:
        await reader.stop()


def test_acknowledged_events_are_on_the_topic_keyed_by_example(rl_config: RlstreamConfig,
                                                                created_topics: TopicNames) -> None:
    codec = AvroCodec()

    async def scenario() -> list[tuple[bytes, bytes]]:
        async with TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories,
                                                   created_topics.rewards, max_in_flight=4) as pub:
            events = [make_trajectory(run_id=rl_config.run_id, example_id=f"ex-{i % 3}", generation_index=i)
                      for i in range(12)]
            deliveries = [await pub.submit(pub.trajectories_topic, e.example_id, e) for e in events]
            assert pub.in_flight <= 4  # backpressure: never more than max_in_flight unacknowledged
            metas = await asyncio.gather(*deliveries)
            reward = await pub.publish_reward(make_reward(events[0], 0.5))
            await pub.flush()
            assert pub.stats.acknowledged == 13 and pub.stats.failed == 0
            # one example -> one partition
            parts = {}
            for e, m in zip(events, metas):
                parts.setdefault(e.example_id, set()).add(m.partition)
            assert all(len(p) == 1 for p in parts.values())
            assert reward.topic == created_topics.rewards
        return await read_all(rl_config, created_topics.trajectories)

    records = asyncio.run(scenario())
    assert len(records) == 12
    decoded = [codec.decode(v, TrajectoryEvent) for _, v in records]
    assert all(k.decode() == e.example_id for (k, _), e in zip(records, decoded))
    assert sorted(e.generation_index for e in decoded) == list(range(12))


def test_oversized_event_is_refused_before_sending(rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    async def scenario() -> None:
        async with TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories,
                                                   created_topics.rewards) as pub:
            big = make_trajectory(run_id=rl_config.run_id)
            big.metadata["blob"] = "x" * 2_000_000
            with pytest.raises(PayloadTooLargeError):
                await pub.publish_trajectory(big)
            assert pub.stats.submitted == 0 and pub.stats.acknowledged == 0
        with pytest.raises(PublishError, match="closed"):
            await pub.publish_reward(RewardEvent(trajectory_id="t", group_id="g", example_id="e", reward=1.0))

    asyncio.run(scenario())


def test_unacknowledged_delivery_reaches_the_caller(tmp_path: Path, rl_config: RlstreamConfig) -> None:
    port, data_dir = free_port(), tmp_path / "broker"
    broker = start_kafka(data_dir, port)
    cfg = rl_config.model_copy(deep=True)
    cfg.kafka.bootstrap_servers = broker.address
    cfg.kafka.request_timeout_ms = 2000
    topics = TopicNames.from_config(cfg.topics)

    async def scenario() -> None:
        nonlocal broker
        await create_topics(cfg.kafka, cfg.topics)
        pub = TrajectoryPublisher.from_config(cfg.kafka, topics.trajectories, topics.rewards, delivery_timeout_s=3)
        await pub.start()
        await pub.publish_trajectory(make_trajectory(run_id=cfg.run_id))
        broker.stop()  # the broker is gone: nothing more can be written
        with pytest.raises(PublishError, match="not acknowledged"):
            await pub.publish_trajectory(make_trajectory(run_id=cfg.run_id, example_id="unconfirmed"))
        assert pub.stats.acknowledged == 1 and pub.stats.unconfirmed == 1
        with pytest.raises(PublishError, match="not acknowledged"):
            await pub.flush()
        # the broker comes back: the idempotent producer's retries write the pending event exactly once
        broker = await asyncio.to_thread(start_kafka, data_dir, port)
        await pub.flush(timeout_s=60)
        assert pub.stats.acknowledged == 2 and pub.stats.failed == 0
        await pub.close()

    try:
        asyncio.run(scenario())
        records = asyncio.run(read_all(cfg, topics.trajectories))
    finally:
        broker.stop()
    ids = [AvroCodec().decode(v, TrajectoryEvent).example_id for _, v in records]
    assert sorted(ids) == ["ex-0", "unconfirmed"]


def test_no_acknowledged_event_is_lost_across_a_broker_restart(tmp_path: Path, rl_config: RlstreamConfig) -> None:
    port = free_port()
    data_dir = tmp_path / "broker"
    broker = start_kafka(data_dir, port)
    cfg = rl_config.model_copy(deep=True)
    cfg.kafka.bootstrap_servers = f"127.0.0.1:{port}"
    cfg.kafka.request_timeout_ms = 5000
    topics = TopicNames.from_config(cfg.topics)
    codec = AvroCodec()
    acked: set[str] = set()
    failed: set[str] = set()

    async def publish(pub: TrajectoryPublisher, event: TrajectoryEvent) -> None:
        try:
            await pub.publish_trajectory(event)
            acked.add(event.trajectory_id)
        except PublishError:
            failed.add(event.trajectory_id)

    async def scenario() -> None:
        nonlocal broker
        await create_topics(cfg.kafka, cfg.topics)
        pub = TrajectoryPublisher.from_config(cfg.kafka, topics.trajectories, topics.rewards, max_in_flight=8)
        await pub.start()
        first = [make_trajectory(run_id=cfg.run_id, example_id=f"a{i}") for i in range(20)]
        await asyncio.gather(*(publish(pub, e) for e in first))
        assert len(acked) == 20
        broker.stop()  # the broker goes away with events in flight
        second = [make_trajectory(run_id=cfg.run_id, example_id=f"b{i}") for i in range(20)]
        pending = asyncio.gather(*(publish(pub, e) for e in second))
        await asyncio.sleep(1.5)
        broker = await asyncio.to_thread(start_kafka, data_dir, port)  # same port, same data dir
        await pending
        try:
            await pub.close()
        except PublishError:
            pass  # failures were already reported to the callers above

    try:
        asyncio.run(scenario())
        records = asyncio.run(read_all(cfg, topics.trajectories))
    finally:
        broker.stop()
    on_topic = {codec.decode(v, TrajectoryEvent).trajectory_id for _, v in records}
    assert len(acked) >= 20
    assert acked <= on_topic, f"acknowledged but lost: {acked - on_topic}"
    assert len(acked) + len(failed) == 40


def test_the_sync_publisher_works_from_plain_threads(rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    """Synchronous code (no event loop of its own, several threads) publishes and gets acknowledgements."""
    from concurrent.futures import ThreadPoolExecutor

    from rlstream import SyncTrajectoryPublisher

    events = [make_trajectory(run_id=rl_config.run_id, example_id=f"sync-{i}") for i in range(6)]
    with SyncTrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories,
                                             created_topics.rewards) as pub:
        with ThreadPoolExecutor(3) as pool:
            metas = list(pool.map(pub.publish_trajectory, events))
        reward = pub.publish_reward(make_reward(events[0], 1.0))
        assert pub.stats.acknowledged == 7
    assert all(m.topic == created_topics.trajectories and m.offset >= 0 for m in metas)
    assert reward.topic == created_topics.rewards
    records = asyncio.run(read_all(rl_config, created_topics.trajectories))
    assert sorted(AvroCodec().decode(v, TrajectoryEvent).example_id for _, v in records) == sorted(
        e.example_id for e in events)
    with pytest.raises(RuntimeError):  # closed: the background loop is gone
        pub.publish_trajectory(events[0])
