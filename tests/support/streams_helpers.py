"""Helpers of the streams tests: run the worker as a real process, publish events, read groups/dlq."""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from rlstream.transport.kafka import make_consumer
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, MetricEvent, TrajectoryGroup, WireModel
from rlstream.transport import aborted_index
from rlstream.transport import metric_names as mn
from bench.workload import publish, worker_overrides
from tests.support.child_process import ChildProcess

CODEC = AvroCodec()
# the readers below use read_committed: keep them from dropping records committed after an aborted transaction
# (a killed worker's) on the local broker (see rlstream/transport/aborted_index.py)
aborted_index.install()


class Worker(ChildProcess):
    """``python -m rlstream.cli streams worker`` as a child process (its own session, stopped by PID)."""

    def __init__(self, cfg: RlstreamConfig, worker_id: str, log_dir: Path, **extra: Any) -> None:
        # RLSTREAM_TEST_WORKER_LOGLEVEL=INFO keeps Faust's own recovery and rebalance lines in the worker log
        loglevel = os.environ.get("RLSTREAM_TEST_WORKER_LOGLEVEL", "WARNING")
        super().__init__([sys.executable, "-m", "rlstream.cli", "streams", "worker", "--worker-id", worker_id,
                          "--log-level", loglevel, *worker_overrides(cfg, **extra)], log_dir / f"{worker_id}.log")


async def remove_dead_member(cfg: RlstreamConfig, worker_id: str, timeout_s: float = 30.0) -> int:
    """Take a killed worker out of the streams consumer group (what Kafka's session timeout does, and what an
    operator does with ``removeMembersFromConsumerGroup`` for a dead static member): noida-db never expires a
    SIGKILLed member, so without this its partitions stay assigned to it and nobody processes them. Returns
    the number of members removed (0 when the broker already dropped it)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.protocol.group import LeaveGroupRequest

    from rlstream.transport.kafka import client_options

    group = cfg.streams.app_id
    client_id = f"{cfg.kafka.client_id}-streams-{worker_id}"  # the worker's broker_client_id (streams/app.py)
    admin = AIOKafkaAdminClient(**client_options(cfg.kafka))
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                coordinator = await admin.find_coordinator(group)
                described = await admin.describe_consumer_groups([group], group_coordinator_id=coordinator)
                members = [m[0] for d in described for g in d.groups for m in g[5] if m[1] == client_id]
                for member_id in members:
                    response = await admin._client.send(coordinator, LeaveGroupRequest(group, member_id))
                    assert response.error_code == 0, response
                return len(members)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await admin.close()


async def read_all(cfg: RlstreamConfig, topic: str, model: type[WireModel], expect: int | None = None,
                   timeout_s: float = 60.0, quiet_s: float = 3.0, isolation_level: str = "read_committed"
                   ) -> list[tuple[Any, WireModel]]:
    """Read ``topic`` from the beginning (read_committed unless told) until ``expect`` records arrived (or, without
    ``expect``, until nothing new came for ``quiet_s``); returns (record, decoded) pairs."""
    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level=isolation_level)
    await consumer.start()
    out: list[tuple[Any, WireModel]] = []
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        last_new = time.monotonic()
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                for r in records:
                    out.append((r, CODEC.decode(r.value, model)))
                    last_new = time.monotonic()
            if expect is not None and len(out) >= expect:
                # linger a little to catch duplicates beyond the expected count
                if time.monotonic() - last_new > quiet_s:
                    break
            elif expect is None and time.monotonic() - last_new > quiet_s and out:
                break
        return out
    finally:
        await consumer.stop()


async def read_groups(cfg: RlstreamConfig, topic: str, **kw: Any) -> list[TrajectoryGroup]:
    return [g for _, g in await read_all(cfg, topic, TrajectoryGroup, **kw)]  # type: ignore[misc]


async def read_dead_letters(cfg: RlstreamConfig, topic: str, **kw: Any) -> list[DeadLetter]:
    return [d for _, d in await read_all(cfg, topic, DeadLetter, **kw)]  # type: ignore[misc]


def interleaved_stream(cfg: RlstreamConfig, n_examples: int, group_size: int, seed: int, *,
                       late_fraction: float = 0.5, early_fraction: float = 0.1, policy_version: int = 0,
                       completion_tokens: int = 8, prefix: str = "ex", short_every: int = 0
                       ) -> tuple[list[tuple[str, bytes, bytes]], dict[str, dict[str, float]]]:
    """Trajectories of ``n_examples`` x ``group_size`` in random interleaving, some rewards inline, some as
    late RewardEvents (a few even before their trajectory). With ``short_every`` N, every Nth example's last
    generation is never sent (nor its reward): that group can only leave on its timeout. Returns the records
    and, per group_id, the expected ``{trajectory_id: reward}``."""
    import random

    from rlstream.schemas.topics import TopicNames
    from tests.support.factories import make_reward, make_trajectory

    names = TopicNames.from_config(cfg.topics)
    rng = random.Random(seed)
    per_example: list[list[tuple[str, bytes, bytes]]] = []
    expected: dict[str, dict[str, float]] = {}
    for e in range(n_examples):
        example = f"{prefix}{e}"
        key = example.encode()
        seq: list[tuple[str, bytes, bytes]] = []
        for g in range(group_size):
            reward = round((g / max(1, group_size - 1)) * 0.8 + (e % 5) * 0.01, 4)
            r = rng.random()
            inline = r >= late_fraction
            t = make_trajectory(run_id=cfg.run_id, example_id=example, group_size=group_size, generation_index=g,
                                policy=cfg.policy, policy_version=policy_version, reward=reward if inline else None,
                                completion_tokens=completion_tokens, seed=rng.randrange(1 << 30))
            if short_every and e % short_every == 0 and g == group_size - 1:
                continue  # the member that never comes
            expected.setdefault(t.group_id, {})[t.trajectory_id] = reward
            traj_rec = (names.trajectories, key, CODEC.encode(t))
            if inline:
                seq.append(traj_rec)
            else:
                rew_rec = (names.rewards, key, CODEC.encode(make_reward(t, reward)))
                seq += [rew_rec, traj_rec] if r < early_fraction else [traj_rec, rew_rec]
        per_example.append(seq)
    # random interleaving that keeps each example's own order (one producer, one partition per example)
    out: list[tuple[str, bytes, bytes]] = []
    cursors = [0] * n_examples
    live = [i for i in range(n_examples)]
    while live:
        i = rng.choice(live)
        out.append(per_example[i][cursors[i]])
        cursors[i] += 1
        if cursors[i] == len(per_example[i]):
            live.remove(i)
    return out, expected


def assert_groups_match(groups: list[TrajectoryGroup], expected: dict[str, dict[str, float]]) -> None:
    """Each expected group exactly once, with exactly its members, their rewards and correct stats."""
    ids = [g.group_id for g in groups]
    dupes = {i for i in ids if ids.count(i) > 1}
    assert not dupes, f"{len(dupes)} groups emitted more than once, e.g. {sorted(dupes)[:3]}"
    missing = set(expected) - set(ids)
    assert not missing, f"{len(missing)} groups never emitted, e.g. {sorted(missing)[:3]}"
    assert set(ids) == set(expected)
    for g in groups:
        members = {t.trajectory_id: t.reward for t in g.trajectories}
        assert members == expected[g.group_id], g.group_id
        rewards = list(expected[g.group_id].values())
        assert abs(g.reward_mean - sum(rewards) / len(rewards)) < 1e-9
        assert g.reward_min == min(rewards) and g.reward_max == max(rewards)
        assert len([o for o in g.source_offsets if o.topic.endswith("trajectories")]) == len(rewards)


async def wait_for_count(cfg: RlstreamConfig, topic: str, n: int, timeout_s: float = 60.0) -> int:
    """Block until ``topic`` holds at least ``n`` committed records; returns the count seen."""
    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or set())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        seen, deadline = 0, time.monotonic() + timeout_s
        while seen < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: {seen} records after {timeout_s}s, wanted {n}")
            batch = await consumer.getmany(timeout_ms=200)
            seen += sum(len(r) for r in batch.values())
        return seen
    finally:
        await consumer.stop()


async def wait_for_worker_events(cfg: RlstreamConfig, topic: str, worker: str, timeout_s: float) -> None:
    """Until ``worker`` has reported processed input (streams.events_in > 0) on the metrics topic."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = [m for _, m in await read_all(cfg, topic, MetricEvent, timeout_s=3, quiet_s=0.5)]
        if any(m.name == mn.STREAMS_EVENTS_IN and m.value > 0 and m.tags.get("worker") == worker for m in metrics):
            return
    raise AssertionError(f"{worker} processed nothing within {timeout_s:.0f} s")


def times_processing_began(log_dir: Path) -> int:
    """How many lives of worker w1 have begun processing (each resync to the progress markers is logged)."""
    with contextlib.suppress(OSError):
        return (log_dir / "w1.log").read_text(errors="replace").count("sought to their progress markers")
    return 0


def last_resync(log_dir: Path) -> str:
    """The last "sought to their progress markers" line of worker w1 (where each input partition started)."""
    lines = (log_dir / "w1.log").read_text(errors="replace").splitlines()
    return next((line for line in reversed(lines) if "sought to their progress markers" in line), "")


def wait_for_processing(worker: Worker, log_dir: Path, before: int, timeout_s: float = 120.0) -> None:
    """Until worker w1 begins processing for the ``before + 1``-th time (its resync to the progress markers)."""
    deadline = time.monotonic() + timeout_s
    while times_processing_began(log_dir) <= before:
        assert worker.alive() and time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.2)
