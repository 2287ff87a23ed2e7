"""Input written by a transactional producer, with aborted transactions in between: the aborted records are never
assembled, and the commit and abort markers (offsets without a visible record) hold nothing up: the progress gate
asks the broker instead of seeking back on a timer."""
from __future__ import annotations

import asyncio
from pathlib import Path

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.transport.kafka import make_consumer, make_producer
from tests.support.streams_helpers import (CODEC, Worker, assert_groups_match, interleaved_stream, read_dead_letters,
                                   read_groups)

PARTITION = 0  # every record: markers between each transaction's records on the one partition the worker reads
RECORDS_PER_TRANSACTION = 3


async def publish_in_transactions(cfg: RlstreamConfig, good: list[tuple[str, bytes, bytes]],
                                  ghosts: list[list[tuple[str, bytes, bytes]]]) -> None:
    """The good records in committed transactions of a few records, an aborted transaction of ghost records after
    each (ghosts: complete, rewarded groups that must never come out)."""
    producer = make_producer(cfg.kafka, transactional_id=f"{cfg.run_id}-input")
    await producer.start()
    try:
        chunks = [good[i:i + RECORDS_PER_TRANSACTION] for i in range(0, len(good), RECORDS_PER_TRANSACTION)]
        for index, chunk in enumerate(chunks):
            for records, commit in ((chunk, True), (ghosts[index % len(ghosts)], False)):
                await producer.begin_transaction()
                for topic, key, value in records:
                    await producer.send_and_wait(topic, value, key=key, partition=PARTITION)
                if commit:
                    await producer.commit_transaction()
                else:
                    await producer.abort_transaction()
    finally:
        await producer.stop()


async def uncommitted_example_ids(cfg: RlstreamConfig, topic: str) -> set[str]:
    """What a read_uncommitted reader finds on the partition: the aborted ghosts are really there."""
    from aiokafka import TopicPartition

    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_uncommitted")
    await consumer.start()
    try:
        tp = TopicPartition(topic, PARTITION)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        seen: set[str] = set()
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(tp, timeout_ms=500)).values():
                seen |= {CODEC.decode(r.value, TrajectoryEvent).example_id for r in records}
        return seen
    finally:
        await consumer.stop()


def test_aborted_input_is_never_assembled_and_markers_stall_nothing(rl_config: RlstreamConfig,
                                                                    tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    good, expected = interleaved_stream(rl_config, n_examples=30, group_size=2, seed=13, late_fraction=0.0)
    ghost_records, ghost_groups = interleaved_stream(rl_config, n_examples=4, group_size=2, seed=14,
                                                     late_fraction=0.0, prefix="ghost")
    ghosts = [ghost_records[i:i + 2] for i in range(0, len(ghost_records), 2)]
    asyncio.run(publish_in_transactions(rl_config, good, ghosts))
    assert {f"ghost{i}" for i in range(4)} <= asyncio.run(uncommitted_example_ids(rl_config, names.trajectories))

    worker = Worker(rl_config, "w1", tmp_path).start()
    try:
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=len(expected), timeout_s=120, quiet_s=3))
        assert worker.alive(), worker.log_tail()
        assert not {g.group_id for g in groups} & set(ghost_groups), "an aborted record was assembled"
        assert_groups_match(groups, expected)
        assert asyncio.run(read_dead_letters(rl_config, names.dlq, timeout_s=3, quiet_s=1)) == []
        # ~20 commit and ~20 abort markers on the partition: none of them made the gate seek back and wait
        log_text = worker.log_path.read_text(errors="replace")
        assert "records missing before this one" not in log_text, worker.log_tail()
    finally:
        worker.stop()
