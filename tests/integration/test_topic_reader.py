"""The typed topic reader on the real broker: valid records decode with their source, a corrupt one goes to
``dlq`` with its reason and the reader goes on with the records after it; without a sink nothing is dead-lettered.
Also the one wait for a topic's partitions, and the services that read through it (learner, sync worker,
finetune collector) dead-letter as before."""
from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition

from rlstream.schemas.codec import AvroCodec, CodecError
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, MetricEvent, PolicyVersion, TrajectoryEvent
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.kafka import create_topics, make_producer
from rlstream.transport.topic_reader import (Decoded, SourceRecord, TopicMissingError, TopicReader, open_reader,
                                             read_to_end, wait_for_partitions)
from tests.support.factories import make_trajectory
from tests.support.learner_helpers import random_group, read_topic
from tests.support.ops_helpers import read_all

CODEC = AvroCodec()
PARTITION = 2


async def place(cfg: RlstreamConfig, topic: str, values: list[tuple[bytes, bytes]]) -> list[int]:
    """Send ``(key, value)`` pairs in order to one partition; returns their offsets."""
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        offsets = []
        for key, value in values:
            meta = await producer.send_and_wait(topic, value, key=key, partition=PARTITION)
            offsets.append(meta.offset)
        return offsets
    finally:
        await producer.stop()


def mixed_records(cfg: RlstreamConfig) -> tuple[list[TrajectoryEvent], list[tuple[bytes, bytes]]]:
    """valid, truncated (corrupt), valid, a MetricEvent (wrong type for the topic), valid."""
    good = [make_trajectory(run_id=cfg.run_id, example_id=f"ex{i}", generation_index=i, seed=i) for i in range(3)]
    corrupt = CODEC.encode(good[0])[:40]
    wrong = MetricEvent(source="test", run_id=cfg.run_id, name="not/a/trajectory", value=1.0)
    values = [(b"ex0", CODEC.encode(good[0])), (b"bad", corrupt), (b"ex1", CODEC.encode(good[1])),
              (b"wrong", CODEC.encode(wrong)), (b"ex2", CODEC.encode(good[2]))]
    return good, values


async def fetch_until(reader: TopicReader[TrajectoryEvent], tp: TopicPartition, end: int,
                      timeout_s: float = 30.0) -> list[Decoded[TrajectoryEvent]]:
    """Call fetch() until the reader's position passed ``end``."""
    out: list[Decoded[TrajectoryEvent]] = []
    deadline = time.monotonic() + timeout_s
    while await reader.consumer.position(tp) < end:
        assert time.monotonic() < deadline, f"reader stuck at {await reader.consumer.position(tp)} of {end}"
        out.extend(await reader.fetch(tp, timeout_ms=300))
    return out


async def test_decodes_and_dead_letters_then_goes_on(rl_config, created_topics):
    topic = created_topics.trajectories
    good, values = mixed_records(rl_config)
    offsets = await place(rl_config, topic, values)

    consumer = await open_reader(rl_config.kafka)
    producer = make_producer(rl_config.kafka)
    await producer.start()
    try:
        tp = TopicPartition(topic, PARTITION)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        reader = TopicReader(consumer, CODEC, TrajectoryEvent,
                             dead_letters=DeadLetterSink(producer, CODEC, created_topics.dlq, "reader-test"))
        items = await fetch_until(reader, tp, offsets[-1] + 1)
        # a reason found by the caller in a decoded event: dead-lettered the same way
        await reader.reject(items[0].source, "caller says no")
    finally:
        await producer.stop()
        await consumer.stop()

    # the valid ones, typed, in order, with their source records - including the ones after the bad records
    assert [i.event for i in items] == good
    assert [i.source for i in items] == [
        SourceRecord(topic, PARTITION, offsets[n], values[n][0], values[n][1]) for n in (0, 2, 4)]
    assert (reader.seen, reader.rejected) == (5, 3)

    letters = sorted((e for _, _, e in await read_all(rl_config, created_topics.dlq, DeadLetter)),
                     key=lambda d: (d.source_offset, d.error_type))
    assert [(d.source_topic, d.source_partition, d.source_offset, d.key, d.value) for d in letters] == [
        (topic, PARTITION, offsets[0], b"ex0", values[0][1]),
        (topic, PARTITION, offsets[1], b"bad", values[1][1]),
        (topic, PARTITION, offsets[3], b"wrong", values[3][1])]
    caller, corrupt, wrong = letters
    assert (caller.error_type, caller.error_message) == ("rejected", "caller says no")
    assert corrupt.error_type == "CorruptPayloadError" and "truncated" in corrupt.error_message
    assert wrong.error_type == "IncompatibleSchemaError" and "MetricEvent" in wrong.error_message
    assert {d.service for d in letters} == {"reader-test"}


async def test_without_a_sink_nothing_is_dead_lettered(rl_config, created_topics):
    """The negative control: read-only tools get the rejects on their callback, and dlq stays empty."""
    topic = created_topics.trajectories
    good, values = mixed_records(rl_config)
    offsets = await place(rl_config, topic, values)
    rejected: list[tuple[SourceRecord, BaseException | str]] = []

    consumer = await open_reader(rl_config.kafka)
    try:
        reader = TopicReader(consumer, CODEC, TrajectoryEvent, on_reject=lambda s, r: rejected.append((s, r)))
        items = [item async for item in reader.stream(read_to_end(consumer, topic))]
        silent = TopicReader(consumer, CODEC, TrajectoryEvent)  # neither sink nor callback: skipped quietly
        assert [i.event for i in [item async for item in silent.stream(read_to_end(consumer, topic))]] == good
    finally:
        await consumer.stop()

    assert [i.event for i in items] == good
    assert [(s.offset, s.key, type(r).__name__) for s, r in rejected] == [
        (offsets[1], b"bad", "CorruptPayloadError"), (offsets[3], b"wrong", "IncompatibleSchemaError")]
    assert all(isinstance(r, CodecError) for _, r in rejected)
    assert (reader.seen, reader.rejected, silent.rejected) == (5, 2, 2)
    assert await read_all(rl_config, created_topics.dlq, DeadLetter) == []


async def test_wait_for_partitions(rl_config, created_topics):
    consumer = await open_reader(rl_config.kafka)
    try:
        tps = await wait_for_partitions(consumer, created_topics.groups, timeout_s=0)
        assert tps == [TopicPartition(created_topics.groups, p) for p in range(4)]

        started = time.monotonic()
        with pytest.raises(TopicMissingError, match="does not exist"):
            await wait_for_partitions(consumer, f"{created_topics.prefix}nope", timeout_s=0.6, poll_s=0.1)
        assert time.monotonic() - started >= 0.6

        # a topic created while someone waits for it
        later = rl_config.topics.model_copy(update={"prefix": f"{created_topics.prefix}later."})

        async def create_soon() -> None:
            await asyncio.sleep(0.5)
            await create_topics(rl_config.kafka, later)

        found, _ = await asyncio.gather(
            wait_for_partitions(consumer, f"{later.prefix}groups", timeout_s=30.0), create_soon())
        assert [tp.partition for tp in found] == [0, 1, 2, 3]
    finally:
        await consumer.stop()


async def test_the_learner_dead_letters_through_the_reader_and_trains_on(rl_config, created_topics, tmp_path):
    """A corrupt record goes to dlq (service learner) and a group of another policy is skipped and counted; both
    are consumed all the same, and the step trains on the usable groups after them (trained_on: exactly those)."""
    from rlstream.learner.service import Learner
    from tests.support.learner_helpers import tiny_model

    cfg = rl_config.model_copy(update={"learner": rl_config.learner.model_copy(update={
        "model": str(tiny_model(tmp_path)), "lora": rl_config.learner.lora.model_copy(update={"enabled": True}),
        "groups_per_step": 2, "publish_every": 1, "total_steps": 1, "device": "cpu", "lease_ttl_s": 3.0})})
    good = [random_group(cfg.policy, cfg.run_id, i) for i in range(2)]
    other = random_group("another-policy", cfg.run_id, 7)
    values = [(b"bad", CODEC.encode(good[0])[:40]), (b"other", CODEC.encode(other))] + \
        [(g.example_id.encode(), CODEC.encode(g)) for g in good]
    offsets = await place(cfg, created_topics.groups, values)

    learner = Learner(cfg, holder="reader-test")
    state = await learner.run()

    assert state.step == 1 and state.offsets == {PARTITION: offsets[-1] + 1}
    base, version = await read_topic(cfg, created_topics.policy_versions, PolicyVersion, expect=2)
    assert (base.version, version.version, version.group_count) == (0, 1, 2)  # the base weights, then the step's
    assert [(r.partition, r.first, r.last) for r in version.trained_on] == [(PARTITION, offsets[2], offsets[3])]
    letters = await read_topic(cfg, created_topics.dlq, DeadLetter, expect=1)
    assert [(d.source_offset, d.key, d.error_type, d.service) for d in letters] == [
        (offsets[0], b"bad", "CorruptPayloadError", "learner")]
    assert learner.skipped == {"other_policy": 1}


async def test_the_sync_worker_dead_letters_undecodable_versions_and_keeps_following(rl_config, created_topics):
    """Catch-up and follow both go through the reader: undecodable records go to dlq, others' versions are skipped."""
    from rlstream.inference.sync import InferenceSyncWorker
    from rlstream.transport.control import ControlPlane

    other = PolicyVersion(policy="another-policy", version=3, base_model="tiny", uri="file:///x", learner_step=3)
    await place(rl_config, created_topics.policy_versions, [(b"bad", b"\x00\x01junk"), (b"o", CODEC.encode(other))])
    control = ControlPlane(rl_config.redis.url)
    worker = InferenceSyncWorker(rl_config, backend=None, control=control)  # type: ignore[arg-type] - never loads
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        deadline = time.monotonic() + 30
        while not await control.workers(rl_config.policy):  # the first heartbeat comes after the catch-up
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.2)
        await place(rl_config, created_topics.policy_versions, [(b"bad-later", b"\x00\x02junk")])
        letters = await read_topic(rl_config, created_topics.dlq, DeadLetter, expect=2)
    finally:
        stop.set()
        await task
        await control.close()
    assert sorted(d.key for d in letters) == [b"bad", b"bad-later"]
    assert {d.service for d in letters} == {f"inference:{rl_config.inference.worker_id}"}
    assert worker.state.version == 0 and worker.failures == 0


async def test_the_finetune_collector_dead_letters_and_collects(rl_config, created_topics):
    from rlstream.finetune.runtime import GroupCollector

    producer = make_producer(rl_config.kafka)
    await producer.start()
    collector = GroupCollector(rl_config, CODEC, producer)
    await collector.start()
    try:
        group = random_group(rl_config.policy, rl_config.run_id, 1)
        await place(rl_config, created_topics.groups, [(b"bad", b"\x00junk"), (b"g", CODEC.encode(group))])
        got = await collector.collect({group.group_id}, {group.group_id}, timeout_s=20.0)
        letters = await read_topic(rl_config, created_topics.dlq, DeadLetter, expect=1)
    finally:
        await collector.stop()
        await producer.stop()
    assert [(c.group.group_id, c.partition) for c in got] == [(group.group_id, PARTITION)]
    assert [(d.key, d.service) for d in letters] == [(b"bad", "finetune")]
