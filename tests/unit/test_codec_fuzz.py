"""Fuzzing the decoder: random, truncated and mutated bytes only ever raise CodecError subclasses."""
from __future__ import annotations

import math
import os
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.schemas.codec import CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC, AvroCodec, CodecError
from rlstream.schemas.models import EVENT_MODELS, MetricEvent, RewardEvent, WireModel
from tests.unit.test_codec import DictRegistry, sample_events

EVENTS = sample_events()
CODEC = AvroCodec(max_bytes=200_000)
REGISTRY = DictRegistry()
CONFLUENT_CODEC = AvroCodec(registry=REGISTRY, max_bytes=200_000)
PAYLOADS = [(type(e), CODEC.encode(e)) for e in EVENTS] + [(type(e), CONFLUENT_CODEC.encode(e)) for e in EVENTS]
HEADERS = sorted({p[:10] for _, p in PAYLOADS if p[:2] == SINGLE_OBJECT_MAGIC} |
                 {p[:5] for _, p in PAYLOADS if p[:1] == CONFLUENT_MAGIC})
FUZZ = settings(max_examples=int(os.environ.get("RLSTREAM_FUZZ_EXAMPLES", "200")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_or_codec_error(codec: AvroCodec, data: bytes, model: type[WireModel] | None) -> bool:
    """True when the bytes decoded; False when a CodecError was raised; anything else fails the test."""
    try:
        if model is None:
            codec.decode_record(data)
        else:
            codec.decode(data, model)
    except CodecError as exc:
        assert str(exc), "codec errors carry a message"
        return False
    return True


@FUZZ
@given(st.binary(max_size=300), st.sampled_from([None, *EVENT_MODELS.values()]))
def test_random_bytes(data: bytes, model: type[WireModel] | None) -> None:
    decode_or_codec_error(CONFLUENT_CODEC, data, model)


@FUZZ
@given(st.sampled_from(HEADERS), st.binary(max_size=400), st.sampled_from([None, *EVENT_MODELS.values()]))
def test_random_body_behind_a_known_header(header: bytes, body: bytes, model: type[WireModel] | None) -> None:
    decode_or_codec_error(CONFLUENT_CODEC, header + body, model)


@pytest.mark.parametrize("model,payload", PAYLOADS, ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_every_truncation_is_a_codec_error(model: type[WireModel], payload: bytes) -> None:
    for cut in range(len(payload)):
        assert not decode_or_codec_error(CONFLUENT_CODEC, payload[:cut], model), f"truncated at {cut} decoded"
        assert not decode_or_codec_error(CONFLUENT_CODEC, payload[:cut], None), f"truncated at {cut} decoded"


@FUZZ
@given(st.data())
def test_mutated_payloads(data: st.DataObject) -> None:
    model, payload = data.draw(st.sampled_from(PAYLOADS))
    mutated = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(mutated) - 1))
        mutated[index] = data.draw(st.integers(0, 255))
    decode_or_codec_error(CONFLUENT_CODEC, bytes(mutated), model)


MILLIS = st.datetimes(datetime(1970, 1, 1), datetime(2200, 1, 1), timezones=st.just(timezone.utc)).map(
    lambda t: t.replace(microsecond=t.microsecond // 1000 * 1000))


@FUZZ
@given(st.builds(MetricEvent, value=st.floats(allow_nan=False), step=st.none() | st.integers(-2**63, 2**63 - 1),
                 tags=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4), ts=MILLIS))
def test_generated_metric_events_round_trip(event: MetricEvent) -> None:
    assert CODEC.decode(CODEC.encode(event), MetricEvent) == event


@FUZZ
@given(st.builds(RewardEvent, reward=st.floats(), components=st.dictionaries(st.text(max_size=8), st.floats(),
                                                                                max_size=4)))
def test_generated_reward_events_round_trip(event: RewardEvent) -> None:
    back = CODEC.decode(CODEC.encode(event), RewardEvent)
    assert back.model_dump(exclude={"reward", "components"}) == event.model_dump(exclude={"reward", "components"})
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731
    assert same(back.reward, event.reward)
    assert back.components.keys() == event.components.keys()
    assert all(same(back.components[k], v) for k, v in event.components.items())
