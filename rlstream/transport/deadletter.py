"""Dead letters: every rejected record goes to the ``dlq`` topic with the reason, never dropped."""
from __future__ import annotations

from aiokafka import AIOKafkaProducer

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import DeadLetter


def dead_letter(
    *, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None, error: BaseException | str,
    service: str, error_type: str | None = None,
) -> DeadLetter:
    """A DeadLetter for one source record; ``error_type`` defaults to the exception's class name."""
    if isinstance(error, BaseException):
        etype, message = error_type or type(error).__name__, str(error) or type(error).__name__
    else:
        etype, message = error_type or "rejected", error
    return DeadLetter(source_topic=topic, source_partition=partition, source_offset=offset, key=key, value=value,
                      error_type=etype, error_message=message, service=service)


async def send_dead_letter(producer: AIOKafkaProducer, codec: AvroCodec, dlq_topic: str, letter: DeadLetter) -> None:
    """Publish a dead letter keyed by the original key, and wait for the broker's ack."""
    await producer.send_and_wait(dlq_topic, codec.encode(letter), key=letter.key)
