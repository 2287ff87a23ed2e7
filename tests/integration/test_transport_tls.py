"""TLS and authentication on the transport: Kafka over a real TLS listener (a TLS-terminating proxy in front of the
local broker, tests/support/tls_support.py) for the aiokafka clients and the Faust streams worker under SSL and SASL_SSL,
and the Redis control plane against a redis-server that listens only with TLS and requires a password.
Each has its negative control: a client without TLS, or trusting another CA, or with a wrong password, fails."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError
from redis.exceptions import ConnectionError as RedisConnectionError

from rlstream.ops.infra import LocalStack
from rlstream.schemas.config import KafkaConfig, RlstreamConfig, load_config
from rlstream.schemas.masking import mask_url
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.transport.control import ControlPlane, ControlPlaneRefused
from rlstream.transport.kafka import create_topics, make_consumer, make_producer
from tests.support.streams_helpers import Worker, assert_groups_match, interleaved_stream, publish, read_groups
from tests.support.tls_support import KafkaTlsProxy, TlsFiles, TlsRedis, make_tls_files, start_tls_redis

SASL_USER, SASL_PASSWORD = "rlstream", "kafka-secret"
REDIS_PASSWORD = "redis-secret-7"


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tls")


@pytest.fixture(scope="module")
def tls(tls_dir: Path) -> TlsFiles:
    return make_tls_files(tls_dir, "trusted")


@pytest.fixture(scope="module")
def other_ca(tls_dir: Path) -> TlsFiles:
    """A CA that never signed the servers' certificates."""
    return make_tls_files(tls_dir, "other")


@pytest.fixture(scope="module")
def kafka_proxy(local_stack: LocalStack, tls: TlsFiles) -> Iterator[KafkaTlsProxy]:
    proxy = KafkaTlsProxy(local_stack.bootstrap, tls).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def tls_redis(tls_dir: Path, tls: TlsFiles) -> Iterator[TlsRedis]:
    server = start_tls_redis(tls_dir, tls, REDIS_PASSWORD)
    yield server
    server.stop()


def over_tls(cfg: RlstreamConfig, proxy: KafkaTlsProxy, protocol: str, cafile: Path) -> RlstreamConfig:
    """``cfg`` pointed at the TLS proxy with ``protocol`` (SASL PLAIN credentials under the SASL protocols)."""
    kafka: dict[str, Any] = {"bootstrap_servers": proxy.bootstrap, "security_protocol": protocol,
                             "ssl_cafile": cafile}
    if protocol.startswith("SASL"):
        kafka.update(sasl_mechanism="PLAIN", sasl_plain_username=SASL_USER, sasl_plain_password=SASL_PASSWORD)
    section = cfg.kafka.model_dump(exclude={"sasl_plain_password", "ssl_password"}) | kafka
    return cfg.model_copy(update={"kafka": KafkaConfig.model_validate(section)})


def tls_overrides(cfg: RlstreamConfig) -> dict[str, Any]:
    """The worker's ``-o`` settings for the security of ``cfg.kafka`` (``worker_overrides`` sends the rest)."""
    kafka = cfg.kafka
    extra: dict[str, Any] = {"kafka.security_protocol": kafka.security_protocol, "kafka.ssl_cafile": kafka.ssl_cafile}
    if kafka.sasl_mechanism:
        extra.update({"kafka.sasl_mechanism": kafka.sasl_mechanism,
                      "kafka.sasl_plain_username": kafka.sasl_plain_username,
                      "kafka.sasl_plain_password": SASL_PASSWORD})
    return extra


async def round_trip(cfg: RlstreamConfig, topic: str, payload: bytes, timeout_s: float = 20.0) -> list[bytes]:
    """Create topics, send ``payload`` to ``topic`` and read the topic back, all with rlstream's own clients."""
    await create_topics(cfg.kafka, cfg.topics)
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(topic, payload, key=b"k")
    finally:
        await producer.stop()
    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or set())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        seen: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while not seen and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            seen += [r.value for records in batch.values() for r in records]
        return seen
    finally:
        await consumer.stop()


async def bootstrap_error(cfg: RlstreamConfig) -> BaseException | None:
    """What starting a producer with ``cfg.kafka`` raises (None when it connects)."""
    producer = make_producer(cfg.kafka, request_timeout_ms=5000)
    try:
        await asyncio.wait_for(producer.start(), 30)
        return None
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return exc
    finally:
        await producer.stop()


@pytest.mark.parametrize("protocol", ["SSL", "SASL_SSL"])
def test_kafka_clients_connect_over_tls(rl_config: RlstreamConfig, kafka_proxy: KafkaTlsProxy, tls: TlsFiles,
                                        protocol: str) -> None:
    cfg = over_tls(rl_config, kafka_proxy, protocol, tls.ca_cert)
    names = TopicNames.from_config(cfg.topics)
    before = kafka_proxy.handshakes
    assert asyncio.run(round_trip(cfg, names.trajectories, b"over tls")) == [b"over tls"]
    assert kafka_proxy.handshakes > before  # every connection went through the TLS listener


def test_kafka_clients_without_tls_or_trusting_another_ca_are_refused(
        rl_config: RlstreamConfig, kafka_proxy: KafkaTlsProxy, tls: TlsFiles, other_ca: TlsFiles) -> None:
    failed = kafka_proxy.failed_handshakes
    plain = over_tls(rl_config, kafka_proxy, "SASL_PLAINTEXT", tls.ca_cert)  # SASL without TLS
    assert isinstance(asyncio.run(bootstrap_error(plain)), KafkaConnectionError)
    deadline = time.monotonic() + 10  # the listener's side of the failed handshake may end after the client's
    while kafka_proxy.failed_handshakes == failed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kafka_proxy.failed_handshakes > failed  # the listener saw a client that does not speak TLS
    untrusted = over_tls(rl_config, kafka_proxy, "SSL", other_ca.ca_cert)  # the client rejects the certificate
    assert isinstance(asyncio.run(bootstrap_error(untrusted)), KafkaConnectionError)
    trusted = over_tls(rl_config, kafka_proxy, "SSL", tls.ca_cert)  # the same listener takes a trusting client
    assert asyncio.run(bootstrap_error(trusted)) is None


def test_streams_worker_under_sasl_ssl_processes_groups(rl_config: RlstreamConfig, kafka_proxy: KafkaTlsProxy,
                                                         tls: TlsFiles, tmp_path: Path) -> None:
    cfg = over_tls(rl_config, kafka_proxy, "SASL_SSL", tls.ca_cert)
    names = TopicNames.from_config(cfg.topics)
    asyncio.run(prepare_topics(cfg))
    records, expected = interleaved_stream(cfg, n_examples=4, group_size=2, seed=7)
    asyncio.run(publish(cfg, records))
    worker = Worker(cfg, "tls1", tmp_path, **tls_overrides(cfg)).start()
    try:
        groups = asyncio.run(read_groups(cfg, names.groups, expect=len(expected), timeout_s=90, quiet_s=1))
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()
    assert_groups_match(groups, expected)


def test_streams_worker_speaking_sasl_in_clear_gets_nothing_through_the_tls_listener(
        rl_config: RlstreamConfig, kafka_proxy: KafkaTlsProxy, tls: TlsFiles, tmp_path: Path) -> None:
    """Negative control: what Faust did under SASL_SSL without a TLS context (SASL in clear) cannot use the
    listener: no group comes out while the same input waits on the topics."""
    cfg = over_tls(rl_config, kafka_proxy, "SASL_SSL", tls.ca_cert)
    names = TopicNames.from_config(cfg.topics)
    asyncio.run(prepare_topics(cfg))
    records, _ = interleaved_stream(cfg, n_examples=2, group_size=2, seed=8)
    asyncio.run(publish(cfg, records))
    failed = kafka_proxy.failed_handshakes
    in_clear = over_tls(rl_config, kafka_proxy, "SASL_PLAINTEXT", tls.ca_cert)
    worker = Worker(in_clear, "clear1", tmp_path, **tls_overrides(in_clear)).start()
    try:
        assert asyncio.run(read_groups(cfg, names.groups, timeout_s=20, quiet_s=20)) == []
    finally:
        worker.stop()
    assert kafka_proxy.failed_handshakes > failed


def test_control_plane_over_tls_with_a_password(tls_redis: TlsRedis, unique: str) -> None:
    cfg = load_config(None, [("redis.url", tls_redis.url()), ("redis.retry_max_s", "5")])
    assert REDIS_PASSWORD not in mask_url(cfg.redis.url)  # what logs and `config show` print

    async def scenario() -> tuple[bool, int, bool]:
        plane = ControlPlane(cfg.redis.url, cfg.redis.retry_max_s)
        try:
            moved = await plane.publish_latest(f"p-{unique}", 3, "file:///w/3", "ab" * 32)
            lease = await plane.acquire_lease(f"p-{unique}", "learner-a", ttl_s=30)
            return moved, await plane.latest_version(f"p-{unique}"), lease is not None
        finally:
            await plane.close()

    assert asyncio.run(scenario()) == (True, 3, True)


@pytest.mark.parametrize("password", ["wrong", ""])
def test_control_plane_with_a_wrong_or_no_password_fails_at_once(tls_redis: TlsRedis, password: str) -> None:
    async def scenario() -> BaseException:
        plane = ControlPlane(tls_redis.url(password=password), retry_max_s=300.0)
        try:
            await plane.latest_version("p")
        except Exception as exc:  # noqa: BLE001 - the error is the result
            return exc
        finally:
            await plane.close()
        raise AssertionError("a wrong password was accepted")

    started = time.monotonic()
    error = asyncio.run(scenario())
    assert time.monotonic() - started < 10  # not the 300 s retry of an unreachable server
    assert isinstance(error, ControlPlaneRefused) and "refused the credentials" in str(error)
    assert REDIS_PASSWORD not in str(error)


def test_control_plane_trusting_another_ca_fails_at_once(tls_redis: TlsRedis, other_ca: TlsFiles) -> None:
    url = tls_redis.url().replace(str(tls_redis.tls.ca_cert), str(other_ca.ca_cert))

    async def scenario() -> BaseException:
        plane = ControlPlane(url, retry_max_s=300.0)
        try:
            await plane.latest_version("p")
        except Exception as exc:  # noqa: BLE001 - the error is the result
            return exc
        finally:
            await plane.close()
        raise AssertionError("an untrusted certificate was accepted")

    error = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert isinstance(error, ControlPlaneRefused) and "certificate not trusted" in str(error)
    assert REDIS_PASSWORD not in str(error)


def test_control_plane_without_tls_cannot_talk_to_a_tls_only_server(tls_redis: TlsRedis) -> None:
    async def scenario() -> BaseException:
        plane = ControlPlane(tls_redis.url(scheme="redis"), retry_max_s=1.0)
        try:
            await plane.latest_version("p")
        except Exception as exc:  # noqa: BLE001 - the error is the result
            return exc
        finally:
            await plane.close()
        raise AssertionError("a plain connection was served by a TLS-only server")

    assert isinstance(asyncio.run(scenario()), RedisConnectionError)
