"""Reading topics: group-less reads of bounded slices (replay, tail, status, plot), waiting for a topic's
partitions, and :class:`TopicReader`, the one typed consume -> decode -> dead-letter loop of every service.

A group-less reader never joins a consumer group and never commits: operator tools must not disturb the
offsets of the services they look at.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Callable, Generic, Mapping, TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from rlstream.schemas.codec import AvroCodec, CodecError
from rlstream.schemas.config import KafkaConfig
from rlstream.schemas.models import WireModel
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.kafka import make_consumer
from rlstream.transport.log import get_logger

log = get_logger(__name__)
T = TypeVar("T", bound=WireModel)


class TopicMissingError(RuntimeError):
    """The topic does not exist on the cluster."""


async def open_reader(kafka: KafkaConfig, **extra: object) -> AIOKafkaConsumer:
    """A started, group-less consumer that reads committed records only."""
    consumer = make_consumer(kafka, group_id=None, isolation_level="read_committed", **extra)
    await consumer.start()
    return consumer


# --- partitions -------------------------------------------------------------------------------------------
async def wait_for_partitions(consumer: AIOKafkaConsumer, topic: str, timeout_s: float = 30.0,
                              poll_s: float = 0.2) -> list[TopicPartition]:
    """The partitions of ``topic`` in order, waiting up to ``timeout_s`` for the topic to exist.

    Raises :class:`TopicMissingError` when it still does not exist then (``timeout_s=0``: ask once).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            # the consumer's own metadata only tracks the topics it reads; ask the cluster for all of them
            cluster = await consumer._client.fetch_all_metadata()  # noqa: SLF001 - no public call does this
            parts = cluster.partitions_for_topic(topic)
        if parts:
            return [TopicPartition(topic, p) for p in sorted(parts)]
        if time.monotonic() >= deadline:
            raise TopicMissingError(f"topic {topic!r} does not exist (run `rlstream topics create`)")
        await asyncio.sleep(poll_s)


async def partitions_of(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """The partitions of ``topic``; raises :class:`TopicMissingError` when it does not exist (no waiting)."""
    return await wait_for_partitions(consumer, topic, timeout_s=0)


async def caught_up(consumer: AIOKafkaConsumer, ends: Mapping[TopicPartition, int]) -> bool:
    """True once the position of every partition of ``ends`` reached its end offset."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return False
    return True


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


# --- the typed reader -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceRecord:
    """Where a decoded event came from, with its raw bytes (what a dead letter carries)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None

    @classmethod
    def of(cls, record: ConsumerRecord) -> "SourceRecord":
        return cls(record.topic, record.partition, record.offset, record.key, record.value)

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


@dataclass(frozen=True)
class Decoded(Generic[T]):
    """One typed event and the record it was decoded from."""

    event: T
    source: SourceRecord


OnReject = Callable[[SourceRecord, "BaseException | str"], None]


async def fetch_batch(consumer: AIOKafkaConsumer, *partitions: TopicPartition, timeout_ms: int = 500,
                      max_records: int | None = None) -> list[ConsumerRecord]:
    """One ``getmany``, flattened in (topic, partition) order; the order within a partition is kept."""
    batches = await consumer.getmany(*partitions, timeout_ms=timeout_ms, max_records=max_records)
    return [record for tp in sorted(batches, key=lambda t: (t.topic, t.partition)) for record in batches[tp]]


class TopicReader(Generic[T]):
    """Consume -> decode -> dead-letter, written once.

    :meth:`fetch` reads one batch from the consumer and returns the records that decode into ``model``;
    :meth:`reject` takes a record out (a decoding failure, or a reason the caller found in a decoded event).
    A rejected record goes to ``dead_letters`` (the ``dlq`` topic) with its reason when a sink is given,
    and to ``on_reject`` when one is given (read-only tools count or log it there); it never raises
    unless the dead letter itself cannot be sent by a sink that is not ``best_effort``.
    The consumer is the caller's: assign or subscribe, seek, start and stop it there.
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        codec: AvroCodec,
        model: type[T],
        *,
        dead_letters: DeadLetterSink | None = None,
        on_reject: OnReject | None = None,
        errors: tuple[type[BaseException], ...] = (CodecError,),
    ) -> None:
        self.consumer = consumer
        self.codec = codec
        self.model = model
        self.dead_letters = dead_letters
        self.on_reject = on_reject
        self.errors = errors
        self.seen = 0  # records given to decode()
        self.rejected = 0  # records taken out by reject() (decoding failures included)

    async def fetch(self, *partitions: TopicPartition, timeout_ms: int = 500,
                    max_records: int | None = None) -> list[Decoded[T]]:
        """The decodable records of one batch (of ``partitions``, or of all assigned ones), in partition order."""
        out: list[Decoded[T]] = []
        for record in await fetch_batch(self.consumer, *partitions, timeout_ms=timeout_ms, max_records=max_records):
            item = await self.decode(record)
            if item is not None:
                out.append(item)
        return out

    async def reject(self, source: SourceRecord, reason: BaseException | str) -> None:
        """Take ``source`` out: dead-letter it with ``reason`` (with a sink) and report it to ``on_reject``."""
        self.rejected += 1
        if self.dead_letters is not None:
            log.warning("record rejected; sent to dlq", topic=source.topic, partition=source.partition,
                        offset=source.offset, error=str(reason), service=self.dead_letters.service)
            await self.dead_letters.send(source, reason)
        if self.on_reject is not None:
            self.on_reject(source, reason)

    async def decode(self, record: ConsumerRecord) -> Decoded[T] | None:
        """One record as a typed event, or None once it was rejected (see :meth:`reject`)."""
        self.seen += 1
        source = SourceRecord.of(record)
        try:
            event = self.codec.decode(record.value, self.model)
        except self.errors as exc:
            await self.reject(source, exc)
            return None
        return Decoded(event, source)

    async def stream(self, records: AsyncIterable[ConsumerRecord]) -> AsyncIterator[Decoded[T]]:
        """The decodable records of ``records`` (e.g. :func:`read_slice`, :func:`read_to_end`), in order."""
        async for record in records:
            item = await self.decode(record)
            if item is not None:
                yield item
