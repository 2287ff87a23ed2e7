"""Interop: rlstream's bytes read by the `avro` package and by confluent-kafka's Avro deserializer
(with its in-process mock registry), and their bytes read by rlstream."""
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

from rlstream.schemas.codec import CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC, AvroCodec, schema_fingerprint, schema_json
from rlstream.schemas.models import EVENT_MODELS, RewardEvent, WireModel
from tests.unit.test_codec import NEW_REWARD, sample_events

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
