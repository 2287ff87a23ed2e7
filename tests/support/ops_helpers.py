"""Helpers of the operator-workflow tests: publish events and read topics back, on the real broker."""
from __future__ import annotations

from typing import Callable, Sequence

from rlstream.transport.kafka import make_producer
from rlstream.transport.topic_reader import open_reader, read_to_end
from rlstream.schemas.codec import AvroCodec, CodecError
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import WireModel

CODEC = AvroCodec()


async def publish(cfg: RlstreamConfig, topic: str, events: Sequence[WireModel],
                  key: Callable[[WireModel], str]) -> list[tuple[int, int]]:
    """Send ``events`` in order and wait for each ack; returns their (partition, offset)."""
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        placed = []
        for event in events:
            meta = await producer.send_and_wait(topic, CODEC.encode(event), key=key(event).encode())
            placed.append((meta.partition, meta.offset))
        return placed
    finally:
        await producer.stop()


async def publish_raw(cfg: RlstreamConfig, topic: str, value: bytes, key: bytes) -> tuple[int, int]:
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, value, key=key)
        return meta.partition, meta.offset
    finally:
        await producer.stop()


async def read_all(cfg: RlstreamConfig, topic: str, model: type[WireModel]) -> list[tuple[int, int, WireModel]]:
    """Every decodable record of ``topic`` now on the broker, as (partition, offset, event)."""
    consumer = await open_reader(cfg.kafka)
    out = []
    try:
        async for record in read_to_end(consumer, topic):
            try:
                out.append((record.partition, record.offset, CODEC.decode(record.value, model)))
            except CodecError:
                continue
        return out
    finally:
        await consumer.stop()


def ops_app() -> "typer.Typer":
    """The operator commands on a bare typer app (their tests do not depend on other command groups)."""
    import typer

    from rlstream.cli.common import RlstreamGroup
    from rlstream.cli.ops import register

    app = typer.Typer(cls=RlstreamGroup)
    register(app)
    return app
