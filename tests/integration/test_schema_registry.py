"""Every writer registers its schemas with the configured registry (basic auth, TLS) under Confluent's
TopicNameStrategy subjects and writes the Confluent wire format; every reader resolves the ids; confluent-kafka's own
deserializer reads every record. The registry is confluent-kafka's registry store behind its REST API
(tests/support/registry_server.py): no registry server installs here."""
from __future__ import annotations

import asyncio
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from rlstream.learner.service import Learner
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.codec import SchemaRegistryUnavailable, codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import CallEvent, DecisionKind, Message, PromotionDecision, Turn
from rlstream.schemas.topics import TopicNames
from rlstream.transport.kafka import make_consumer, make_producer
from rlstream.transport.serving import publish_decision
from tests.support.factories import make_reward, make_trajectory
from tests.support.learner_helpers import tiny_model
from tests.support.registry_server import RegistryServer, self_signed_certificate
from tests.support.streams_helpers import Worker

USER, PASSWORD = "rlstream", "registry-secret"


async def raw_records(cfg: RlstreamConfig, topic: str, at_least: int, timeout_s: float = 90.0) -> list[Any]:
    """Every committed record of ``topic`` once at least ``at_least`` are there (raw: nothing decoded)."""
    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or set())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                out.extend(records)
            ends = await consumer.end_offsets(tps)
            positions = [await consumer.position(tp) for tp in tps]
            if len(out) >= at_least and all(pos >= ends[tp] for pos, tp in zip(positions, tps)):
                return out
        raise AssertionError(f"{topic}: {len(out)} records after {timeout_s} s, expected at least {at_least}")
    finally:
        await consumer.stop()


@pytest.fixture
def tls(tmp_path: Path) -> Any:
    return self_signed_certificate(tmp_path / "tls")


@pytest.fixture
def registry(tls: Any) -> Any:
    server = RegistryServer(USER, PASSWORD, tls).start()
    yield server
    server.stop()


def registry_cfg(rl_config: RlstreamConfig, registry: RegistryServer, tls: Any, tmp_path: Path) -> RlstreamConfig:
    kafka = rl_config.kafka.model_copy(update={"schema_registry_url": registry.url,
                                               "schema_registry_ca_file": tls.certificate})
    kafka = type(kafka).model_validate({**kafka.model_dump(), "schema_registry_basic_auth": f"{USER}:{PASSWORD}"})
    learner = rl_config.learner.model_copy(update={
        "model": str(tiny_model(tmp_path)), "lora": rl_config.learner.lora.model_copy(update={"enabled": True}),
        "groups_per_step": 2, "publish_every": 1, "total_steps": 1, "device": "cpu", "lease_ttl_s": 3.0,
        "run_ids": [rl_config.run_id]})
    return rl_config.model_copy(update={"kafka": kafka, "learner": learner})


def test_every_writer_and_reader_goes_through_the_registry(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                           registry: RegistryServer, tls: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = registry_cfg(rl_config, registry, tls, tmp_path)
    names = created_topics
    monkeypatch.setenv("RLSTREAM_KAFKA__SCHEMA_REGISTRY_BASIC_AUTH", f"{USER}:{PASSWORD}")  # the worker's secret
    # two groups of two, one reward of each group late; then one record that is not Avro (the streams' dlq)
    trajectories = [make_trajectory(run_id=cfg.run_id, example_id=f"ex{e}", group_size=2, generation_index=g,
                                    policy=cfg.policy, reward=None if g == 1 else 0.1, seed=10 * e + g)
                    for e in range(2) for g in range(2)]
    late = [make_reward(t, 0.9) for t in trajectories if t.reward is None]

    async def publish() -> None:
        async with TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards) as publisher:
            for event in trajectories:
                await publisher.publish_trajectory(event)
            for reward in late:
                await publisher.publish_reward(reward)
            await publisher.flush()
        async with TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards, codec=codec_for(cfg),
                                                   calls_topic=names.calls) as gateway_publisher:  # a gateway's call
            await gateway_publisher.submit(names.calls, "registry-session", CallEvent(
                session_id="registry-session", policy=cfg.policy, request_messages=[Message(role="user", content="q")],
                response_message=Message(role="assistant", content="a"),
                turn=Turn(prompt_token_ids=[1], completion_token_ids=[2])))
            await gateway_publisher.flush()
        producer = make_producer(cfg.kafka)
        await producer.start()
        await producer.send_and_wait(names.trajectories, b"not avro at all", key=b"ex0")
        await publish_decision(producer, codec_for(cfg), names.promotions, PromotionDecision(  # a gate's decision
            policy=cfg.policy, version=1, decision=DecisionKind.reject, reason="registry check", decided_by="test"))
        await producer.stop()

    worker = Worker(cfg, "w1", tmp_path, **{"kafka.schema_registry_url": registry.url,
                                             "kafka.schema_registry_ca_file": str(tls.certificate)}).start()
    try:
        asyncio.run(publish())
        groups = asyncio.run(raw_records(cfg, names.groups, at_least=2))
        asyncio.run(raw_records(cfg, names.dlq, at_least=1))
        asyncio.run(raw_records(cfg, names.metrics, at_least=1))
    finally:
        worker.stop()
    assert worker.proc is not None and "Traceback" not in worker.log_tail(200), worker.log_tail(60)
    state = asyncio.run(Learner(cfg, holder="registry-test").run())  # reads groups by id, writes a version
    assert state.step == 1 and state.groups_trained == 2

    theirs = SchemaRegistryClient({"url": registry.url, "basic.auth.user.info": f"{USER}:{PASSWORD}",
                                   "ssl.ca.location": str(tls.certificate)})
    deserialize = AvroDeserializer(theirs)
    read: dict[str, list[dict[str, Any]]] = {}
    for topic in names.all():
        records = asyncio.run(raw_records(cfg, topic, at_least=1))
        for record in records:
            if record.value == b"not avro at all":
                continue
            assert record.value[:1] == b"\x00", f"{topic}: not the Confluent wire format: {record.value[:8]!r}"
            (schema_id,) = struct.unpack(">I", record.value[1:5])
            assert registry.subject_of(schema_id) == [f"{topic}-value"], (topic, schema_id)
            context = SerializationContext(topic, MessageField.VALUE)
            read.setdefault(topic, []).append(deserialize(record.value, context))
    assert sorted(t["trajectory_id"] for t in read[names.trajectories]) == sorted(t.trajectory_id
                                                                          for t in trajectories)
    assert [r["reward"] for r in read[names.rewards]] == [0.9, 0.9]
    assert sorted(g["group_id"] for g in read[names.groups]) == sorted({t.group_id for t in trajectories})
    assert len(groups) == 2
    assert [v["version"] for v in read[names.policy_versions]] == [0, 1]  # the base weights, then the step's
    assert [d["error_type"] for d in read[names.dlq]] == ["corrupt_payload"]
    assert [(d["version"], d["decision"]) for d in read[names.promotions]] == [(1, "reject")]
    sources = {m["source"].split(":")[0] for m in read[names.metrics]}
    assert {"streams", "learner"} <= sources, sources
    assert not [k for k in registry.requests if k.endswith(" 401")], registry.requests


def test_a_writer_without_the_registry_credentials_stops_at_start(rl_config: RlstreamConfig,
                                                                 created_topics: TopicNames,
                                                                 registry: RegistryServer, tls: Any) -> None:
    kafka = rl_config.kafka.model_copy(update={"schema_registry_url": registry.url,
                                               "schema_registry_ca_file": tls.certificate})

    async def start(kafka: Any) -> None:
        async with TrajectoryPublisher.from_config(kafka, created_topics.trajectories, created_topics.rewards):
            pass

    with pytest.raises(SchemaRegistryUnavailable, match="401"):
        asyncio.run(start(kafka))
    assert registry.requests["POST 401"] >= 1 and registry.requests["POST 200"] == 0
    with pytest.raises(SchemaRegistryUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(start(kafka.model_copy(update={"schema_registry_ca_file": None})))
