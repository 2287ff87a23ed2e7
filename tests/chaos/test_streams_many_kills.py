"""Exactly-once at scale under repeated failure: 20,000 trajectories (late rewards, groups that can only leave on
their timeout, injected bad records) while the worker is SIGKILLed at 10 random moments: some seconds after a restart,
while it is still starting or recovering its tables; some as it catches up with the records that came while it was
down; the others after some seconds of processing. Read with read_committed, every trajectory record
comes out exactly once (a member of one group, or one dead letter), no group comes out twice, every group holds only
its own members with their rewards, and each injected bad record is dead-lettered once; the last restart starts every
input partition from its recovered progress marker. The default store (memory): both stores rebuild their tables from
the changelogs the same way, and the RocksDB store's recovery from a SIGKILL, progress markers included, is
tests/chaos/test_streams_recovery.py's.

Negative control: the same output read with read_uncommitted, where the transactions the kills aborted are
visible, must fail the same check (records twice). That shows the kills cut transactions with output in them and
that the check sees duplicates when they are there; read_committed hiding them is the guarantee under test.
(exactly_once is the only processing guarantee: without transactions the app drops replayed trajectories by id, so
what a kill cuts off would go missing rather than come out twice.)"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, TrajectoryGroup
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from tests.support.streams_helpers import (Worker, interleaved_stream, last_resync, publish, read_dead_letters,
                                          read_groups, times_processing_began, wait_for_processing)

EXAMPLES, GROUP_SIZE = 5_000, 4  # 20,000 trajectories minus the ones that never come
SHORT_EVERY = 25  # every 25th group misses a member: it leaves on its timeout
CHUNK = 100
KILLS = 10
BAD_RECORDS = 20
#: Timeouts run on the wall clock from a group's first record, a worker's downtime included: here the worker is down
#: a good part of the time (each restart takes seconds), so some groups may leave on their timeout before all their
#: members were read, and those members go to dlq as group_closed. Right, and counted: the test checks that every
#: record comes out exactly once (in one group or as one dead letter), not that every group is whole.
GROUP_TIMEOUT_S = 60
PACE_EVERY, PACE_S = 500, 120.0  # the records go out in batches of 500 over about 120 s


def _stream(cfg: RlstreamConfig) -> tuple[list[tuple[str, bytes, bytes]], dict[str, dict[str, float]], set[bytes]]:
    """The records to send (bad ones spread through them), the expected groups, and the bad records' keys."""
    names = TopicNames.from_config(cfg.topics)
    records: list[tuple[str, bytes, bytes]] = []
    expected: dict[str, dict[str, float]] = {}
    for chunk in range(EXAMPLES // CHUNK):  # interleaved within chunks: a group's members arrive close together
        chunk_records, chunk_expected = interleaved_stream(cfg, n_examples=CHUNK, group_size=GROUP_SIZE, seed=chunk,
                                                           late_fraction=0.25, short_every=SHORT_EVERY,
                                                           prefix=f"c{chunk}-")
        records += chunk_records
        expected.update(chunk_expected)
    bad_keys = {f"bad-{i}".encode() for i in range(BAD_RECORDS)}
    step = len(records) // (BAD_RECORDS + 1)
    for i, key in enumerate(sorted(bad_keys)):
        records.insert((i + 1) * step, (names.trajectories, key, b"\x00not an event " + key))
    return records, expected, bad_keys


def _fates(groups: list[TrajectoryGroup], dead: list[DeadLetter], topic: str) -> Counter[tuple[int, int]]:
    """How many times each record of ``topic`` (partition, offset) came out: as a group member or a dead letter."""
    fates: Counter[tuple[int, int]] = Counter()
    for group in groups:
        fates.update((o.partition, o.offset) for o in group.source_offsets if o.topic == topic)
    fates.update((d.source_partition, d.source_offset) for d in dead if d.source_topic == topic)
    return fates


def _wait_for_every_fate(cfg: RlstreamConfig, names: TopicNames, records: int, timeout_s: float = 600.0
                         ) -> tuple[list[TrajectoryGroup], list[DeadLetter]]:
    """Groups and dead letters (read_committed) once every one of the ``records`` trajectory records came out, or
    once nothing new came out for longer than two group timeouts (a record lost for good never comes)."""
    deadline = time.monotonic() + timeout_s
    seen, last_new = -1, time.monotonic()
    while True:
        groups = asyncio.run(read_groups(cfg, names.groups, quiet_s=3))
        dead = asyncio.run(read_dead_letters(cfg, names.dlq, quiet_s=2))
        came_out = len(_fates(groups, dead, names.trajectories))
        if came_out > seen:
            seen, last_new = came_out, time.monotonic()
        if came_out >= records or time.monotonic() > deadline or time.monotonic() - last_new > 2 * GROUP_TIMEOUT_S + 30:
            return groups, dead
        time.sleep(5)


def _exactly_once_problems(groups: list[TrajectoryGroup], dead: list[DeadLetter], expected: dict[str, dict[str, float]],
                           topic: str, records: int) -> list[str]:
    """Every trajectory record came out exactly once (in one group or as one dead letter), no group twice, and every
    group holds members of its own with their rewards (a group may be short: timeouts run on the wall clock,
    and a worker's downtime counts)."""
    problems = []
    fates = _fates(groups, dead, topic)
    twice = [where for where, n in fates.items() if n > 1]
    if twice:
        problems.append(f"{len(twice)} records came out more than once, e.g. {twice[:3]}")
    if len(fates) != records:
        problems.append(f"{records - len(fates)} of {records} records never came out")
    ids = Counter(g.group_id for g in groups)
    if any(n > 1 for n in ids.values()):
        problems.append(f"{sum(n > 1 for n in ids.values())} groups emitted more than once")
    for group in groups:
        members = {t.trajectory_id: t.reward for t in group.trajectories}
        if not members.items() <= expected.get(group.group_id, {}).items():
            problems.append(f"group {group.group_id} holds members or rewards not its own")
    return problems


@pytest.mark.timeout(1500)
def test_twenty_thousand_trajectories_through_ten_sigkills(rl_config: RlstreamConfig, tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    records, expected, bad_keys = _stream(rl_config)
    trajectories = sum(len(members) for members in expected.values())
    assert trajectories == EXAMPLES * GROUP_SIZE - EXAMPLES // SHORT_EVERY
    settings = {"streams.store": "memory", "streams.processing_guarantee": "exactly_once",
                "streams.group_timeout_s": GROUP_TIMEOUT_S}
    rng = random.Random(2026)
    workers: list[Worker] = []
    try:
        # sent over about as long as the kills take, so that they fall while records are coming in
        feeder = threading.Thread(target=lambda: asyncio.run(publish(
            rl_config, records, pace_every=PACE_EVERY, pace_s=PACE_S * PACE_EVERY / len(records))))
        feeder.start()
        kill_times = []
        for kill in range(KILLS):
            started = times_processing_began(tmp_path)
            worker = Worker(rl_config, "w1", tmp_path, **settings).start()
            workers.append(worker)
            if kill % 3 == 2:  # every third kill: while the restarted worker is starting or restoring its tables
                delay = rng.uniform(2.0, 8.0)
            elif kill % 3 == 1:  # another third: as it catches up with what came while it was down, when its
                wait_for_processing(worker, tmp_path, started)  # transactions hold output (on an idle machine it
                delay = rng.uniform(0.1, 0.6)                   # keeps up with the feed and is mostly waiting)
            else:  # the others: after some seconds of processing
                wait_for_processing(worker, tmp_path, started)
                delay = rng.uniform(1.0, 10.0)
            time.sleep(delay)
            assert worker.alive(), worker.log_tail()
            worker.kill()
            kill_times.append(f"{['processing', 'catching up', 'during start'][kill % 3]} +{delay:.1f}s")
        feeder.join()
        last = Worker(rl_config, "w1", tmp_path, **settings).start()
        workers.append(last)
        groups, dead = _wait_for_every_fate(rl_config, names, trajectories + BAD_RECORDS)
        assert last.alive(), last.log_tail()
    finally:
        for worker in workers:
            worker.stop()

    # every input partition had records applied before the last restart: each must restart from its recovered
    # progress marker (a partition read as without one restarts from its committed offset: the RocksDB store once
    # looked the markers up only in the partition of the record being processed)
    resync = last_resync(tmp_path)
    starts = {tp: how for tp, how in json.loads(resync)["seeks"].items()
              if tp.rsplit(":", 1)[0] in (names.trajectories, names.rewards)} if resync else {}
    assert starts and all(how.endswith("(marker)") for how in starts.values()), resync
    problems = _exactly_once_problems(groups, dead, expected, names.trajectories, trajectories + BAD_RECORDS)
    assert not problems, (f"{problems[:5]}\nkills: {kill_times}\nlast worker log:\n{last.log_tail(60)}")
    dead_keys = Counter(d.key for d in dead if d.key in bad_keys)
    assert set(dead_keys) == bad_keys and set(dead_keys.values()) == {1}, dead_keys
    # negative control: the aborted transactions' output, visible to read_uncommitted, shows records twice
    uncommitted_groups = asyncio.run(read_groups(rl_config, names.groups, quiet_s=3, isolation_level="read_uncommitted"))
    uncommitted_dead = asyncio.run(read_dead_letters(rl_config, names.dlq, quiet_s=2,
                                                     isolation_level="read_uncommitted"))
    control = _exactly_once_problems(uncommitted_groups, uncommitted_dead, expected, names.trajectories,
                                     trajectories + BAD_RECORDS)
    assert any("more than once" in problem for problem in control), (
        f"read_uncommitted shows no record twice: the kills aborted no transaction with output ({control})")
    complete = sum(1 for g in groups if len(g.trajectories) == len(expected[g.group_id]))
    print(f"{len(groups)} groups ({complete} complete), {len(dead)} dead letters, kills: {kill_times}; "
          f"read_uncommitted: {control}")
