"""The bulk changelog load of a worker's recovery (streams/exactly_once/state_reset.py, BulkChangelogLoader) against
the real broker: a table ends holding exactly the last committed value of every key (updates straddling batches,
tombstones, a key deleted and written again, an aborted transaction's writes never), each partition is reported
recovered up to its end, and a partition the loader could not finish in its time budget is wiped again and left to
Faust's recovery. The worker's own recoveries through it are covered by the chaos tier (kills, restarts)."""
from __future__ import annotations

import json
from typing import Any

import faust
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from faust.types import TP

from rlstream.schemas.config import RlstreamConfig
from rlstream.streams.exactly_once.state_reset import BulkChangelogLoader
from rlstream.transport.kafka import client_options, make_consumer, make_producer

PARTITIONS = 2
KEYS = 60
UPDATES = 5


def _changelog_records() -> tuple[list[tuple[str, dict[str, Any] | None]], dict[str, dict[str, Any]]]:
    """(key, value or None for a tombstone) in write order, and the state they leave."""
    writes: list[tuple[str, dict[str, Any] | None]] = []
    for update in range(UPDATES):  # interleaved: a key's updates are far apart, across batches
        for k in range(KEYS):
            writes.append((f"k{k}", {"key": k, "update": update}))
    for k in range(0, KEYS, 7):
        writes.append((f"k{k}", None))  # deleted for good
    for k in range(3, KEYS, 11):
        writes.append((f"k{k}", None))
        writes.append((f"k{k}", {"key": k, "update": "again"}))  # deleted, then written again
    state: dict[str, dict[str, Any]] = {}
    for key, value in writes:
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    return writes, state


def _partition(key: str) -> int:
    return int(key[1:]) % PARTITIONS


async def _write_changelog(cfg: RlstreamConfig, topic: str) -> dict[str, dict[str, Any]]:
    admin = AIOKafkaAdminClient(**client_options(cfg.kafka))
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    finally:
        await admin.close()
    writes, state = _changelog_records()
    producer = make_producer(cfg.kafka, transactional_id=f"{topic}-writer")
    await producer.start()
    try:
        for start in range(0, len(writes), 25):  # committed transactions, each followed by an aborted one
            await producer.begin_transaction()
            for key, value in writes[start:start + 25]:
                await producer.send_and_wait(topic, None if value is None else json.dumps(value).encode(),
                                             key=json.dumps(key).encode(), partition=_partition(key))
            await producer.commit_transaction()
            await producer.begin_transaction()
            for k in range(0, KEYS, 5):
                await producer.send_and_wait(topic, json.dumps({"aborted": True}).encode(),
                                             key=json.dumps(f"k{k}").encode(), partition=_partition(f"k{k}"))
            await producer.abort_transaction()
    finally:
        await producer.stop()
    return state


async def _stable_ends(cfg: RlstreamConfig, topic: str) -> dict[TP, int]:
    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed")
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in range(PARTITIONS)])
        return {TP(tp.topic, tp.partition): int(offset) for tp, offset in ends.items()}
    finally:
        await consumer.stop()


def _table(name: str) -> Any:
    app = faust.App(f"bulk-{name}", broker="kafka://127.0.0.1:1")  # never started: the table is only a store
    table = app.Table("groups", default=None, partitions=PARTITIONS,
                      schema=faust.Schema(key_serializer="json", value_serializer="json"))
    return app, table


async def test_the_table_holds_the_last_committed_value_of_every_key(rl_config: RlstreamConfig, unique: str) -> None:
    topic = f"{unique}-groups-changelog"
    expected = await _write_changelog(rl_config, topic)
    ends = await _stable_ends(rl_config, topic)
    app, table = _table(unique)
    loader = BulkChangelogLoader(app, lambda: make_consumer(rl_config.kafka, group_id=None,
                                                            isolation_level="read_committed"), batch_records=37)
    covered = await loader.load(ends, {tp: table for tp in ends}, budget_s=120)
    assert covered == {tp: end - 1 for tp, end in ends.items()}
    assert dict(table.data.items()) == expected
    assert not any(value.get("aborted") for value in table.data.values())
    assert len(expected) < KEYS  # the tombstones removed keys: the check above could fail on them


async def test_a_partition_not_finished_in_time_is_wiped_and_left_to_faust(rl_config: RlstreamConfig,
                                                                             unique: str) -> None:
    topic = f"{unique}-groups-changelog"
    await _write_changelog(rl_config, topic)
    ends = await _stable_ends(rl_config, topic)
    app, table = _table(unique)
    loader = BulkChangelogLoader(app, lambda: make_consumer(rl_config.kafka, group_id=None,
                                                            isolation_level="read_committed"), batch_records=10)
    covered = await loader.load(ends, {tp: table for tp in ends}, budget_s=0.0)
    assert covered == {}
    assert len(table.data) == 0  # what the first batches loaded went again: Faust reads these partitions whole
