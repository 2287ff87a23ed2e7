"""TopicReader and DeadLetterSink on stand-ins for the consumer and producer: order, rejects, send failures."""
from __future__ import annotations

from typing import Any

import pytest
from aiokafka import ConsumerRecord, TopicPartition

from rlstream.schemas.codec import AvroCodec, CodecError
from rlstream.schemas.models import DeadLetter, MetricEvent
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.topic_reader import SourceRecord, TopicReader

CODEC = AvroCodec()


def record(partition: int, offset: int, value: bytes | None, key: bytes | None = b"k") -> ConsumerRecord:
    return ConsumerRecord("metrics", partition, offset, 0, 0, key, value, None, 1, len(value or b""), ())


METRICS = {n: CODEC.encode(MetricEvent(source="test", run_id="r", name=f"m{n}", value=float(n))) for n in (1, 2, 3)}


class FakeConsumer:
    def __init__(self, *batches: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        self.batches = list(batches)
        self.calls: list[tuple[tuple[TopicPartition, ...], dict[str, Any]]] = []

    async def getmany(self, *partitions: TopicPartition, **kw: Any) -> dict[TopicPartition, list[ConsumerRecord]]:
        self.calls.append((partitions, kw))
        return self.batches.pop(0) if self.batches else {}


class FakeProducer:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.sent: list[tuple[str, bytes, bytes | None]] = []

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        if self.fail:
            raise ConnectionError("broker gone")
        self.sent.append((topic, value, key))


async def test_fetch_yields_typed_events_in_partition_order_and_dead_letters_the_rest() -> None:
    tp0, tp1 = TopicPartition("metrics", 0), TopicPartition("metrics", 1)
    consumer = FakeConsumer({tp1: [record(1, 7, METRICS[3])],
                             tp0: [record(0, 4, METRICS[1]), record(0, 5, b"\x00junk", key=b"bad"),
                                   record(0, 6, None), record(0, 7, METRICS[2])]})
    producer = FakeProducer()
    reader = TopicReader(consumer, CODEC, MetricEvent, dead_letters=DeadLetterSink(producer, CODEC, "dlq", "svc"))

    items = await reader.fetch(tp0, tp1, timeout_ms=100, max_records=10)

    assert consumer.calls == [((tp0, tp1), {"timeout_ms": 100, "max_records": 10})]
    assert [(i.source.partition, i.source.offset, i.event.name) for i in items] == [(0, 4, "m1"), (0, 7, "m2"),
                                                                                    (1, 7, "m3")]
    assert items[0].source == SourceRecord("metrics", 0, 4, b"k", METRICS[1])
    assert items[0].source.tp == tp0
    letters = [(topic, key, CODEC.decode(value, DeadLetter)) for topic, value, key in producer.sent]
    assert [(t, k, d.source_offset, d.value, d.service) for t, k, d in letters] == [
        ("dlq", b"bad", 5, b"\x00junk", "svc"), ("dlq", b"k", 6, None, "svc")]
    assert all(d.error_type in ("CorruptPayloadError", "UnknownSchemaError") for _, _, d in letters)
    assert (reader.seen, reader.rejected) == (5, 2)
    assert await reader.fetch() == []  # an empty batch


async def test_on_reject_without_a_sink_and_the_errors_caught() -> None:
    seen: list[tuple[int, BaseException | str]] = []
    reader = TopicReader(FakeConsumer(), CODEC, MetricEvent,
                         on_reject=lambda source, reason: seen.append((source.offset, reason)))
    assert await reader.decode(record(0, 1, b"junk")) is None
    await reader.reject(SourceRecord("metrics", 0, 2, None, b""), "no use")
    assert [offset for offset, _ in seen] == [1, 2]
    assert isinstance(seen[0][1], CodecError) and seen[1][1] == "no use"

    # only the listed errors are taken out; anything else is a bug and propagates
    class Boom(Exception):
        pass

    class Exploding(AvroCodec):
        def decode(self, data: bytes, model: Any) -> Any:
            raise Boom("not a decoding error")

    strict = TopicReader(FakeConsumer(), Exploding(), MetricEvent, errors=(CodecError,))
    with pytest.raises(Boom):
        await strict.decode(record(0, 1, b"x"))


async def test_a_failed_dead_letter_raises_unless_best_effort() -> None:
    source = SourceRecord("metrics", 0, 9, b"k", b"junk")
    with pytest.raises(ConnectionError):
        await DeadLetterSink(FakeProducer(fail=True), CODEC, "dlq", "svc").send(source, "why")
    assert await DeadLetterSink(FakeProducer(fail=True), CODEC, "dlq", "svc", best_effort=True).send(source, "why") is False
    reader = TopicReader(FakeConsumer({TopicPartition("metrics", 0): [record(0, 9, b"junk"),
                                                                      record(0, 10, METRICS[1])]}),
                         CODEC, MetricEvent,
                         dead_letters=DeadLetterSink(FakeProducer(fail=True), CODEC, "dlq", "svc", best_effort=True))
    assert [i.source.offset for i in await reader.fetch()] == [10]  # the reader went on past the failed send
