"""schemas/skim.py: the result equals fastavro's with each numeric array replaced by its count; whatever it accepts,
fastavro accepts; the streams' trajectory decoding built on it keeps every verdict of the full decode."""
from __future__ import annotations

import io
import json
import os
import random
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.schemas.codec import HISTORY_DIR, AvroCodec, CodecError, CorruptPayloadError
from rlstream.schemas.codec import _avro_long as _long  # the encoder's own varint writer
from rlstream.schemas.models import Message, TrajectoryEvent, Turn
from rlstream.schemas.skim import SkimError, SkippedNumbers, skim
from rlstream.streams import validation as v
from tests.support.factories import make_trajectory
from tests.unit.test_codec import sample_events

pytestmark = pytest.mark.unit

CODEC = AvroCodec(max_bytes=2_000_000)
FUZZ = settings(max_examples=int(os.environ.get("RLSTREAM_FUZZ_EXAMPLES", "200")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
TRAJECTORY_SCHEMA = CODEC.parsed_schema(TrajectoryEvent.avro_name)


NUMBERS = ("int", "long", "float", "double")


def counted(value: Any, schema: Any, named: dict[str, Any] | None = None) -> Any:
    """``value`` (as fastavro decodes it under fastavro's parsed ``schema``) with each array of numbers replaced by
    its count."""
    named = {} if named is None else named
    if isinstance(schema, str):
        schema = named.get(schema, schema)
    if isinstance(schema, list):  # a union: the branch of the value's kind (our unions are null + one type)
        kinds = {"record": dict, "error": dict, "map": dict, "array": list}
        for branch in (named.get(b, b) if isinstance(b, str) else b for b in schema):
            if isinstance(branch, dict) and isinstance(value, kinds.get(branch["type"], ())):
                return counted(value, branch, named)
        return value
    if not isinstance(schema, dict):
        return value
    kind = schema["type"]
    if kind in ("record", "error"):
        named[schema["name"]] = schema
        return {f["name"]: counted(value[f["name"]], f["type"], named) for f in schema["fields"]}
    if kind == "array":
        if schema["items"] in NUMBERS:
            return SkippedNumbers(len(value))
        return [counted(item, schema["items"], named) for item in value]
    if kind == "map":
        return {k: counted(item, schema["values"], named) for k, item in value.items()}
    return value


def skimmed_and_full(payload: bytes, name: str) -> tuple[Any, Any]:
    return CODEC.skim_record(payload, name), counted(CODEC.decode_record(payload, name), CODEC.parsed_schema(name))


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: type(e).__name__)
def test_every_event_skims_to_the_full_decode_with_counts(event: Any) -> None:
    skimmed, full = skimmed_and_full(CODEC.encode(event), event.avro_name)
    assert skimmed == full


def test_token_arrays_are_counted_on_both_paths() -> None:
    """Arrays of fewer than 16 varints are delimited one at a time, longer ones with one scan: both give the count."""
    for completion in (0, 1, 15, 16, 17, 512):
        event = make_trajectory(turns=3, completion_tokens=completion, prompt_tokens=completion + 3, seed=completion)
        skimmed = CODEC.skim_record(CODEC.encode(event), TrajectoryEvent.avro_name)
        assert skimmed is not None
        assert [t["completion_token_ids"] for t in skimmed["turns"]] == [SkippedNumbers(completion)] * 3
        assert [t["prompt_token_ids"] for t in skimmed["turns"]] == [SkippedNumbers(completion + 3)] * 3
        assert [t["completion_logprobs"] for t in skimmed["turns"]] == [SkippedNumbers(completion)] * 3


ints = st.integers(min_value=-2**31, max_value=2**31 - 1)
doubles = st.floats(allow_nan=True, allow_infinity=True)


@FUZZ
@given(st.lists(st.tuples(st.none() | st.lists(ints, max_size=40), st.none() | st.lists(ints, max_size=40),
                          st.none() | st.lists(doubles, max_size=40)), max_size=5),
       st.text(max_size=30), st.none() | st.floats(allow_nan=False), st.dictionaries(st.text(max_size=5), st.text(max_size=5)))
def test_generated_trajectories_skim_to_the_full_decode(turns: list[Any], content: str, reward: float | None,
                                                         metadata: dict[str, str]) -> None:
    event = make_trajectory(turns=1).model_copy(update={
        "messages": [Message(role="user", content=content), Message(role="assistant", content=content)],
        "turns": [Turn(prompt_token_ids=p, completion_token_ids=c, completion_logprobs=lp) for p, c, lp in turns],
        "reward": reward, "metadata": metadata})
    skimmed, full = skimmed_and_full(CODEC.encode(event), TrajectoryEvent.avro_name)
    assert skimmed == full


def test_blocks_with_byte_sizes_and_several_blocks() -> None:
    """The specification lets a writer give a block's byte size after a negative count, and split arrays and maps
    into blocks (other libraries do); fastavro and the skim read the same values."""
    schema = json.dumps({"type": "record", "name": "R", "fields": [
        {"name": "ids", "type": {"type": "array", "items": "long"}},
        {"name": "names", "type": {"type": "array", "items": "string"}},
        {"name": "scores", "type": {"type": "map", "values": "double"}}]})
    ids = [3, -7, 2**40, 0] + list(range(20))
    first, second = b"".join(_long(i) for i in ids[:10]), b"".join(_long(i) for i in ids[10:])
    strings = [b"a", "é".encode()]
    body = (_long(-10) + _long(len(first)) + first + _long(len(ids) - 10) + second + _long(0)
            + _long(-2) + _long(sum(len(s) + 1 for s in strings)) + b"".join(_long(len(s)) + s for s in strings)
            + _long(0) + _long(1) + _long(1) + b"k" + b"\x00" * 8 + _long(0))
    full = fastavro.schemaless_reader(io.BytesIO(body), fastavro.parse_schema(json.loads(schema)), None)
    assert full["ids"] == ids
    assert skim(schema, body) == ({"ids": SkippedNumbers(len(ids)), "names": ["a", "é"], "scores": {"k": 0.0}},
                                  len(body))


@pytest.mark.parametrize("body,problem", [
    (_long(2) + b"\x80\x80\x80\x80\x80\x01" + _long(1) + _long(0), "longer than 5 bytes"),  # int of 6 bytes
    (_long(20) + b"\x02" * 19 + b"\x80" * 6 + b"\x01" + _long(0), "longer than 5 bytes"),  # the same, scanned
    (_long(20) + b"\x02" * 10 + b"\x80\x80\x80\x80\x01" * 9 + b"\x80" * 5 + b"\x01" + _long(0),
     "longer than 5 bytes"),  # after nine of 5 bytes: past the bytes first looked at (twice the count)
    (_long(20) + b"\x80" * 120 + _long(0), "ends inside"),  # no varint ends within 20 x 5 bytes
    (_long(3) + b"\x02\x02\x80", "ends inside"),  # truncated in its last number
    (_long(2**40), "cannot fit"),  # a count no data can hold
])
def test_malformed_arrays_of_numbers_are_errors(body: bytes, problem: str) -> None:
    with pytest.raises(SkimError, match=problem):
        skim(json.dumps({"type": "array", "items": "int"}), body)


@FUZZ
@given(st.data())
def test_what_the_skim_accepts_fastavro_accepts_and_reads_alike(data: st.DataObject) -> None:
    """Mutated trajectory payloads: the skim never accepts bytes that fastavro rejects, and when both accept they
    agree, so a record the stream lets through decodes in the learner."""
    event = make_trajectory(turns=2, completion_tokens=data.draw(st.integers(0, 40)), prompt_tokens=20,
                            seed=data.draw(st.integers(0, 1000)), with_tool_call=data.draw(st.booleans()))
    payload = bytearray(CODEC.encode(event))
    rng = random.Random(data.draw(st.integers()))
    for _ in range(data.draw(st.integers(1, 4))):
        position = rng.randrange(10, len(payload))
        payload[position] = rng.randrange(256)
    try:
        skimmed = CODEC.skim_record(bytes(payload), TrajectoryEvent.avro_name)
    except CodecError:
        return
    full = CODEC.decode_record(bytes(payload), TrajectoryEvent.avro_name)  # raises if fastavro rejects
    assert skimmed == counted(full, TRAJECTORY_SCHEMA)


def test_every_truncation_is_rejected() -> None:
    payload = CODEC.encode(make_trajectory(turns=2, completion_tokens=20, with_tool_call=True, seed=3))
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            CODEC.skim_record(payload[:cut], TrajectoryEvent.avro_name)
    with pytest.raises(CorruptPayloadError, match="trailing"):
        CODEC.skim_record(payload + b"\x00", TrajectoryEvent.avro_name)


def test_a_record_of_an_older_schema_version_is_decoded_whole() -> None:
    old_schema = json.loads((HISTORY_DIR / "rlstream.v1.TrajectoryEvent.1.json").read_text())
    record = CODEC.decode_record(CODEC.encode(make_trajectory(turns=1, completion_tokens=5)), TrajectoryEvent.avro_name)
    old_fields = {f["name"] for f in old_schema["fields"]}
    old_payload = CODEC.encode_record({k: val for k, val in record.items() if k in old_fields}, old_schema)
    assert CODEC.skim_record(old_payload, TrajectoryEvent.avro_name) is None
    ingested = v.decode_trajectory(CODEC, old_payload)
    assert ingested.turn_counts == [v.TurnCounts(5, 5)]
    assert ingested.event.turns[0].completion_token_ids is not None  # decoded whole: nothing to skim


def test_the_stream_keeps_every_verdict_of_the_full_decode() -> None:
    """A logprob count that differs from the token count is found from the counts alone (the decoded event holds
    no token data), as it is from the full event."""
    bad = make_trajectory(turns=2, completion_tokens=30, seed=5)
    bad.turns[1].completion_logprobs = bad.turns[1].completion_logprobs[:-1]
    ingested = v.decode_trajectory(CODEC, CODEC.encode(bad))
    assert ingested.event.turns[1].completion_token_ids is None
    assert ingested.turn_counts[1] == v.TurnCounts(30, 29)
    skimmed_verdict = v.validate_trajectory(ingested.event, turn_counts=ingested.turn_counts)
    assert skimmed_verdict == v.validate_trajectory(bad)
    assert skimmed_verdict is not None and skimmed_verdict.reason == v.TOKEN_LOGPROB_MISMATCH
    good = make_trajectory(turns=2, completion_tokens=30, seed=5)
    ingested = v.decode_trajectory(CODEC, CODEC.encode(good))
    assert v.validate_trajectory(ingested.event, turn_counts=ingested.turn_counts) is None
    with pytest.raises(v.Rejected) as empty:
        v.decode_trajectory(CODEC, b"")
    assert empty.value.invalid.reason == v.EMPTY_VALUE


def test_scanned_and_one_at_a_time_give_the_same_counts_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long arrays of varints are delimited with one scan of their bytes; read one varint at a time they give the same
    count, and the same error for a varint over its length."""
    from rlstream.schemas import skim as skim_module

    payload = CODEC.encode(make_trajectory(turns=2, completion_tokens=300, prompt_tokens=40, seed=9))
    scanned = CODEC.skim_record(payload, TrajectoryEvent.avro_name)
    over_long = _long(20) + b"\x02" * 19 + b"\x80" * 6 + b"\x01" + _long(0)
    monkeypatch.setattr(skim_module, "_SCAN_FROM", 1 << 30)
    assert CODEC.skim_record(payload, TrajectoryEvent.avro_name) == scanned
    with pytest.raises(SkimError, match="longer than 5 bytes"):
        skim(json.dumps({"type": "array", "items": "int"}), over_long)


@pytest.mark.parametrize("items,width", [("int", 5), ("long", 10)])
def test_varints_of_the_longest_length_are_read(items: str, width: int) -> None:
    """Varints of exactly the longest length, one after another, are not mistaken for one that is too long: the
    negative control of the "longer than" errors above."""
    value = -(2 ** 63) if items == "long" else -(2 ** 31)  # the zigzag encodings of most bytes
    encoded = _long(value)
    assert len(encoded) == width
    body = _long(40) + encoded * 40 + _long(0)
    assert skim(json.dumps({"type": "array", "items": items}), body) == (SkippedNumbers(40), len(body))
    full = fastavro.schemaless_reader(io.BytesIO(body), {"type": "array", "items": items}, None)
    assert full == [value] * 40
