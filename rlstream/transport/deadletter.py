"""Dead letters: every rejected record goes to the ``dlq`` topic with the reason, never dropped."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from aiokafka import AIOKafkaProducer

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import DeadLetter
from rlstream.transport.log import get_logger

log = get_logger(__name__)


class SourceLike(Protocol):
    """Where a record came from (an aiokafka ``ConsumerRecord`` or a :class:`~rlstream.transport.topic_reader.SourceRecord`)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes | None: ...


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


@dataclass
class DeadLetterSink:
    """Where one service sends the records it rejects: a started producer, the ``dlq`` topic and its name.

    ``best_effort``: a failed send is logged and swallowed (the caller goes on); otherwise it is raised,
    so that a record is never consumed without its dead letter.
    """

    producer: AIOKafkaProducer
    codec: AvroCodec
    topic: str
    service: str
    best_effort: bool = False

    async def send(self, source: SourceLike, reason: BaseException | str) -> bool:
        """Dead-letter ``source`` with ``reason``; True once the broker acknowledged it."""
        letter = dead_letter(topic=source.topic, partition=source.partition, offset=source.offset, key=source.key,
                             value=source.value, error=reason, service=self.service)
        try:
            await send_dead_letter(self.producer, self.codec, self.topic, letter)
        except Exception as exc:
            if not self.best_effort:
                raise
            log.error("dead letter not sent", error=str(exc), topic=source.topic, partition=source.partition,
                      offset=source.offset, service=self.service)
            return False
        return True
