"""Dead letters: every rejected record goes to the ``dlq`` topic with the reason, never dropped.

A dead letter must itself fit in one Kafka record: :func:`fit_dead_letter` cuts a key or value that would
not fit (a record at the broker's size limit cannot be wrapped whole) and notes the original's size and
sha256 at the end of ``error_message``, in a form :func:`truncations` parses back:
``[value truncated: original_size=1040000 sha256=<64 hex>]``. (Not new Avro fields: a new DeadLetter schema
version would have a new fingerprint, unknown to readers of this version.)
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Protocol

from aiokafka import AIOKafkaProducer

from rlstream.schemas.codec import AvroCodec, PayloadTooLargeError
from rlstream.schemas.models import DeadLetter
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: a dead letter's key and error message each keep at most this share of the size limit
KEY_SHARE = 8
#: room for the Avro length prefix of the value (a long: at most 10 bytes)
LENGTH_PREFIX_BYTES = 10
TRUNCATION_PATTERN = re.compile(r"\[(key|value) truncated: original_size=(\d+) sha256=([0-9a-f]{64})\]")


@dataclass(frozen=True)
class Truncation:
    """What a dead letter says about a field it carries cut: the original's size and sha256."""

    field: str  # "key" or "value"
    original_size: int
    sha256: str


def truncation_note(field: str, original: bytes) -> str:
    """The note appended to ``error_message`` when ``field`` is carried cut (parsed by :func:`truncations`)."""
    return f"[{field} truncated: original_size={len(original)} sha256={hashlib.sha256(original).hexdigest()}]"


def truncations(error_message: str) -> dict[str, Truncation]:
    """The truncation notes of a dead letter's ``error_message``, by field (empty when nothing was cut)."""
    return {m.group(1): Truncation(m.group(1), int(m.group(2)), m.group(3))
            for m in TRUNCATION_PATTERN.finditer(error_message)}


def _cut_text(text: str, max_bytes: int) -> str:
    """``text`` in at most ``max_bytes`` UTF-8 bytes (a cut says how long the original was)."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    suffix = f"... [message cut; {len(data)} bytes]"
    return data[: max(0, max_bytes - len(suffix))].decode("utf-8", "ignore") + suffix


def fit_dead_letter(letter: DeadLetter, codec: AvroCodec, max_bytes: int | None = None) -> tuple[DeadLetter, bytes]:
    """The letter cut to fit, and its encoding: the Kafka record it becomes (the key, then the encoded letter,
    which holds the key again) stays within ``max_bytes`` (default and at most: the codec's limit, which is
    kept under the broker's max message size).

    The error message and the key keep at most 1/:data:`KEY_SHARE` of the limit each; the value keeps what
    is left. Every cut key or value is noted in ``error_message`` (see :func:`truncations`).
    """
    limit = min(max_bytes or codec.max_bytes, codec.max_bytes)
    share = max(64, limit // KEY_SHARE)
    message = _cut_text(letter.error_message, share)
    notes: list[str] = []
    key = letter.key
    if key is not None and len(key) > share:
        notes.append(truncation_note("key", key))
        key = key[:share]
    value = letter.value
    if value:
        # the room left for the value when it carries its truncation note (a value that fits there fits anyway)
        noted = " ".join([message, *notes, truncation_note("value", value)])
        probe = letter.model_copy(update={"key": key, "value": b"", "error_message": noted})
        room = limit - len(codec.encode(probe)) - len(key or b"") - LENGTH_PREFIX_BYTES
        if len(value) > room:
            notes.append(truncation_note("value", value))
            value = value[: max(0, room)]
    fitted = letter.model_copy(update={"key": key, "value": value, "error_message": " ".join([message, *notes])})
    encoded = codec.encode(fitted)
    if len(encoded) + len(key or b"") > limit:  # cannot happen with the room computed above; never send it whole
        raise PayloadTooLargeError(f"dead letter of {len(encoded)} bytes does not fit in {limit} bytes")
    return fitted, encoded


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
    """Publish a dead letter keyed by the original key (both cut to fit, see :func:`fit_dead_letter`), and wait
    for the broker's ack."""
    fitted, encoded = fit_dead_letter(letter, codec)
    await producer.send_and_wait(dlq_topic, encoded, key=fitted.key)


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
