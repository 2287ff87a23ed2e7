"""read_committed consumers that start after an aborted transaction they never read, on the real broker.

noida-db lists, in every fetch, also the aborted transactions of the partition that ended before the fetch offset
(rlstream/transport/aborted_index.py). A plain aiokafka read_committed consumer placed after such an ABORT marker
takes the transaction for still open and drops that producer's later committed records. Each case pins that with a
plain consumer in a process without rlstream's guard (tests/support/unguarded_reader.py) and shows that rlstream's reader
and gate probe, a restarted streams worker and a resumed learner hand on every committed record. The last test:
offsets that cannot be proven to hold only transaction markers and aborted records stop a streams worker's
partition loudly (error log, ``streams.unproven_gaps``) instead of being skipped.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.records_to_delete import RecordsToDelete
from faust.types import TP

from rlstream.learner.service import Learner
from rlstream.ops.lineage import version_lineage
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig, dump_config
from rlstream.schemas.models import MetricEvent, PolicyVersion
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.streams.exactly_once.progress import GapProbe
from rlstream.transport import metric_names as mn
from rlstream.transport.aborted_index import GapProof, GapVerdict
from rlstream.transport.kafka import client_options, make_consumer, make_producer
from rlstream.transport.topic_reader import open_reader, read_slice
from tests.support.learner_helpers import random_group, read_topic, tiny_model
from tests.support.streams_helpers import Worker, assert_groups_match, interleaved_stream, read_dead_letters, read_groups
from tests.support.unguarded_reader import unguarded_offsets

CODEC = AvroCodec()
PARTITION = 0
Records = list[tuple[str, bytes | None, bytes]]


async def write_transactions(cfg: RlstreamConfig, transactional_id: str,
                             transactions: list[tuple[Records, bool]]) -> list[list[int]]:
    """Each (records, commit) as one transaction of one producer, on PARTITION; the offsets per transaction."""
    producer = make_producer(cfg.kafka, transactional_id=transactional_id)
    await producer.start()
    placed: list[list[int]] = []
    try:
        for records, commit in transactions:
            await producer.begin_transaction()
            placed.append([(await producer.send_and_wait(topic, value, key=key, partition=PARTITION)).offset
                           for topic, key, value in records])
            if commit:
                await producer.commit_transaction()
            else:
                await producer.abort_transaction()
    finally:
        await producer.stop()
    return placed


async def guarded_offsets(cfg: RlstreamConfig, topic: str, start: int) -> list[int]:
    """The offsets rlstream's group-less reader is handed from ``start`` to the end offset."""
    consumer = await open_reader(cfg.kafka)
    try:
        tp = TopicPartition(topic, PARTITION)
        end = (await consumer.end_offsets([tp]))[tp]
        return [record.offset async for record in read_slice(consumer, {tp: start}, {tp: end})]
    finally:
        await consumer.stop()


def probe_gaps(cfg: RlstreamConfig, topic: str, gaps: list[tuple[int, int]]) -> list[GapProof | None]:
    """The streams worker's gate probe on each [start, stop) of ``gaps``."""
    async def go() -> list[GapProof | None]:
        probe = GapProbe(lambda: make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed"))
        try:
            return [await probe(TP(topic, PARTITION), start, stop) for start, stop in gaps]
        finally:
            await probe.close()
    return asyncio.run(go())


def committed_then_aborted_then_committed(cfg: RlstreamConfig, topic: str) -> tuple[list[int], list[int], list[int]]:
    """One producer: A (committed), B (aborted), C (committed, three records); their offsets."""
    a, b, c = asyncio.run(write_transactions(cfg, f"{cfg.run_id}-abc", [
        ([(topic, b"a", b"a%d" % i) for i in range(2)], True),
        ([(topic, b"b", b"b%d" % i) for i in range(2)], False),
        ([(topic, b"c", b"c%d" % i) for i in range(3)], True)]))
    return a, b, c


# --- (a) a reader placed inside a committed transaction after an aborted one --------------------------------------
def test_control_a_plain_reader_placed_after_an_abort_marker_misses_the_committed_records(
        rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    topic = created_topics.trajectories
    a, _, c = committed_then_aborted_then_committed(rl_config, topic)
    bootstrap = rl_config.kafka.bootstrap_servers
    assert unguarded_offsets(bootstrap, topic, PARTITION, 0) == a + c  # read from the start: the marker is seen
    assert unguarded_offsets(bootstrap, topic, PARTITION, c[0]) == []  # placed after it: C is dropped
    assert unguarded_offsets(bootstrap, topic, PARTITION, c[1]) == []


def test_a_reader_placed_inside_a_committed_transaction_after_an_aborted_one_sees_all_of_it(
        rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    topic = created_topics.trajectories
    _, b, c = committed_then_aborted_then_committed(rl_config, topic)
    # nothing in this process has read B's ABORT marker: the reader must look its end up
    assert asyncio.run(guarded_offsets(rl_config, topic, c[1])) == c[1:]
    assert asyncio.run(guarded_offsets(rl_config, topic, c[0])) == c
    assert asyncio.run(guarded_offsets(rl_config, topic, b[1])) == c  # inside B: B's rest stays hidden
    # the gate's probe: C's offsets hold records; B and the markers around it do not
    inside, whole, aborted = probe_gaps(rl_config, topic, [(c[1], c[-1] + 1), (c[0], c[-1] + 1), (b[0], c[0])])
    assert inside is not None and (inside.verdict, inside.offset) == (GapVerdict.VISIBLE, c[1])
    assert whole is not None and (whole.verdict, whole.offset) == (GapVerdict.VISIBLE, c[0])
    assert aborted is not None and aborted.verdict is GapVerdict.HIDDEN


# --- (b) a streams worker restarted over transactional input -----------------------------------------------------
def streams_input(cfg: RlstreamConfig) -> tuple[Records, Records, Records, dict[str, dict[str, float]],
                                                dict[str, dict[str, float]], set[str]]:
    """Input before the restart (two committed parts around an aborted one of ghost groups) and after it."""
    before, expected_before = interleaved_stream(cfg, n_examples=6, group_size=2, seed=31, late_fraction=0.0,
                                                 prefix="before")
    ghosts, ghost_groups = interleaved_stream(cfg, n_examples=2, group_size=2, seed=32, late_fraction=0.0,
                                              prefix="ghost")
    after, expected_after = interleaved_stream(cfg, n_examples=6, group_size=2, seed=33, late_fraction=0.0,
                                               prefix="after")
    return before, ghosts, after, expected_before, expected_after, set(ghost_groups)


def test_control_b_a_plain_reader_at_a_restart_position_misses_the_later_committed_input(
        rl_config: RlstreamConfig) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    before, ghosts, after, *_ = streams_input(rl_config)
    half = len(before) // 2
    transactional_id = f"{rl_config.run_id}-input"
    placed = asyncio.run(write_transactions(rl_config, transactional_id,
                                            [(before[:half], True), (ghosts, False), (before[half:], True)]))
    (later,) = asyncio.run(write_transactions(rl_config, transactional_id, [(after, True)]))
    restart_at = placed[2][-1] + 1  # a worker that applied everything before: its progress marker + 1
    seen = unguarded_offsets(rl_config.kafka.bootstrap_servers, names.trajectories, PARTITION, restart_at)
    assert seen == [], f"the plain reader was handed {seen} of the later input {later}"


def test_a_restarted_worker_emits_every_group_committed_after_an_aborted_transaction(
        rl_config: RlstreamConfig, tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    before, ghosts, after, expected_before, expected_after, ghost_groups = streams_input(rl_config)
    half = len(before) // 2
    transactional_id = f"{rl_config.run_id}-input"  # one producer throughout: A committed, B aborted, C committed
    asyncio.run(write_transactions(rl_config, transactional_id,
                                   [(before[:half], True), (ghosts, False), (before[half:], True)]))
    first = Worker(rl_config, "w1", tmp_path).start()
    try:
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=len(expected_before), timeout_s=120,
                                         quiet_s=2))
        assert first.alive(), first.log_tail()
    finally:
        first.stop()
    assert_groups_match(groups, expected_before)

    asyncio.run(write_transactions(rl_config, transactional_id, [(after, True)]))  # more input, same producer
    logged_before = first.log_path.stat().st_size
    second = Worker(rl_config, "w1", tmp_path).start()  # the same worker restarted (its static group membership)
    try:
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=len(expected_before) + len(expected_after),
                                         timeout_s=120, quiet_s=3))
        assert second.alive(), second.log_tail()
        log_text = second.log_path.read_bytes()[logged_before:].decode(errors="replace")
    finally:
        second.stop()
    assert not {g.group_id for g in groups} & ghost_groups, "an aborted record was assembled"
    assert_groups_match(groups, {**expected_before, **expected_after})
    assert asyncio.run(read_dead_letters(rl_config, names.dlq, timeout_s=3, quiet_s=1)) == []
    assert "partition stopped" not in log_text, second.log_tail()


# --- (c) a learner resumed past an aborted groups transaction ----------------------------------------------------
def learner_config(cfg: RlstreamConfig, model: Path, groups_per_step: int, total_steps: int) -> RlstreamConfig:
    return cfg.model_copy(update={"learner": cfg.learner.model_copy(update={
        "model": str(model), "lora": cfg.learner.lora.model_copy(update={"enabled": True}),
        "groups_per_step": groups_per_step, "publish_every": 1, "checkpoint_every": 1, "total_steps": total_steps,
        "device": "cpu", "lease_ttl_s": 15.0, "run_ids": [cfg.run_id], "report_to": []})})


def groups_with_an_aborted_transaction(cfg: RlstreamConfig, topic: str) -> tuple[list[int], list[int], list[int]]:
    """As a crashed streams worker leaves them (one transactional id): g0 committed, a ghost group aborted, g1
    committed, then g2 and g3 committed. Returns the offsets of (g0, g1), the ghost and (g2, g3)."""
    groups = [random_group(cfg.policy, cfg.run_id, i) for i in range(5)]
    record = lambda i: (topic, groups[i].example_id.encode(), CODEC.encode(groups[i]))  # noqa: E731
    g0, ghost, g1, later = asyncio.run(write_transactions(cfg, f"{cfg.streams.app_id}-groups", [
        ([record(0)], True), ([record(4)], False), ([record(1)], True), ([record(2), record(3)], True)]))
    return g0 + g1, ghost, later


def test_control_c_a_plain_reader_at_the_learners_resume_offset_misses_the_later_groups(
        rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    first, _, later = groups_with_an_aborted_transaction(rl_config, created_topics.groups)
    resume_at = first[-1] + 1
    bootstrap = rl_config.kafka.bootstrap_servers
    assert unguarded_offsets(bootstrap, created_topics.groups, PARTITION, 0) == first + later
    assert unguarded_offsets(bootstrap, created_topics.groups, PARTITION, resume_at) == []


def test_a_learner_resumed_past_an_aborted_groups_transaction_trains_the_committed_groups_after_it(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path) -> None:
    names = created_topics
    first, ghost, later = groups_with_an_aborted_transaction(rl_config, names.groups)
    model = tiny_model(tmp_path)
    state = asyncio.run(Learner(learner_config(rl_config, model, 1, 2), holder="first").run())
    assert state.step == 2 and state.offsets == {PARTITION: first[-1] + 1}  # resumes after the ABORT marker

    # resumed in a fresh process: it never read the aborted transaction's marker
    config = tmp_path / "rlstream.yaml"
    config.write_text(dump_config(learner_config(rl_config, model, 2, 3)))
    resumed = subprocess.run([sys.executable, "-m", "rlstream.cli", "learner", "run", "-c", str(config),
                              "--holder", "resumed"], capture_output=True, text=True, timeout=300,
                             cwd=Path(__file__).parents[2], env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]

    versions = asyncio.run(read_topic(rl_config, names.policy_versions, PolicyVersion, expect=4))
    assert [v.version for v in versions] == [0, 1, 2, 3]  # 0: the base weights, announced by the first learner
    assert [(r.first, r.last) for r in versions[3].trained_on] == [(later[0], later[1])]
    lineage = asyncio.run(version_lineage(rl_config, 3))
    assert [(g.partition, g.offset) for g in lineage.groups] == [(PARTITION, o) for o in later]
    assert lineage.unresolved == []
    trained = {(r.first, r.last) for v in versions for r in v.trained_on}
    assert not any(r[0] <= ghost[0] <= r[1] for r in trained), "the aborted group was trained"


async def wait_for_metric(cfg: RlstreamConfig, topic: str, name: str, timeout_s: float,
                          at_least: float = 0.0) -> list[MetricEvent]:
    """The events named ``name`` on the metrics topic, once one has a value >= ``at_least`` (or the timeout passed).

    A counter is reported at 0 from a worker's start, so a test waiting for it to count passes ``at_least=1``.
    """
    consumer = make_consumer(cfg.kafka, topic, group_id=None, isolation_level="read_committed")
    await consumer.start()
    found: list[MetricEvent] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not any(e.value >= at_least for e in found) and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                found += [e for e in (CODEC.decode(r.value, MetricEvent) for r in records) if e.name == name]
        return found
    finally:
        await consumer.stop()


# --- a gap that cannot be proven hidden stops the partition ------------------------------------------------------
def test_a_gap_that_cannot_be_proven_hidden_stops_the_partition_loudly(rl_config: RlstreamConfig,
                                                                       tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    before, expected_before = interleaved_stream(rl_config, n_examples=4, group_size=2, seed=41, late_fraction=0.0,
                                                 prefix="before")
    after, _ = interleaved_stream(rl_config, n_examples=4, group_size=2, seed=42, late_fraction=0.0,
                                  prefix="after")
    (placed_before,) = asyncio.run(write_transactions(rl_config, f"{rl_config.run_id}-in", [(before, True)]))
    first = Worker(rl_config, "w1", tmp_path).start()
    try:
        asyncio.run(read_groups(rl_config, names.groups, expect=len(expected_before), timeout_s=120, quiet_s=2))
    finally:
        first.stop()
    (placed_after,) = asyncio.run(write_transactions(rl_config, f"{rl_config.run_id}-in", [(after, True)]))
    tp = TopicPartition(names.trajectories, PARTITION)
    deleted_to = placed_after[2]  # records the worker never applied, gone (as retention would delete them)

    async def delete() -> None:
        admin = AIOKafkaAdminClient(**client_options(rl_config.kafka))
        await admin.start()
        try:
            await admin.delete_records({tp: RecordsToDelete(deleted_to)}, timeout_ms=10_000)
        finally:
            await admin.close()

    asyncio.run(delete())
    resume_at = placed_before[-1] + 1

    async def first_handed_from(offset: int) -> int:
        consumer = make_consumer(rl_config.kafka, group_id=None, isolation_level="read_committed")
        await consumer.start()
        try:
            consumer.assign([tp])
            consumer.seek(tp, offset)
            for _ in range(20):
                records = (await consumer.getmany(tp, timeout_ms=500)).get(tp, [])
                if records:
                    return records[0].offset
            raise AssertionError("nothing handed on")
        finally:
            await consumer.stop()

    # the control: a consumer placed at the resume position is moved to the log start and handed the first record
    # there, with no record before it: a probe that only looks for visible records calls the deleted offsets empty
    assert asyncio.run(first_handed_from(resume_at)) == deleted_to > resume_at

    logged_before = first.log_path.stat().st_size
    second = Worker(rl_config, "w1", tmp_path).start()  # the same worker restarted (its static group membership)

    def restart_log() -> str:
        return second.log_path.read_bytes()[logged_before:].decode(errors="replace")

    try:
        deadline = time.monotonic() + 120
        while "partition stopped" not in restart_log():
            assert time.monotonic() < deadline and second.alive(), second.log_tail()
            time.sleep(1)
        stops = asyncio.run(wait_for_metric(rl_config, names.metrics, mn.STREAMS_UNPROVEN_GAPS, timeout_s=30,
                                           at_least=1))
        groups = asyncio.run(read_groups(rl_config, names.groups, timeout_s=5, quiet_s=3))
        assert second.alive(), second.log_tail()
        log_text = restart_log()
    finally:
        second.stop()
    counted = [e for e in stops if e.value >= 1]
    assert counted and all(e.tags.get("worker") == "w1" for e in counted), stops
    assert "offsets no longer in the log" in log_text
    assert_groups_match(groups, expected_before)  # nothing past the gap was processed, nothing skipped
