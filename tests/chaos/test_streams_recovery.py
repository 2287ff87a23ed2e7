"""Exactly-once under failure: SIGKILL of the worker process mid-stream, and two workers sharing the
partitions through rebalances. Groups are read with isolation_level=read_committed."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import MetricEvent
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.streams.app import prepare_topics
from tests.support.streams_helpers import (Worker, assert_groups_match, interleaved_stream, last_resync, publish, read_all,
                                          read_groups, remove_dead_member, wait_for_count, wait_for_worker_events)


@pytest.mark.parametrize("store", ["memory", "rocksdb"])
def test_sigkill_mid_stream_loses_nothing_and_duplicates_nothing(rl_config: RlstreamConfig, tmp_path: Path,
                                                                 store: str) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    records, expected = interleaved_stream(rl_config, n_examples=500, group_size=4, seed=7, late_fraction=0.25)
    assert sum(1 for t, *_ in records if t == names.trajectories) == 2000
    worker = Worker(rl_config, "w1", tmp_path, **{"streams.store": store}).start()
    restarted = None
    try:
        asyncio.run(publish(rl_config, records))
        asyncio.run(wait_for_count(rl_config, names.groups, 60, timeout_s=90))
        worker.kill()
        emitted_before = asyncio.run(wait_for_count(rl_config, names.groups, 0))
        assert emitted_before < len(expected), "the kill came after the stream was done"
        restarted = Worker(rl_config, "w1", tmp_path, **{"streams.store": store}).start()
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=len(expected), timeout_s=150, quiet_s=4))
        assert restarted.alive(), restarted.log_tail()
        try:
            assert_groups_match(groups, expected)
        except AssertionError as failure:
            raise AssertionError(f"{failure}\nrestarted worker log:\n{restarted.log_tail(120)}") from None
        # every input partition had records applied before the kill: the restart starts each from its recovered
        # progress marker (the RocksDB store once looked the markers up only in the partition of the record being
        # processed, and the others restarted from their committed offsets)
        resync = last_resync(tmp_path)
        starts = {tp: how for tp, how in json.loads(resync)["seeks"].items()
                  if tp.rsplit(":", 1)[0] in (names.trajectories, names.rewards)} if resync else {}
        assert starts and all(how.endswith("(marker)") for how in starts.values()), resync
    finally:
        worker.stop()
        if restarted:
            restarted.stop()


def test_two_workers_share_partitions_through_rebalances(rl_config: RlstreamConfig, tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    records, expected = interleaved_stream(rl_config, n_examples=250, group_size=4, seed=9, late_fraction=0.3)
    w1 = Worker(rl_config, "w1", tmp_path).start()
    w2 = Worker(rl_config, "w2", tmp_path)
    half = len(records) // 2  # the second half is sent once w2 has joined, so both workers have work
    feeder = threading.Thread(target=lambda: asyncio.run(publish(rl_config, records[half:], pace_every=60,
                                                                 pace_s=0.4)))
    try:
        asyncio.run(publish(rl_config, records[:half], pace_every=60, pace_s=0.4))
        asyncio.run(wait_for_count(rl_config, names.groups, 30, timeout_s=90))
        w2.start()  # rebalance: the partitions are shared mid-stream
        time.sleep(12)
        feeder.start()
        asyncio.run(wait_for_worker_events(rl_config, names.metrics, "w2", timeout_s=120))
        w1.kill()  # second rebalance: w2 takes everything over once w1 is out of the group
        # Kafka expires a dead member after the session timeout; noida-db never does, so the test does it
        asyncio.run(remove_dead_member(rl_config, "w1"))
        feeder.join(120)
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=len(expected), timeout_s=150, quiet_s=4))
        assert w2.alive(), w2.log_tail()
        assert_groups_match(groups, expected)
        metrics = [m for _, m in asyncio.run(read_all(rl_config, names.metrics, MetricEvent, timeout_s=5, quiet_s=1))]
        worked = {m.tags.get("worker") for m in metrics if m.name == mn.STREAMS_EVENTS_IN and m.value > 0}
        assert worked == {"w1", "w2"}
    finally:
        w1.stop()
        w2.stop()


def test_a_reader_keeps_what_a_successor_commits_after_fencing_a_killed_producer(rl_config: RlstreamConfig,
                                                                                 unique: str) -> None:
    """After a worker dies mid-transaction, its successor (same transactional id: same producer id, new epoch)
    aborts that transaction and commits new records. A read_committed reader that read past the ABORT marker
    must still get them (noida-db lists the aborted transaction again in later fetches; the worker's recovery
    and the readers above rely on rlstream/transport/aborted_index.py)."""

    async def scenario() -> list[bytes]:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        from rlstream.transport.kafka import client_options

        topic, tid = f"t{unique}.fenced", f"fenced-{unique}"
        admin = AIOKafkaAdminClient(**client_options(rl_config.kafka))
        await admin.start()
        await admin.create_topics([NewTopic(topic, 1, 1)])
        await admin.close()
        killed = AIOKafkaProducer(**client_options(rl_config.kafka), transactional_id=tid)
        await killed.start()
        await killed.begin_transaction()
        await (await killed.send(topic, b"committed-1", partition=0))
        await killed.commit_transaction()
        await killed.begin_transaction()
        await (await killed.send(topic, b"aborted", partition=0))  # never committed: the producer "dies"
        tp = TopicPartition(topic, 0)
        reader = AIOKafkaConsumer(**client_options(rl_config.kafka), isolation_level="read_committed")
        await reader.start()
        reader.assign([tp])
        await reader.seek_to_beginning(tp)
        got: list[bytes] = []

        async def drain() -> None:
            for _ in range(6):
                got.extend(r.value for r in (await reader.getmany(timeout_ms=200)).get(tp, []))

        successor = AIOKafkaProducer(**client_options(rl_config.kafka), transactional_id=tid)
        try:
            await drain()
            await successor.start()  # fences the dead producer: its open transaction is aborted
            await drain()  # the reader moves past the ABORT marker
            await successor.begin_transaction()
            await (await successor.send(topic, b"committed-2", partition=0))
            await successor.commit_transaction()
            await drain()
        finally:
            await successor.stop()
            await reader.stop()
            with contextlib.suppress(Exception):
                await killed.stop()
        return got

    assert asyncio.run(scenario()) == [b"committed-1", b"committed-2"]
