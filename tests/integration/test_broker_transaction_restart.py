"""Why an exactly_once worker leaves at once when its broker goes away (streams/exactly_once/broker_watch.py).

The first test pins the embedded broker's behaviour that makes it necessary: a transactional producer that carries
on after a broker SIGKILL and restart leaves its partition's last stable offset stuck for good. The second shows the
watch tells a killed broker from a live one. The third pins why the tests that SIGKILL the broker wait for its save
first (tests/support/broker_saves.py): what it acknowledged after its last save is gone after a SIGKILL."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from rlstream.ops.infra import start_kafka
from rlstream.ops.ports import free_port
from rlstream.streams.exactly_once.broker_watch import BrokerConnectionWatch, first_bootstrap_address
from rlstream.schemas.config import KafkaConfig
from rlstream.transport.kafka import make_consumer
from tests.support.broker_saves import wait_for_broker_save

TOPIC = TopicPartition("resumed", 0)


async def stable_and_high(bootstrap: str) -> tuple[int, int]:
    """(last stable offset, high watermark) of TOPIC, asked from the broker now."""
    ends = []
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = make_consumer(KafkaConfig(bootstrap_servers=bootstrap), group_id=None, isolation_level=isolation)
        await consumer.start()
        try:
            ends.append((await consumer.end_offsets([TOPIC]))[TOPIC])
        finally:
            await consumer.stop()
    return ends[0], ends[1]


def test_a_transaction_resumed_after_a_broker_restart_stays_open_for_good(tmp_path: Path) -> None:
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    broker = start_kafka(tmp_path / "broker", port)

    async def scenario() -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        nonlocal broker
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(TOPIC.topic, 1, 1)])
        await admin.close()
        await asyncio.to_thread(wait_for_broker_save, tmp_path / "broker")  # the topic
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id="resumed-tx")
        await producer.start()
        await producer.begin_transaction()
        await producer.send_and_wait(TOPIC.topic, b"before the kill", partition=0)
        await asyncio.to_thread(wait_for_broker_save, tmp_path / "broker")  # ... and the record
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGKILL)
        await asyncio.sleep(1)
        broker = start_kafka(tmp_path / "broker", port)
        after_restart = await stable_and_high(bootstrap)  # the broker aborted the open transaction: all stable
        await producer.send_and_wait(TOPIC.topic, b"after the restart", partition=0)  # the old producer goes on
        await producer.commit_transaction()  # answered with success
        await producer.stop()
        successor = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id="resumed-tx")
        await successor.start()  # same transactional id: would fence and abort on Apache Kafka
        await successor.begin_transaction()
        await successor.send_and_wait(TOPIC.topic, b"successor", partition=0)
        await successor.commit_transaction()
        await successor.stop()
        after_successor = await stable_and_high(bootstrap)
        await asyncio.sleep(5)
        return after_restart, after_successor, await stable_and_high(bootstrap)

    try:
        after_restart, after_successor, later = asyncio.run(scenario())
    finally:
        broker.stop()
    assert after_restart[0] == after_restart[1], "the restarted broker aborts the transaction open in its log"
    assert after_successor[0] < after_successor[1], "the resumed transaction's record holds the stable offset back"
    assert later == after_successor, "and nothing unblocks it"


def test_the_watch_reports_a_killed_broker_and_not_a_live_one(tmp_path: Path) -> None:
    port = free_port()
    broker = start_kafka(tmp_path / "broker", port)
    losses: list[tuple[float, str]] = []

    async def scenario() -> float:
        watch = BrokerConnectionWatch(first_bootstrap_address(f"PLAINTEXT://127.0.0.1:{port}"),
                                      lambda reason: losses.append((time.monotonic(), reason)))
        task = asyncio.create_task(watch.run())
        await asyncio.wait_for(watch.connected.wait(), 10)
        await asyncio.sleep(3)
        assert not losses, f"a live broker was reported lost: {losses}"
        assert broker.pid is not None
        killed_at = time.monotonic()
        os.kill(broker.pid, signal.SIGKILL)
        await asyncio.wait_for(task, 5)
        return killed_at

    try:
        killed_at = asyncio.run(scenario())
    finally:
        broker.stop()
    assert len(losses) == 1 and "is down" in losses[0][1]
    assert losses[0][0] - killed_at < 2.0


def test_a_sigkill_loses_what_the_broker_acknowledged_after_its_last_save(tmp_path: Path) -> None:
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    broker = start_kafka(tmp_path / "broker", port)

    async def high_watermark() -> int:
        return (await stable_and_high(bootstrap))[1]

    async def write_then_kill(records: int, wait_for_save: bool) -> tuple[int, int]:
        """(records acknowledged before the kill, high watermark after the restart)."""
        nonlocal broker
        acknowledged = await high_watermark()
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await producer.start()
        try:
            for _ in range(records):
                await producer.send_and_wait(TOPIC.topic, b"acknowledged", partition=0)
                acknowledged += 1
        finally:
            await producer.stop()
        if wait_for_save:
            await asyncio.to_thread(wait_for_broker_save, tmp_path / "broker")
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGKILL)
        await asyncio.sleep(1)
        broker = start_kafka(tmp_path / "broker", port)
        return acknowledged, await high_watermark()

    async def scenario() -> tuple[list[tuple[int, int]], tuple[int, int]]:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(TOPIC.topic, 1, 1)])
        await admin.close()
        await asyncio.to_thread(wait_for_broker_save, tmp_path / "broker")
        unsaved = []  # the kill right after the acknowledgements: lost unless a save tick fell in between (a few %)
        for _ in range(3):
            unsaved.append(await write_then_kill(20, wait_for_save=False))
            if unsaved[-1][1] < unsaved[-1][0]:
                break
        return unsaved, await write_then_kill(20, wait_for_save=True)

    try:
        unsaved, saved = asyncio.run(scenario())
    finally:
        broker.stop()
    assert any(after < before for before, after in unsaved), f"no acknowledged record was lost: {unsaved}"
    assert saved[1] == saved[0] > 0, f"records acknowledged before the save were lost: {saved}"
