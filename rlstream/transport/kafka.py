"""Kafka client configuration and topic administration (aiokafka).

Every service builds its clients here so that bootstrap servers and the SASL/SSL settings
of :class:`schemas.config.KafkaConfig` reach every producer, consumer and admin client.
"""
from __future__ import annotations

import ssl
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from rlstream.transport import aborted_index, fetch_wait
from rlstream.transport.log import get_logger
from rlstream.schemas.config import KafkaConfig, TopicsConfig
from rlstream.schemas.topics import LONG_RETENTION_TOPICS, TopicNames

log = get_logger(__name__)


def ssl_context(kafka: KafkaConfig) -> ssl.SSLContext | None:
    """The TLS context of every connection under ``SSL`` and ``SASL_SSL`` (None under the plaintext protocols):
    certificates verified against ``ssl_cafile`` (else the system's trust store), the broker's host name checked,
    and ``ssl_certfile``/``ssl_keyfile`` presented for mutual TLS when set."""
    if kafka.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    from aiokafka.helpers import create_ssl_context

    return create_ssl_context(
        cafile=str(kafka.ssl_cafile) if kafka.ssl_cafile else None,
        certfile=str(kafka.ssl_certfile) if kafka.ssl_certfile else None,
        keyfile=str(kafka.ssl_keyfile) if kafka.ssl_keyfile else None,
        password=kafka.ssl_password.get_secret_value() if kafka.ssl_password else None,
    )


def client_options(kafka: KafkaConfig) -> dict[str, Any]:
    """Options common to every aiokafka client: bootstrap, client id, security."""
    if not kafka.bootstrap_servers:
        raise ValueError("kafka.bootstrap_servers is empty: start `rlstream infra up` or set RLSTREAM_KAFKA_BOOTSTRAP")
    opts: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap_servers,
        "client_id": kafka.client_id,
        "security_protocol": kafka.security_protocol,
        "request_timeout_ms": kafka.request_timeout_ms,
    }
    context = ssl_context(kafka)
    if context is not None:
        opts["ssl_context"] = context
    if kafka.sasl_mechanism:
        opts["sasl_mechanism"] = kafka.sasl_mechanism
        opts["sasl_plain_username"] = kafka.sasl_plain_username
        # the one place the password is read in clear (it is a SecretStr everywhere else)
        opts["sasl_plain_password"] = (kafka.sasl_plain_password.get_secret_value()
                                       if kafka.sasl_plain_password is not None else None)
    return opts


def make_producer(kafka: KafkaConfig, *, transactional_id: str | None = None, **extra: Any) -> AIOKafkaProducer:
    """An idempotent producer (acks=all); transactional when ``transactional_id`` is given."""
    opts = client_options(kafka)
    opts.pop("request_timeout_ms")
    opts.update(
        enable_idempotence=True,
        acks="all",
        max_request_size=kafka.max_message_bytes + 64 * 1024,
        request_timeout_ms=kafka.request_timeout_ms,
    )
    if transactional_id:
        opts["transactional_id"] = transactional_id
    opts.update(extra)
    return AIOKafkaProducer(**opts)


def make_consumer(kafka: KafkaConfig, *topics: str, group_id: str | None, **extra: Any) -> AIOKafkaConsumer:
    """A consumer with explicit settings; ``group_id=None`` for a group-less reader."""
    opts = client_options(kafka)
    opts.update(
        group_id=group_id,
        session_timeout_ms=kafka.session_timeout_ms,
        heartbeat_interval_ms=max(1000, kafka.session_timeout_ms // 3),
        fetch_max_bytes=max(52428800, kafka.max_message_bytes * 4),
        max_partition_fetch_bytes=max(1048576, kafka.max_message_bytes * 2),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    opts.update(extra)
    fetch_wait.install(kafka.empty_fetch_wait_ms)  # see fetch_wait: no busy polling of a broker that never waits
    if opts.get("isolation_level") == "read_committed":
        aborted_index.install()  # see aborted_index: committed records after an aborted transaction stay visible
    return AIOKafkaConsumer(*topics, **opts)


def topic_specs(topics: TopicsConfig) -> list[NewTopic]:
    """Every topic of DESIGN.md with its partitions and retention."""
    names = TopicNames.from_config(topics)
    specs = []
    for full in names.all():
        long_kept = any(full == names.prefix + short for short in LONG_RETENTION_TOPICS)
        retention = topics.policy_versions_retention_ms if long_kept else topics.retention_ms
        specs.append(
            NewTopic(
                name=full,
                num_partitions=topics.partitions,
                replication_factor=topics.replication_factor,
                topic_configs={"retention.ms": str(retention)},
            )
        )
    return specs


async def create_topics(kafka: KafkaConfig, topics: TopicsConfig) -> dict[str, str]:
    """Create every topic that does not exist yet. Returns ``{topic: "created" | "exists"}``."""
    admin = AIOKafkaAdminClient(**client_options(kafka))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        outcome = {spec.name: "exists" for spec in topic_specs(topics) if spec.name in existing}
        missing = [spec for spec in topic_specs(topics) if spec.name not in existing]
        for spec in missing:
            try:
                response = await admin.create_topics([spec])
                errors = [e for e in getattr(response, "topic_errors", []) if e[1] not in (0, 36)]
                if errors:
                    raise RuntimeError(f"creating topic {spec.name} failed: {errors}")
                outcome[spec.name] = "created" if not _already_exists(response) else "exists"
            except TopicAlreadyExistsError:
                outcome[spec.name] = "exists"
        log.info("topics ready", topics=outcome)
        return outcome
    finally:
        await admin.close()


def _already_exists(response: Any) -> bool:
    return any(e[1] == 36 for e in getattr(response, "topic_errors", []))


async def list_topics(kafka: KafkaConfig) -> dict[str, int]:
    """``{topic: partition count}`` of every topic on the cluster."""
    consumer = AIOKafkaConsumer(**client_options(kafka))
    await consumer.start()
    try:
        names = await consumer.topics()
        return {name: len(consumer.partitions_for_topic(name) or ()) for name in sorted(names)}
    finally:
        await consumer.stop()
