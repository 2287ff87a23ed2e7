"""The Avro codec: round trips of every event, schema evolution both ways, size limits, errors."""
from __future__ import annotations

import json
import random
from datetime import datetime, timezone
from typing import Any

import pytest

from rlstream.schemas.codec import (
    CONFLUENT_MAGIC,
    SINGLE_OBJECT_MAGIC,
    AvroCodec,
    CorruptPayloadError,
    IncompatibleSchemaError,
    PayloadTooLargeError,
    UnknownSchemaError,
    schema_fingerprint,
    schema_json,
)
from rlstream.schemas.models import (
    EVENT_MODELS,
    CallEvent,
    CurriculumInfo,
    DeadLetter,
    DecisionKind,
    PromotionDecision,
    FileDigest,
    GroupCompletion,
    Message,
    MetricEvent,
    OffsetRange,
    PolicyVersion,
    RewardEvent,
    SourceOffset,
    ToolCall,
    TrajectoryEvent,
    TrajectoryGroup,
    TrajectorySource,
    Turn,
    WeightsKind,
    WireModel,
)
from tests.support.factories import make_reward, make_trajectory

REWARD = "rlstream.v1.RewardEvent"


class DictRegistry:
    """The smallest schema registry: ids in registration order (unit tests only)."""

    def __init__(self) -> None:
        self.schemas: list[tuple[str, str]] = []

    def register(self, subject: str, schema_json: str) -> int:
        for i, entry in enumerate(self.schemas):
            if entry == (subject, schema_json):
                return i + 1
        self.schemas.append((subject, schema_json))
        return len(self.schemas)

    def get_schema(self, schema_id: int) -> str:
        return self.schemas[schema_id - 1][1]


def sample_events() -> list[WireModel]:
    """One fully populated instance of every top-level event (plus one with optionals empty)."""
    traj = make_trajectory(with_tool_call=True, turns=3, seed=1)
    traj.source = TrajectorySource.production
    sparse = TrajectoryEvent(run_id="r", example_id="e", group_id="g", group_size=1, generation_index=0,
                             policy="p", policy_version=0, messages=[Message(role="user", content="hi")],
                             turns=[Turn()])
    group = TrajectoryGroup(
        group_id=traj.group_id, run_id=traj.run_id, example_id=traj.example_id, policy="p",
        min_policy_version=3, max_policy_version=5, expected_size=2,
        trajectories=[traj, make_trajectory(generation_index=1, seed=2)],
        reward_mean=0.5, reward_std=0.5, reward_min=0.0, reward_max=1.0, completion=GroupCompletion.timeout,
        curriculum=CurriculumInfo(window=3, rank=1, percentile=0.5, window_size=64),
        source_offsets=[SourceOffset(topic="t", partition=2, offset=2**40)],
    )
    version = PolicyVersion(
        policy="p", version=7, base_model="tiny", kind=WeightsKind.full, uri="file:///tmp/v7",
        files=[FileDigest(path="adapter.safetensors", sha256="ab" * 32, size=1234)], learner_step=70,
        group_count=280, trained_on=[OffsetRange(topic="g", partition=0, first=10, last=20)],
        metrics={"loss": 0.25}, run_id="r", fencing_token=3,
    )
    metric = MetricEvent(source="learner", run_id="r", name="loss", value=-1.5, step=None, tags={"k": "v"})
    letter = DeadLetter(source_topic="t", source_partition=1, source_offset=9, key=None, value=b"\x00\xffraw",
                        error_type="CorruptPayloadError", error_message="bad", service="streams")
    decision = PromotionDecision(policy="toy", version=4, decision=DecisionKind.rollback, reason="operator",
                                 serving_before=6, candidate_metrics={"eval/reward": 0.5}, decided_by="cli",
                                 fencing_token=3)
    call = CallEvent(session_id="acme:s1", tenant="acme", task="t", run_id="r", policy="p", policy_version=3,
                     request_messages=[Message(role="user", content="hi")],
                     response_message=Message(role="assistant", content="hello"),
                     turn=Turn(prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-0.5],
                               policy_version=3, temperature=0.7), served_model="p", gateway_id="g1")
    return [traj, sparse, make_reward(traj, 0.75), group, version, metric, letter, decision, call]


@pytest.fixture(params=["single-object", "confluent"])
def codec(request: pytest.FixtureRequest) -> AvroCodec:
    return AvroCodec() if request.param == "single-object" else AvroCodec(registry=DictRegistry())


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: type(e).__name__)
def test_every_event_round_trips(codec: AvroCodec, event: WireModel) -> None:
    data = codec.encode(event)
    assert data[:2] == SINGLE_OBJECT_MAGIC if codec.registry is None else data[:1] == CONFLUENT_MAGIC
    back = codec.decode(data, type(event))
    assert back == event
    assert back.model_dump() == event.model_dump()


def test_sample_events_cover_every_top_level_event() -> None:
    assert {type(e).avro_name for e in sample_events()} == set(EVENT_MODELS)


def test_tool_calls_and_token_data_survive() -> None:
    traj = make_trajectory(with_tool_call=True, turns=2, seed=3)
    back = AvroCodec().decode(AvroCodec().encode(traj), TrajectoryEvent)
    calls = [c for m in back.messages for c in (m.tool_calls or [])]
    assert calls == [ToolCall(id="call_1", name="lookup", arguments='{"q": "x"}')]
    assert back.messages[3].tool_call_id == "call_1"
    assert back.turns[0].completion_logprobs == traj.turns[0].completion_logprobs


def test_single_object_header_is_the_writer_schema_fingerprint() -> None:
    data = AvroCodec().encode(make_reward(make_trajectory(), 1.0))
    assert data[2:10] == schema_fingerprint(schema_json(REWARD))
    # the spec's example: the fingerprint of "int" is 0x7275d51a3f395c8f, stored little-endian
    assert schema_fingerprint('"int"') == (0x7275D51A3F395C8F).to_bytes(8, "little")


def test_decode_into_the_wrong_model_is_incompatible() -> None:
    codec = AvroCodec()
    data = codec.encode(make_reward(make_trajectory(), 1.0))
    with pytest.raises(IncompatibleSchemaError, match="RewardEvent.*TrajectoryEvent"):
        codec.decode(data, TrajectoryEvent)


# --- schema evolution ----------------------------------------------------------------
def reward_schema_with(extra_field: dict[str, Any]) -> dict[str, Any]:
    schema = json.loads(schema_json(REWARD))
    schema["fields"].append(extra_field)
    return schema


NEW_REWARD = reward_schema_with({"name": "judge", "type": "string", "default": "none"})


def reward_record(**extra: Any) -> dict[str, Any]:
    return {"trajectory_id": "t", "group_id": "g", "example_id": "e", "run_id": "r", "reward": 0.5,
            "components": {"a": 1.0}, "created_at": datetime(2025, 1, 2, 3, 4, 5, 6000, tzinfo=timezone.utc), **extra}


@pytest.mark.parametrize("registry", [False, True], ids=["single-object", "confluent"])
def test_old_reader_reads_new_writer(registry: bool) -> None:
    shared = DictRegistry()
    new_writer = AvroCodec(registry=shared if registry else None)
    new_writer.add_schema(NEW_REWARD, reader=True)
    data = new_writer.encode_record(reward_record(judge="gpt"), REWARD)

    old_reader = AvroCodec(registry=shared if registry else None)
    if not registry:  # without a registry the reader must be told about the newer version
        with pytest.raises(UnknownSchemaError, match="add_schema"):
            old_reader.decode(data, RewardEvent)
        old_reader.add_schema(NEW_REWARD)
    event = old_reader.decode(data, RewardEvent)
    assert event.reward == 0.5 and event.components == {"a": 1.0}
    assert "judge" not in old_reader.decode_record(data, REWARD)


@pytest.mark.parametrize("registry", [False, True], ids=["single-object", "confluent"])
def test_new_reader_reads_old_writer(registry: bool) -> None:
    shared = DictRegistry()
    old_writer = AvroCodec(registry=shared if registry else None)
    data = old_writer.encode(RewardEvent(**reward_record()))

    new_reader = AvroCodec(registry=shared if registry else None)
    new_reader.add_schema(NEW_REWARD, reader=True)
    record = new_reader.decode_record(data, REWARD)
    assert record["judge"] == "none"  # the added field's default
    assert record["reward"] == 0.5 and record["created_at"] == reward_record()["created_at"]


def test_field_added_without_default_is_incompatible() -> None:
    data = AvroCodec().encode(RewardEvent(**reward_record()))
    strict_reader = AvroCodec()
    strict_reader.add_schema(reward_schema_with({"name": "judge", "type": "string"}), reader=True)
    with pytest.raises(IncompatibleSchemaError, match="RewardEvent"):
        strict_reader.decode_record(data, REWARD)


def test_invalid_schema_is_rejected_by_add_schema() -> None:
    with pytest.raises(IncompatibleSchemaError, match="not a valid Avro schema"):
        AvroCodec().add_schema({"type": "record", "name": "X", "fields": [{"name": "a", "type": "nosuchtype"}]})


# --- size ------------------------------------------------------------------------------
def long_trajectory(completion_tokens: int) -> TrajectoryEvent:
    rng = random.Random(0)
    traj = make_trajectory(completion_tokens=1, prompt_tokens=1)
    traj.turns = [Turn(message_index=2, model="policy", function="<workflow>",
                       prompt_token_ids=[rng.randrange(151_936) for _ in range(2048)],
                       completion_token_ids=[rng.randrange(151_936) for _ in range(completion_tokens)],
                       completion_logprobs=[-rng.random() * 10 for _ in range(completion_tokens)])]
    return traj


def test_32k_token_trajectory_fits_under_1mb() -> None:
    traj = long_trajectory(32_768)
    codec = AvroCodec()
    data = codec.encode(traj)
    assert len(data) < 1_000_000
    assert codec.decode(data, TrajectoryEvent) == traj


def test_event_over_the_limit_names_size_and_limit() -> None:
    traj = long_trajectory(32_768)
    size = len(AvroCodec().encode(traj))
    with pytest.raises(PayloadTooLargeError) as info:
        AvroCodec(max_bytes=100_000).encode(traj)
    assert f"{size} bytes" in str(info.value) and "100000 bytes" in str(info.value)


def test_decoding_over_the_limit_is_refused() -> None:
    data = AvroCodec().encode(long_trajectory(4096))
    with pytest.raises(PayloadTooLargeError, match=f"{len(data)} bytes.*limit of 10000"):
        AvroCodec(max_bytes=10_000).decode(data, TrajectoryEvent)


# --- errors ----------------------------------------------------------------------------
def test_unknown_framing_is_corrupt() -> None:
    with pytest.raises(CorruptPayloadError, match="unknown framing"):
        AvroCodec().decode_record(b"{json: 1}")


def test_confluent_payload_without_registry_says_so() -> None:
    data = AvroCodec(registry=DictRegistry()).encode(make_reward(make_trajectory(), 1.0))
    with pytest.raises(UnknownSchemaError, match="no schema registry is configured"):
        AvroCodec().decode(data, RewardEvent)


def test_registry_id_it_does_not_know() -> None:
    with pytest.raises(UnknownSchemaError, match="schema id 99"):
        AvroCodec(registry=DictRegistry()).decode_record(CONFLUENT_MAGIC + (99).to_bytes(4, "big") + b"\x00")


def test_registry_answer_that_is_not_a_schema() -> None:
    class Broken(DictRegistry):
        def get_schema(self, schema_id: int) -> str:
            return "{not json"

    with pytest.raises(UnknownSchemaError, match="not a usable Avro schema"):
        AvroCodec(registry=Broken()).decode_record(CONFLUENT_MAGIC + (1).to_bytes(4, "big") + b"\x00")


def test_trailing_bytes_are_corrupt() -> None:
    data = AvroCodec().encode(make_reward(make_trajectory(), 1.0))
    with pytest.raises(CorruptPayloadError, match="trailing"):
        AvroCodec().decode(data + b"\x00", RewardEvent)


def test_record_not_matching_its_schema_is_refused_on_encode() -> None:
    with pytest.raises(CorruptPayloadError, match="RewardEvent"):
        AvroCodec().encode_record({"trajectory_id": 5}, REWARD)


def test_non_bytes_input_is_corrupt() -> None:
    with pytest.raises(CorruptPayloadError, match="expected bytes"):
        AvroCodec().decode_record("text")  # type: ignore[arg-type]


def test_from_config_uses_the_kafka_limit() -> None:
    from rlstream.schemas.config import KafkaConfig

    codec = AvroCodec.from_config(KafkaConfig(max_message_bytes=50_000), {})
    assert codec.registry is None and codec.max_bytes == 50_000


# --- speed: no resolution for the reader's own version, schemas compiled once ---------------------------
class ReaderSpy:
    """Wraps fastavro.schemaless_reader and records the reader schema of every call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import fastavro

        self.reader_schemas: list[Any] = []
        real = fastavro.schemaless_reader

        def spy(fo: Any, writer: Any, reader: Any = None, *args: Any, **kwargs: Any) -> Any:
            self.reader_schemas.append(reader)
            return real(fo, writer, reader, *args, **kwargs)

        monkeypatch.setattr(fastavro, "schemaless_reader", spy)


class DoclessRegistry(DictRegistry):
    """Its copy of a schema has no docs: the same version (same fingerprint) in other JSON text."""

    def get_schema(self, schema_id: int) -> str:
        def strip(node: Any) -> Any:
            if isinstance(node, list):
                return [strip(n) for n in node]
            return {k: strip(v) for k, v in node.items() if k != "doc"} if isinstance(node, dict) else node

        return json.dumps(strip(json.loads(super().get_schema(schema_id))))


@pytest.mark.parametrize("registry", [None, DictRegistry, DoclessRegistry],
                         ids=["single-object", "confluent", "confluent-other-json"])
def test_same_version_is_read_without_resolution(monkeypatch: pytest.MonkeyPatch,
                                                 registry: type[DictRegistry] | None) -> None:
    shared = registry() if registry else None
    traj = make_trajectory(turns=2, seed=4)
    data = AvroCodec(registry=shared).encode(traj)
    reader = AvroCodec(registry=shared)  # another process: the writer schema comes by id or fingerprint
    spy = ReaderSpy(monkeypatch)
    assert reader.decode(data, TrajectoryEvent) == traj
    assert spy.reader_schemas == [None]


def test_other_version_is_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    data = AvroCodec().encode(RewardEvent(**reward_record()))
    new_reader = AvroCodec()
    new_reader.add_schema(NEW_REWARD, reader=True)
    spy = ReaderSpy(monkeypatch)
    assert new_reader.decode_record(data, REWARD)["judge"] == "none"
    assert spy.reader_schemas == [new_reader.parsed_schema(REWARD)]


def test_schemas_are_parsed_and_fingerprinted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastavro

    import rlstream.schemas.codec as codec_module

    class CountingRegistry(DictRegistry):
        def __init__(self) -> None:
            super().__init__()
            self.gets = 0

        def get_schema(self, schema_id: int) -> str:
            self.gets += 1
            return super().get_schema(schema_id)

    shared = CountingRegistry()
    producers, consumer = [AvroCodec(), AvroCodec(registry=shared)], AvroCodec(registry=shared)
    newer = reward_schema_with({"name": "parsed_once", "type": "string", "default": ""})  # new to this process
    calls: list[str] = []
    for module, name in [(fastavro, "parse_schema"), (codec_module, "schema_fingerprint"),
                         (codec_module, "apache_avro_fingerprint")]:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    traj = make_trajectory(turns=2, seed=5)
    for _ in range(3):
        for producer in producers:
            data = producer.encode(traj)
            assert producer.decode(data, TrajectoryEvent) == traj
            assert (consumer if producer.registry else AvroCodec()).decode(data, TrajectoryEvent) == traj
        data = producers[0].encode_record(reward_record(parsed_once="x"), newer)
        assert producers[0].decode_record(data)["parsed_once"] == "x"
    # the one new schema, once: fastavro's parse plus the specification fingerprint's, and the avro package's
    assert sorted(calls) == ["apache_avro_fingerprint", "parse_schema", "parse_schema", "schema_fingerprint"]
    assert shared.gets == 1  # the consumer fetched the writer schema by id once


def test_confluent_encode_with_a_schema_dict_registers_that_version() -> None:
    """encode_record(record, schema_dict) is headed by the id of that version, not of the name's reader version."""
    shared = DictRegistry()
    writer = AvroCodec(registry=shared)
    old = writer.encode(RewardEvent(**reward_record()))
    new = writer.encode_record(reward_record(judge="gpt"), NEW_REWARD)
    assert old[:5] != new[:5]
    reader = AvroCodec(registry=shared)
    reader.add_schema(NEW_REWARD, reader=True)
    assert reader.decode_record(new, REWARD)["judge"] == "gpt"
    assert reader.decode_record(old, REWARD)["judge"] == "none"
