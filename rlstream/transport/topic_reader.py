"""Group-less reads of bounded slices of a topic (used by replay, tail, status and plot).

A reader never joins a consumer group and never commits: operator tools must not disturb the
offsets of the services they look at.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from rlstream.transport.kafka import make_consumer
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import KafkaConfig


def codec_for(kafka: KafkaConfig) -> AvroCodec:
    """The codec of this deployment (Confluent framing and registry look-ups when a registry is configured)."""
    factory = getattr(AvroCodec, "from_config", None)
    return factory(kafka) if factory else AvroCodec()


class TopicMissingError(RuntimeError):
    """The topic does not exist on the cluster."""


async def open_reader(kafka: KafkaConfig, **extra: object) -> AIOKafkaConsumer:
    """A started, group-less consumer that reads committed records only."""
    consumer = make_consumer(kafka, group_id=None, isolation_level="read_committed", **extra)
    await consumer.start()
    return consumer


async def partitions_of(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """The partitions of ``topic``; raises :class:`TopicMissingError` when it does not exist."""
    parts = consumer.partitions_for_topic(topic)
    if not parts:
        # the consumer's own metadata only tracks the topics it reads; ask the cluster for all of them
        cluster = await consumer._client.fetch_all_metadata()
        parts = cluster.partitions_for_topic(topic)
    if not parts:
        raise TopicMissingError(f"topic {topic!r} does not exist (run `rlstream topics create`)")
    return [TopicPartition(topic, p) for p in sorted(parts)]


async def read_slice(
    consumer: AIOKafkaConsumer, starts: dict[TopicPartition, int], stops: dict[TopicPartition, int],
) -> AsyncIterator[ConsumerRecord]:
    """Yield every record with ``starts[tp] <= offset < stops[tp]``, partition by partition order of arrival."""
    todo = {tp: (starts[tp], stops[tp]) for tp in starts if stops.get(tp, 0) > starts[tp]}
    if not todo:
        return
    consumer.assign(list(todo))
    for tp, (start, _) in todo.items():
        consumer.seek(tp, start)
    while todo:
        batch = await consumer.getmany(*todo.keys(), timeout_ms=500)
        for tp, records in batch.items():
            if tp not in todo:
                continue
            for record in records:
                if record.offset >= todo[tp][1]:
                    break
                yield record
        for tp in list(todo):
            # a partition is done once its position passed the stop (transaction markers and
            # compacted gaps leave offsets without records, so compare positions, not records)
            if await consumer.position(tp) >= todo[tp][1]:
                del todo[tp]
        await asyncio.sleep(0)


async def read_to_end(consumer: AIOKafkaConsumer, topic: str, tail: int | None = None) -> AsyncIterator[ConsumerRecord]:
    """Every record of ``topic`` up to the end offsets of now (only the last ``tail`` per partition if given)."""
    parts = await partitions_of(consumer, topic)
    begins = await consumer.beginning_offsets(parts)
    ends = await consumer.end_offsets(parts)
    starts = {tp: begins[tp] if tail is None else max(begins[tp], ends[tp] - tail) for tp in parts}
    async for record in read_slice(consumer, starts, ends):
        yield record
