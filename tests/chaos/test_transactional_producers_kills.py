"""Exactly-once end to end under aborted input transactions and repeated SIGKILLs: three transactional producers
publish trajectories (one group per transaction, some rewards late on ``rewards`` in the same transaction) and abort
a third of their transactions, while the streams worker and the learner are each SIGKILLed three times at random
moments and restarted. At the end every committed trajectory was trained exactly once, into one trusted version
(resolved with ``rlstream lineage``), no trajectory of an aborted transaction reached ``groups`` or a version, and
nothing was skipped: no dead letter, no unresolved offset, the learner reached its last step on exactly the
committed groups. A read_committed consumer that drops a producer's committed records after one of its aborted
transactions (the streams worker's progress gate then skips their offsets as empty) leaves groups never emitted and
the learner short of its last step: the test fails there.

Negative control: read_uncommitted, the aborted transactions' trajectories are in the log (the producers really
aborted transactions with records in them), and the streams worker's ``groups`` output shows groups more than once
(the kills cut its transactions): read_committed hiding both is what is under test.
"""
from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from rlstream.ops.lineage import version_lineage
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent, TrajectoryGroup
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_consumer, make_producer
from tests.support.child_process import ChildProcess
from tests.support.factories import make_reward, make_trajectory
from tests.support.learner_helpers import tiny_model
from tests.support.streams_helpers import Worker, read_all, read_dead_letters, read_groups

PRODUCERS, TRANSACTIONS, GROUP_SIZE = 3, 12, 4
ABORTED_PER_PRODUCER = TRANSACTIONS // 3
COMMITTED_GROUPS = PRODUCERS * (TRANSACTIONS - ABORTED_PER_PRODUCER)
GROUPS_PER_STEP = 2
FEED_S = 60.0  # each producer spreads its transactions over about this long
KILLS = 3  # of each: the streams worker and the learner
CODEC = AvroCodec()


@dataclass
class Sent:
    """What the producers sent: trajectory (id -> position on ``trajectories``), committed or aborted."""

    committed: dict[str, tuple[int, int]] = field(default_factory=dict)
    aborted: dict[str, tuple[int, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


async def _produce(cfg: RlstreamConfig, producer_index: int, sent: Sent, seed: int) -> None:
    """One transactional producer: a group per transaction (a late reward or two in it), a third aborted."""
    names = TopicNames.from_config(cfg.topics)
    rng = random.Random(seed)
    # the last transaction commits: the learner cannot reach its last step before the feed ends (and the kills)
    aborted = set(rng.sample(range(TRANSACTIONS - 1), ABORTED_PER_PRODUCER))
    producer = make_producer(cfg.kafka, transactional_id=f"{cfg.run_id}-producer-{producer_index}")
    await producer.start()
    try:
        for txn in range(TRANSACTIONS):
            example = f"p{producer_index}-t{txn}"
            positions: dict[str, tuple[int, int]] = {}
            await producer.begin_transaction()
            for g in range(GROUP_SIZE):
                reward = round(0.8 * g / (GROUP_SIZE - 1), 3)  # a spread above streams.min_reward_diff
                late = g % 2 == 1
                trajectory = make_trajectory(run_id=cfg.run_id, example_id=example, group_size=GROUP_SIZE,
                                             generation_index=g, policy=cfg.policy, reward=None if late else reward,
                                             seed=rng.randrange(1 << 30))
                meta = await producer.send_and_wait(names.trajectories, CODEC.encode(trajectory),
                                                    key=example.encode())
                positions[trajectory.trajectory_id] = (meta.partition, meta.offset)
                if late:
                    await producer.send_and_wait(names.rewards, CODEC.encode(make_reward(trajectory, reward)),
                                                 key=example.encode())
            if txn in aborted:
                await producer.abort_transaction()
            else:
                await producer.commit_transaction()
            with sent.lock:
                (sent.aborted if txn in aborted else sent.committed).update(positions)
            await asyncio.sleep(rng.uniform(0.5, 1.5) * FEED_S / TRANSACTIONS)
    finally:
        await producer.stop()


def _learner(cfg: RlstreamConfig, model: Path, log_dir: Path) -> ChildProcess:
    overrides = {
        "kafka.bootstrap_servers": cfg.kafka.bootstrap_servers, "redis.url": cfg.redis.url,
        "topics.prefix": cfg.topics.prefix, "topics.partitions": cfg.topics.partitions, "run_id": cfg.run_id,
        "policy": cfg.policy, "learner.output_dir": str(cfg.learner.output_dir), "learner.model": str(model),
        "learner.lora.enabled": "false", "learner.learning_rate": "1e-3",
        "learner.groups_per_step": str(GROUPS_PER_STEP), "learner.checkpoint_every": "1",
        "learner.publish_every": "1", "learner.total_steps": str(COMMITTED_GROUPS // GROUPS_PER_STEP),
        "learner.device": "cpu", "learner.lease_ttl_s": "3", "streams.max_policy_lag": "1000",
    }
    args = [sys.executable, "-m", "rlstream.cli", "--log-format", "json", "learner", "run"]
    for key, value in overrides.items():
        args += ["-o", key, str(value)]
    return ChildProcess(args, log_dir / "learner.log", env={"OMP_NUM_THREADS": "1"})


def _latest(cfg: RlstreamConfig) -> int:
    async def read() -> int:
        control = ControlPlane(cfg.redis.url)
        try:
            return await control.latest_version(cfg.policy)
        finally:
            await control.close()
    return asyncio.run(read())


def _wait_for_open_output(cfg: RlstreamConfig, topic: str, timeout_s: float) -> bool:
    """Whether, within ``timeout_s``, ``topic`` holds records of a transaction still open (its high watermark, what
    read_uncommitted sees, above its last stable offset, what read_committed sees): a kill then cuts a transaction
    with output in it."""
    async def check() -> bool:
        uncommitted = make_consumer(cfg.kafka, group_id=None, isolation_level="read_uncommitted")
        committed = make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed")
        await uncommitted.start()
        await committed.start()
        try:
            await uncommitted.topics()  # the cluster's metadata, so that the topic's partitions are known
            tps = [TopicPartition(topic, p) for p in sorted(uncommitted.partitions_for_topic(topic) or ())]
            assert tps, f"no partitions known for {topic}"
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                high, stable = await uncommitted.end_offsets(tps), await committed.end_offsets(tps)
                if any(high[tp] > stable[tp] for tp in tps):
                    return True
                await asyncio.sleep(0.1)
            return False
        finally:
            await uncommitted.stop()
            await committed.stop()
    return asyncio.run(check())


def _member_positions(groups: list[TrajectoryGroup], topic: str) -> Counter[tuple[int, int]]:
    return Counter((o.partition, o.offset) for g in groups for o in g.source_offsets if o.topic == topic)


@pytest.mark.timeout(900)
def test_aborted_input_transactions_and_kills_train_each_committed_trajectory_once(
        rl_config: RlstreamConfig, tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    model = tiny_model(tmp_path)
    sent = Sent()
    rng = random.Random(2026)
    # transactions of a few seconds (periodic commits only): a kill while processing cuts one with groups in it
    worker_settings = {"streams.group_timeout_s": 600, "streams.max_policy_lag": 1000,
                       "streams.commit_interval_s": 4, "streams.group_commit_delay_s": 0}
    feeders = [threading.Thread(target=lambda i=i: asyncio.run(_produce(rl_config, i, sent, seed=100 + i)))
               for i in range(PRODUCERS)]
    # the kills, at random moments while the records come in: (seconds after the feed began, which)
    kills = sorted([(rng.uniform(5.0, 0.8 * FEED_S), which) for which in ("streams", "learner") for _ in range(KILLS)])
    processes: list[ChildProcess] = []
    try:
        worker = Worker(rl_config, "w1", tmp_path, **worker_settings).start()
        learner = _learner(rl_config, model, tmp_path).start()
        processes += [worker, learner]
        for feeder in feeders:
            feeder.start()
        began = time.monotonic()
        done: list[str] = []
        for at, which in kills:
            time.sleep(max(0.0, at - (time.monotonic() - began)))
            if which == "streams":
                assert worker.alive(), worker.log_tail()
                # at the drawn moment, or as soon after it as the worker has groups in an open transaction
                _wait_for_open_output(rl_config, names.groups, timeout_s=20.0)
                worker.kill()
                worker = Worker(rl_config, "w1", tmp_path, **worker_settings).start()
                processes.append(worker)
            else:
                assert learner.proc is not None and learner.proc.poll() is None, learner.log_tail()
                learner.kill()
                learner = _learner(rl_config, model, tmp_path).start()
                processes.append(learner)
            done.append(f"{which} +{at:.1f}s")
        for feeder in feeders:
            feeder.join()
        assert learner.proc is not None
        try:  # the last learner stops by itself at its last step, once it has every committed group
            learner.proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the learner never reached step {COMMITTED_GROUPS // GROUPS_PER_STEP}: committed groups "
                        f"never reached it (kills: {done})\nlearner:\n{learner.log_tail(6)}\nstreams worker:\n"
                        f"{worker.log_tail(20)}")
        assert learner.proc.returncode == 0, learner.log_tail(80)
        assert worker.alive(), worker.log_tail()
    finally:
        for process in processes:
            process.stop()

    assert len(sent.committed) == COMMITTED_GROUPS * GROUP_SIZE
    assert len(sent.aborted) == PRODUCERS * ABORTED_PER_PRODUCER * GROUP_SIZE
    groups = asyncio.run(read_groups(rl_config, names.groups, quiet_s=3))
    dead = asyncio.run(read_dead_letters(rl_config, names.dlq, quiet_s=2))
    assert not dead, [(d.source_topic, d.error_type, d.error_message) for d in dead[:5]]
    emitted = _member_positions(groups, names.trajectories)
    assert set(emitted) == set(sent.committed.values()) and set(emitted.values()) == {1}, (
        f"{len(set(sent.committed.values()) - set(emitted))} committed trajectories never grouped, "
        f"{sum(n > 1 for n in emitted.values())} grouped twice, "
        f"{len(set(emitted) & set(sent.aborted.values()))} from aborted transactions; kills: {done}")

    # lineage: every version resolves; together they hold each committed trajectory exactly once
    latest = _latest(rl_config)
    assert latest == COMMITTED_GROUPS // GROUPS_PER_STEP, latest
    trained: Counter[tuple[int, int]] = Counter()
    trained_ids: Counter[str] = Counter()
    for version in range(1, latest + 1):
        lineage = asyncio.run(version_lineage(rl_config, version))
        assert not lineage.unresolved, (version, lineage.unresolved)
        trained.update((ref.partition, ref.offset) for ref in lineage.trajectory_offsets)
        trained_ids.update(t for group in lineage.groups for t in group.trajectory_ids)
    assert set(trained) == set(sent.committed.values()) and set(trained.values()) == {1}, (
        f"{len(set(sent.committed.values()) - set(trained))} committed trajectories never trained, "
        f"{sum(n > 1 for n in trained.values())} trained twice; kills: {done}")
    assert set(trained_ids) == set(sent.committed) and not set(trained_ids) & set(sent.aborted)

    # negative control: read_uncommitted sees the aborted trajectories and the killed worker's aborted output
    uncommitted = asyncio.run(read_all(rl_config, names.trajectories, TrajectoryEvent, quiet_s=2,
                                       isolation_level="read_uncommitted"))
    in_log = {(record.partition, record.offset) for record, _ in uncommitted}
    assert set(sent.aborted.values()) <= in_log
    uncommitted_groups = asyncio.run(read_groups(rl_config, names.groups, quiet_s=3,
                                                 isolation_level="read_uncommitted"))
    assert any(n > 1 for n in _member_positions(uncommitted_groups, names.trajectories).values()), (
        f"read_uncommitted shows no group twice: no kill cut a streams transaction with output; kills: {done}")
    print(f"{len(groups)} groups, {latest} versions; kills: {done}")
