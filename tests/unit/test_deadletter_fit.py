"""Dead letters cut to fit one Kafka record: the original's size and sha256 travel in the error message."""
from __future__ import annotations

import hashlib
import os

import pytest

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import DeadLetter
from rlstream.transport.deadletter import (Truncation, dead_letter, fit_dead_letter, send_dead_letter, truncation_note,
                                           truncations)

CODEC = AvroCodec()  # max_bytes 1,000,000 (kafka.max_message_bytes)


def letter(value: bytes | None, key: bytes | None = b"ex-1", message: str = "payload is too large") -> DeadLetter:
    return dead_letter(topic="t.trajectories", partition=3, offset=17, key=key, value=value, error=message,
                       error_type="payload_too_large", service="streams:w1")


def test_an_oversized_value_is_cut_to_fit_with_its_size_and_sha256() -> None:
    original = os.urandom(1_040_000)
    fitted, encoded = fit_dead_letter(letter(original), CODEC)
    assert len(encoded) + len(fitted.key or b"") <= CODEC.max_bytes
    assert fitted.value is not None and original.startswith(fitted.value)
    assert len(fitted.value) > CODEC.max_bytes - 2_000  # only the overhead is given up
    notes = truncations(fitted.error_message)
    assert notes == {"value": Truncation("value", 1_040_000, hashlib.sha256(original).hexdigest())}
    assert fitted.error_message.startswith("payload is too large [value truncated: ")
    back = CODEC.decode(encoded, DeadLetter)  # what a dlq reader gets
    assert back.value == fitted.value and truncations(back.error_message)["value"].original_size == 1_040_000
    assert (back.source_topic, back.source_partition, back.source_offset, back.error_type) == (
        "t.trajectories", 3, 17, "payload_too_large")


def test_a_value_that_fits_is_kept_whole_without_a_note() -> None:
    original = os.urandom(900_000)
    fitted, encoded = fit_dead_letter(letter(original), CODEC)
    assert fitted.value == original and truncations(fitted.error_message) == {}
    assert CODEC.decode(encoded, DeadLetter).value == original
    empty, _ = fit_dead_letter(letter(None, key=None), CODEC)
    assert empty.value is None and empty.key is None and empty.error_message == "payload is too large"


@pytest.mark.parametrize("limit", [1024, 50_000, 999_999])
def test_every_limit_holds_for_key_value_and_message(limit: int) -> None:
    key, value = os.urandom(3 * limit), os.urandom(2 * limit)
    fitted, encoded = fit_dead_letter(letter(value, key=key, message="m" * (5 * limit)), CODEC, max_bytes=limit)
    assert len(encoded) + len(fitted.key or b"") <= limit
    notes = truncations(fitted.error_message)
    assert notes["key"] == Truncation("key", len(key), hashlib.sha256(key).hexdigest())
    assert notes["value"] == Truncation("value", len(value), hashlib.sha256(value).hexdigest())
    assert key.startswith(fitted.key or b"-") and value.startswith(fitted.value or b"-")
    assert "message cut" in fitted.error_message


def test_the_note_is_parseable_and_unfooled_by_other_text() -> None:
    data = b"abc"
    note = truncation_note("value", data)
    assert note == f"[value truncated: original_size=3 sha256={hashlib.sha256(data).hexdigest()}]"
    assert truncations(f"why {note}") == {"value": Truncation("value", 3, hashlib.sha256(data).hexdigest())}
    assert truncations("[value truncated: original_size=3 sha256=nothex]") == {}


async def test_send_dead_letter_sends_the_fitted_record() -> None:
    sent: list[tuple[str, bytes, bytes | None]] = []

    class Producer:
        async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None) -> None:
            sent.append((topic, value, key))

    original = os.urandom(1_040_000)
    await send_dead_letter(Producer(), CODEC, "dlq", letter(original))  # type: ignore[arg-type]
    (topic, value, key), = sent
    assert topic == "dlq" and key == b"ex-1" and len(value) <= CODEC.max_bytes
    assert truncations(CODEC.decode(value, DeadLetter).error_message)["value"].sha256 == \
        hashlib.sha256(original).hexdigest()
