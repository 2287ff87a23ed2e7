"""Interop: rlstream's bytes read by the `avro` package and by confluent-kafka's Avro deserializer
(with its in-process mock registry), and their bytes read by rlstream, including single-object payloads
headed by the `avro` package's own fingerprint (which differs from the specification's for logical types)."""
from __future__ import annotations

import io
import json
import uuid
from typing import Any

import avro.io
import avro.schema
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from rlstream.schemas.codec import (
    AVSC_DIR,
    CONFLUENT_MAGIC,
    SINGLE_OBJECT_MAGIC,
    AvroCodec,
    UnknownSchemaError,
    apache_avro_fingerprint,
    schema_fingerprint,
    schema_json,
)
from rlstream.schemas.models import EVENT_MODELS, RewardEvent, TrajectoryEvent, WireModel
from tests.unit.test_codec import NEW_REWARD, DictRegistry, sample_events

EVENTS = sample_events()
CTX = SerializationContext("rlstream.test", MessageField.VALUE)


def without_logical_types(node: Any) -> Any:
    """The same schema with ``logicalType`` removed: by the Avro spec its parsing canonical form,
    and so its CRC-64-AVRO fingerprint, is unchanged. (The `avro` package keeps ``{"type":"long"}``
    for a logical long in its canonical form, against the spec's PRIMITIVES rule, so its fingerprint
    of the original schema differs from Java's, fastavro's and ours.)"""
    if isinstance(node, list):
        return [without_logical_types(n) for n in node]
    if isinstance(node, dict):
        return {k: without_logical_types(v) for k, v in node.items() if k != "logicalType"}
    return node


def avro_fingerprint(schema_str: str) -> bytes:
    return avro.schema.parse(json.dumps(without_logical_types(json.loads(schema_str)))).fingerprint("CRC-64-AVRO")


# --- the avro package ----------------------------------------------------------------
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_avro_package_reads_rlstream_single_object(event: WireModel) -> None:
    data = AvroCodec().encode(event)
    assert data[:2] == SINGLE_OBJECT_MAGIC
    writer_json = schema_json(event.avro_name)
    assert data[2:10] == avro_fingerprint(writer_json)

    writer = avro.schema.parse(writer_json)
    record = avro.io.DatumReader(writer).read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))
    assert type(event).model_validate(record) == event


@pytest.mark.parametrize("name", ["rlstream.v1.Message", "rlstream.v1.Turn", "rlstream.v1.ToolCall",
                                  "rlstream.v1.SourceOffset", "rlstream.v1.FileDigest"])
def test_fingerprint_equals_avro_package_without_logical_types(name: str) -> None:
    """Schemas without logical types: the avro package's own fingerprint, untouched."""
    assert schema_fingerprint(schema_json(name)) == avro.schema.parse(schema_json(name)).fingerprint("CRC-64-AVRO")


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_rlstream_reads_avro_package_single_object(event: WireModel) -> None:
    writer_json = schema_json(event.avro_name)
    body = io.BytesIO()
    avro.io.DatumWriter(avro.schema.parse(writer_json)).write(
        event.model_dump(mode="python"), avro.io.BinaryEncoder(body)
    )
    data = SINGLE_OBJECT_MAGIC + avro_fingerprint(writer_json) + body.getvalue()
    assert AvroCodec().decode(data, type(event)) == event


# --- confluent-kafka ------------------------------------------------------------------
class ConfluentRegistryAdapter:
    """schemas.codec.SchemaRegistry on top of confluent-kafka's SchemaRegistryClient."""

    def __init__(self, client: SchemaRegistryClient) -> None:
        self.client = client

    def register(self, subject: str, schema_json: str) -> int:
        return int(self.client.register_schema(subject, Schema(schema_json, "AVRO")))

    def get_schema(self, schema_id: int) -> str:
        return str(self.client.get_schema(schema_id).schema_str)


@pytest.fixture
def mock_registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_confluent_deserializer_reads_rlstream(mock_registry: SchemaRegistryClient, event: WireModel) -> None:
    data = AvroCodec(registry=ConfluentRegistryAdapter(mock_registry)).encode(event)
    assert data[:1] == CONFLUENT_MAGIC
    record = AvroDeserializer(mock_registry)(data, CTX)
    assert type(event).model_validate(record) == event


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_rlstream_reads_confluent_serializer(mock_registry: SchemaRegistryClient, event: WireModel) -> None:
    serializer = AvroSerializer(mock_registry, schema_json(event.avro_name))
    data = serializer(event.model_dump(mode="python"), CTX)
    assert data[:1] == CONFLUENT_MAGIC
    codec = AvroCodec(registry=ConfluentRegistryAdapter(mock_registry))
    assert codec.decode(data, type(event)) == event


def test_rlstream_reads_newer_schema_from_confluent(mock_registry: SchemaRegistryClient) -> None:
    """Evolution across libraries: confluent writes a newer RewardEvent, rlstream (older) reads it."""
    event = next(e for e in EVENTS if isinstance(e, RewardEvent))
    serializer = AvroSerializer(mock_registry, json.dumps(NEW_REWARD))
    data = serializer({**event.model_dump(mode="python"), "judge": "gpt"}, CTX)
    assert AvroCodec(registry=ConfluentRegistryAdapter(mock_registry)).decode(data, RewardEvent) == event


def test_sample_events_cover_every_top_level_event() -> None:
    assert {type(e).avro_name for e in EVENTS} == set(EVENT_MODELS)


# --- the avro package's own fingerprint (logical types) ----------------------------------------
def apache_single_object(event: WireModel, writer_json: str) -> bytes:
    """What a Python producer using the avro package writes: C3 01 + the package's own fingerprint + body
    (the package has no single-object encoder; its fingerprint is what such producers put in the header)."""
    writer = avro.schema.parse(writer_json)
    body = io.BytesIO()
    avro.io.DatumWriter(writer).write(event.model_dump(mode="python"), avro.io.BinaryEncoder(body))
    return SINGLE_OBJECT_MAGIC + writer.fingerprint("CRC-64-AVRO") + body.getvalue()


def test_trajectory_event_has_a_logical_type_so_the_fingerprints_differ() -> None:
    """The negative control's premise: created_at is timestamp-millis, and the avro package's fingerprint of
    TrajectoryEvent is not the specification's one (the one in our headers and in Java's)."""
    writer_json = schema_json("rlstream.v1.TrajectoryEvent")
    created_at = next(f for f in json.loads(writer_json)["fields"] if f["name"] == "created_at")
    assert created_at["type"] == {"type": "long", "logicalType": "timestamp-millis"}
    assert avro.schema.parse(writer_json).fingerprint("CRC-64-AVRO") != schema_fingerprint(writer_json)


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_rlstream_reads_avro_package_single_object_with_its_own_fingerprint(event: WireModel) -> None:
    writer_json = schema_json(event.avro_name)
    data = apache_single_object(event, writer_json)
    assert data[2:10] == apache_avro_fingerprint(writer_json)
    assert AvroCodec().decode(data, type(event)) == event
    assert AvroCodec(registry=DictRegistry()).decode(data, type(event)) == event  # readers accept both framings


def test_without_the_avro_package_fingerprint_mapping_it_is_unknown() -> None:
    """Negative control: take the extra mapping out and the same bytes are an unknown writer schema."""
    event = next(e for e in EVENTS if isinstance(e, TrajectoryEvent))
    writer_json = schema_json(event.avro_name)
    data = apache_single_object(event, writer_json)
    codec = AvroCodec()
    assert codec.decode(data, TrajectoryEvent) == event
    del codec._by_fingerprint[data[2:10]]
    assert codec.decode(codec.encode(event), TrajectoryEvent) == event  # the specification's one still maps
    with pytest.raises(UnknownSchemaError, match=data[2:10].hex()):
        codec.decode(data, TrajectoryEvent)


def test_old_reader_reads_newer_avro_package_writer_by_its_fingerprint() -> None:
    """Evolution with the package's fingerprint: a newer RewardEvent (logical type created_at) written by the
    avro package is read by an older rlstream that was told about the version with add_schema."""
    event = next(e for e in EVENTS if isinstance(e, RewardEvent))
    writer = avro.schema.parse(json.dumps(NEW_REWARD))
    body = io.BytesIO()
    avro.io.DatumWriter(writer).write({**event.model_dump(mode="python"), "judge": "gpt"}, avro.io.BinaryEncoder(body))
    data = SINGLE_OBJECT_MAGIC + writer.fingerprint("CRC-64-AVRO") + body.getvalue()
    old_reader = AvroCodec()
    with pytest.raises(UnknownSchemaError):
        old_reader.decode(data, RewardEvent)
    old_reader.add_schema(NEW_REWARD)
    assert old_reader.decode(data, RewardEvent) == event


ALL_SCHEMAS = sorted(p.name[: -len(".avsc")] for p in AVSC_DIR.glob("*.avsc"))
TRICKY_SCHEMA = {  # nested and inherited namespaces, a fixed used twice, enum references, logical types
    "type": "record", "name": "R", "namespace": "a.b", "doc": "d", "fields": [
        {"name": "f", "type": {"type": "fixed", "name": "F", "size": 4}},
        {"name": "g", "type": "F", "default": "abcd"},
        {"name": "h", "type": {"type": "record", "name": "x.Inner", "fields": [
            {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"], "default": "A"}},
            {"name": "r", "type": ["null", "a.b.R"]}]}},
        {"name": "i", "type": "x.E"},
        {"name": "j", "type": {"type": "map",
                               "values": {"type": "array", "items": {"type": "int", "logicalType": "date"}}}},
        {"name": "k", "type": {"type": "bytes", "logicalType": "decimal", "precision": 4, "scale": 2}},
        {"name": "l", "type": {"type": "string", "doc": "only a doc"}},
        {"name": "m", "type": {"type": "long", "custom": 1}},
        {"name": "n", "type": {"type": "fixed", "name": "D", "size": 8, "logicalType": "decimal", "precision": 9}},
        {"name": "o", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}], "default": None},
    ]}


@pytest.mark.parametrize("schema", [*ALL_SCHEMAS, "tricky"])
def test_apache_fingerprint_equals_the_avro_package(schema: str) -> None:
    schema_str = json.dumps(TRICKY_SCHEMA) if schema == "tricky" else schema_json(schema)
    assert apache_avro_fingerprint(schema_str) == avro.schema.parse(schema_str).fingerprint("CRC-64-AVRO")
    # ... and, with the logical types taken out, the specification's fingerprint (what fastavro and Java compute)
    stripped = json.dumps(without_logical_types(json.loads(schema_str)))
    assert schema_fingerprint(stripped) == schema_fingerprint(schema_str)
