"""The session's real broker and Redis: topics, an idempotent producer, a consumer group, the control plane."""
from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from rlstream.transport.control import ControlPlane, LeaseLost
from rlstream.transport.kafka import client_options, create_topics, list_topics, make_consumer, make_producer
from rlstream.schemas.codec import AvroCodec, codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from tests.support.factories import make_trajectory


async def test_create_topics_is_idempotent_with_configured_partitions(rl_config: RlstreamConfig) -> None:
    names = TopicNames.from_config(rl_config.topics)
    first = await create_topics(rl_config.kafka, rl_config.topics)
    assert first == {t: "created" for t in names.all()}
    second = await create_topics(rl_config.kafka, rl_config.topics)
    assert second == {t: "exists" for t in names.all()}
    on_broker = await list_topics(rl_config.kafka)
    assert {t: on_broker.get(t) for t in names.all()} == {t: rl_config.topics.partitions for t in names.all()}


async def test_topics_carry_the_configured_retention(rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    admin = AIOKafkaAdminClient(**client_options(rl_config.kafka))
    await admin.start()
    try:
        topics = [created_topics.trajectories, created_topics.policy_versions]
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in topics])
    finally:
        await admin.close()
    retention = {}
    for response in responses:
        for resource in response.resources:
            name, entries = resource[3], resource[4]
            retention[name] = next(e[1] for e in entries if e[0] == "retention.ms")
    assert retention == {created_topics.trajectories: str(rl_config.topics.retention_ms),
                         created_topics.policy_versions: str(rl_config.topics.policy_versions_retention_ms)}


async def test_idempotent_producer_and_consumer_group(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                      consumer_group: str) -> None:
    codec = codec_for(rl_config)
    sent = [make_trajectory(example_id=f"ex-{i}", seed=i) for i in range(6)]
    producer = make_producer(rl_config.kafka)
    await producer.start()
    try:
        # the broker granted a producer id: the idempotent handshake (InitProducerId) happened
        assert producer._txn_manager is not None and producer._txn_manager.producer_id >= 0
        for event in sent:
            await producer.send_and_wait(created_topics.trajectories, codec.encode(event),
                                         key=event.group_id.encode())
    finally:
        await producer.stop()

    consumer = make_consumer(rl_config.kafka, created_topics.trajectories, group_id=consumer_group)
    await consumer.start()
    try:
        received: list[TrajectoryEvent] = []
        async def drain() -> None:
            while len(received) < len(sent):
                batch = await consumer.getmany(timeout_ms=500)
                received.extend(codec.decode(r.value, TrajectoryEvent) for rs in batch.values() for r in rs)
        await asyncio.wait_for(drain(), timeout=30)
        await consumer.commit()
        assigned = consumer.assignment()
        committed = {tp: await consumer.committed(tp) for tp in assigned}
    finally:
        await consumer.stop()
    assert sorted(e.trajectory_id for e in received) == sorted(e.trajectory_id for e in sent)
    assert len(assigned) == rl_config.topics.partitions
    assert sum(v or 0 for v in committed.values()) == len(sent)  # exactly once each, committed by the group

    # the same group resumes after its commit: nothing is read again
    again = make_consumer(rl_config.kafka, created_topics.trajectories, group_id=consumer_group)
    await again.start()
    try:
        await asyncio.sleep(0)
        batch = await again.getmany(timeout_ms=1500)
        positions = {tp: await again.position(tp) for tp in again.assignment()}
    finally:
        await again.stop()
    assert not any(batch.values())
    assert sum(positions.values()) == len(sent)
    assert all(isinstance(tp, TopicPartition) for tp in positions)


async def test_redis_answers(rl_config: RlstreamConfig) -> None:
    control = ControlPlane(rl_config.redis.url)
    try:
        assert await control.redis.ping()
    finally:
        await control.close()


async def test_publish_latest_only_moves_forward(rl_config: RlstreamConfig) -> None:
    control = ControlPlane(rl_config.redis.url)
    policy = rl_config.policy
    try:
        assert await control.latest_version(policy) == -1
        assert await control.publish_latest(policy, 2, "file:///v2", "aa")
        assert not await control.publish_latest(policy, 1, "file:///v1", "bb")
        assert not await control.publish_latest(policy, 2, "file:///v2b", "cc")
        assert await control.latest_version(policy) == 2
        assert (await control.latest(policy))["uri"] == "file:///v2"
        assert await control.publish_latest(policy, 3, "file:///v3", "dd")
        assert await control.latest_version(policy) == 3
    finally:
        await control.close()


async def test_lease_fencing_stops_a_second_holder(rl_config: RlstreamConfig) -> None:
    control = ControlPlane(rl_config.redis.url)
    policy = rl_config.policy
    try:
        first = await control.acquire_lease(policy, "learner-a", ttl_s=0.3)
        assert first is not None
        assert await control.acquire_lease(policy, "learner-b", ttl_s=5) is None  # held
        assert await control.publish_latest(policy, 1, "file:///a1", "x", lease=first)

        await asyncio.sleep(0.5)  # a's lease expires (e.g. a paused learner); b takes over
        second = await control.acquire_lease(policy, "learner-b", ttl_s=5)
        assert second is not None and second.token > first.token
        with pytest.raises(LeaseLost):
            await control.publish_latest(policy, 2, "file:///a2", "x", lease=first)
        with pytest.raises(LeaseLost):
            await control.renew_lease(policy, first, ttl_s=5)
        assert await control.latest_version(policy) == 1
        assert await control.publish_latest(policy, 2, "file:///b2", "y", lease=second)
        await control.release_lease(policy, first)  # a stale holder cannot release b's lease
        assert await control.lease_holder(policy) == second.value
        await control.release_lease(policy, second)
        assert await control.lease_holder(policy) is None
    finally:
        await control.close()


def test_services_die_with_a_killed_parent(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A test run killed by a timeout must not leave its broker and Redis running."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from rlstream.ops.processes import pid_alive

    script = ("import sys, time; from rlstream.ops.infra import LocalStack; s = LocalStack.start(sys.argv[1]); "
              "print('PIDS', s.kafka.pid, s.redis.pid, flush=True); time.sleep(120)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "stack")], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while not line.startswith("PIDS"):  # structlog's default output shares stdout
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, "the child exited before starting its services"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids), "services outlived their killed parent"
