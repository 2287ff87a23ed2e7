"""The codec with a schema registry: subjects by strategy, confluent-kafka's client, the failure cache, config."""
from __future__ import annotations

import itertools
import struct
import uuid

import pytest
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from rlstream.schemas.codec import (CONFLUENT_MAGIC, AvroCodec, ConfluentRegistry, SchemaRegistryUnavailable,
                                    SubjectNames, UnknownSchemaError, codec_for, registry_client_conf)
from rlstream.schemas.config import KafkaConfig, RlstreamConfig
from rlstream.schemas.masking import secret_env
from rlstream.schemas.models import DeadLetter, RewardEvent, TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from tests.support.factories import make_reward, make_trajectory


def mock_registry_url() -> str:
    return f"mock://{uuid.uuid4().hex}"  # confluent-kafka's in-process registry, one per test


def registry_config(**extra: object) -> RlstreamConfig:
    return RlstreamConfig.model_validate({"topics": {"prefix": "unit."},
                                          "kafka": {"schema_registry_url": mock_registry_url(), **extra}})


@pytest.mark.parametrize(("strategy", "subject"), [
    ("topic_name", "unit.trajectories-value"),
    ("record_name", "rlstream.v1.TrajectoryEvent"),
    ("topic_record_name", "unit.trajectories-rlstream.v1.TrajectoryEvent"),
])
def test_the_subject_follows_the_configured_strategy(strategy: str, subject: str) -> None:
    cfg = registry_config(schema_registry_subject_strategy=strategy)
    codec = codec_for(cfg)
    data = codec.encode(make_trajectory())
    assert isinstance(codec.registry, ConfluentRegistry)
    client = codec.registry.client
    assert client.get_subjects() == [subject]
    (schema_id,) = struct.unpack(">I", data[1:5])
    assert data[:1] == CONFLUENT_MAGIC and client.get_latest_version(subject).schema_id == schema_id


def test_confluents_own_deserializer_reads_what_the_codec_wrote() -> None:
    cfg = registry_config()
    codec = codec_for(cfg)
    event = make_reward(make_trajectory(), 0.75)
    data = codec.encode(event)
    assert isinstance(codec.registry, ConfluentRegistry)
    theirs = AvroDeserializer(codec.registry.client)(
        data, SerializationContext(TopicNames.from_config(cfg.topics).rewards, MessageField.VALUE))
    assert theirs["trajectory_id"] == event.trajectory_id and theirs["reward"] == 0.75
    fresh = AvroCodec(registry=codec.registry)  # another process on the same registry: the schema comes by id
    assert fresh.decode(data, RewardEvent) == event


def test_a_record_outside_the_topics_needs_the_record_name_strategy() -> None:
    codec = AvroCodec(registry=ConfluentRegistry({"url": mock_registry_url()}), subjects=SubjectNames("topic_name"))
    with pytest.raises(SchemaRegistryUnavailable, match="no topic is known for rlstream.v1.TrajectoryEvent"):
        codec.encode(make_trajectory())


class CountingRegistry:
    """Answers no schema id, counting the questions."""

    def __init__(self) -> None:
        self.lookups = 0

    def register(self, subject: str, schema_json: str) -> int:
        raise ConnectionError("registry down")

    def get_schema(self, schema_id: int) -> str:
        self.lookups += 1
        raise LookupError(f"schema {schema_id} not found")


def test_an_unresolvable_id_is_asked_once_per_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count(1000.0, 1.0)  # one second per call of time.monotonic
    monkeypatch.setattr("rlstream.schemas.codec.time.monotonic", lambda: next(clock))
    registry = CountingRegistry()
    codec = AvroCodec(registry=registry, failure_ttl_s=30.0)
    payload = CONFLUENT_MAGIC + (7).to_bytes(4, "big") + b"\x00"
    for _ in range(10):
        with pytest.raises(UnknownSchemaError, match="schema id 7"):
            codec.decode_record(payload)
    assert registry.lookups == 1  # nine records failed at once, from the remembered failure
    for _ in range(30):
        with pytest.raises(UnknownSchemaError):
            codec.decode_record(payload)
    assert registry.lookups == 2  # the ttl ran out: asked again


def test_without_the_failure_cache_every_record_asks() -> None:
    """The control: with a zero ttl each record costs a registry request."""
    registry = CountingRegistry()
    codec = AvroCodec(registry=registry, failure_ttl_s=0.0)
    for _ in range(5):
        with pytest.raises(UnknownSchemaError):
            codec.decode_record(CONFLUENT_MAGIC + (7).to_bytes(4, "big") + b"\x00")
    assert registry.lookups == 5


def test_a_registry_that_is_down_stops_a_writer_at_start_and_is_not_a_bad_event() -> None:
    codec = AvroCodec(registry=CountingRegistry(), subjects=SubjectNames("record_name"))
    with pytest.raises(SchemaRegistryUnavailable, match="registry down") as raised:
        codec.ensure_registered([TrajectoryEvent.avro_name, DeadLetter.avro_name])
    assert not isinstance(raised.value, UnknownSchemaError)  # not a CodecError: nothing is dead-lettered for it


def test_client_settings_come_from_the_config() -> None:
    kafka = KafkaConfig.model_validate({
        "schema_registry_url": "https://registry.example:8081", "schema_registry_basic_auth": "svc:s3cret",
        "schema_registry_ca_file": "/etc/ca.pem", "schema_registry_cert_file": "/etc/client.pem",
        "schema_registry_key_file": "/etc/client.key", "schema_registry_timeout_s": 4, "schema_registry_retries": 5})
    conf = registry_client_conf(kafka)
    assert conf["url"] == "https://registry.example:8081" and conf["basic.auth.user.info"] == "svc:s3cret"
    assert (conf["ssl.ca.location"], conf["ssl.certificate.location"], conf["ssl.key.location"]) == (
        "/etc/ca.pem", "/etc/client.pem", "/etc/client.key")
    assert conf["timeout"] == 4 and conf["max.retries"] == 5  # the TLS files are used live: test_schema_registry.py


def test_the_registry_password_is_a_secret() -> None:
    cfg = RlstreamConfig.model_validate({"kafka": {"schema_registry_url": "https://registry.example:8081",
                                                   "schema_registry_basic_auth": "svc:s3cret"}})
    assert "s3cret" not in cfg.model_dump_json()
    assert secret_env(cfg)["RLSTREAM_KAFKA__SCHEMA_REGISTRY_BASIC_AUTH"] == "svc:s3cret"


async def test_the_writers_not_run_live_against_the_registry_build_their_codec_on_it() -> None:
    """The sync worker, the learner and the rollout and gateway publishers take the configured registry and name
    their subjects after the configured topics (the publisher, streams worker and learner also run live against a
    registry in tests/integration/test_schema_registry.py)."""
    from rlstream.inference.sync import InferenceSyncWorker
    from rlstream.learner.service import Learner
    from rlstream.rollout.publisher import TrajectoryPublisher
    from rlstream.schemas.models import MetricEvent, PolicyVersion

    cfg = registry_config(bootstrap_servers="127.0.0.1:9")  # clients are built, never started
    names = TopicNames.from_config(cfg.topics)
    sync = InferenceSyncWorker(cfg, backend=None, control=None)  # type: ignore[arg-type]
    learner = Learner(cfg)
    cli_publisher = TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards, codec=codec_for(cfg))
    sdk_publisher = TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards)
    for codec, schemas in ((sync.codec, [MetricEvent, DeadLetter]), (learner.codec, [PolicyVersion, MetricEvent]),
                           (cli_publisher.codec, [TrajectoryEvent, MetricEvent]),
                           (sdk_publisher.codec, [TrajectoryEvent, RewardEvent])):
        assert isinstance(codec.registry, ConfluentRegistry)
        assert [codec.subjects.subject(s.avro_name) for s in schemas] == [
            f"{names.schema_topics()[s.avro_name]}-value" for s in schemas]
    await sync.producer.stop()
    for publisher in (cli_publisher, sdk_publisher):
        await publisher.producer.stop()
