"""The stream worker as a real process on the real broker: assembly, duplicates, timeouts, dead letters,
filters and metrics."""
from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, GroupCompletion, Message, MetricEvent, PolicyVersion, RewardEvent, Turn
from rlstream.schemas.topics import TopicNames
from rlstream.streams import validation as v
from rlstream.streams.app import prepare_topics
from tests.support.factories import make_reward, make_trajectory
from tests.support.streams_helpers import (CODEC, Worker, assert_groups_match, interleaved_stream, publish, read_all,
                                   read_dead_letters, read_groups)
from tests.support.version_helpers import announce_versions


@pytest.fixture
def names(rl_config: RlstreamConfig) -> TopicNames:
    asyncio.run(prepare_topics(rl_config))
    return TopicNames.from_config(rl_config.topics)


@pytest.fixture
def start_worker(rl_config: RlstreamConfig, tmp_path: Path) -> Iterator[Any]:
    started: list[Worker] = []

    def start(worker_id: str = "w1", **extra: Any) -> Worker:
        w = Worker(rl_config, worker_id, tmp_path, **extra).start()
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def test_interleaved_groups_come_out_once_with_duplicates_ignored(rl_config: RlstreamConfig, names: TopicNames,
                                                                   start_worker: Any) -> None:
    records, expected = interleaved_stream(rl_config, n_examples=12, group_size=4, seed=3)
    rng = random.Random(5)
    dupes = rng.sample(records, 10)  # exact re-sends of trajectories and rewards, after their originals
    worker = start_worker()
    asyncio.run(publish(rl_config, records + dupes))
    groups = asyncio.run(read_groups(rl_config, names.groups, expect=len(expected), timeout_s=60))
    assert worker.alive(), worker.log_tail()
    assert_groups_match(groups, expected)
    assert all(g.completion == GroupCompletion.full for g in groups)
    for g in groups:  # members sorted by generation, lineage points at real records
        assert [t.generation_index for t in g.trajectories] == [0, 1, 2, 3]
        assert all(o.offset >= 0 and o.partition in range(4) for o in g.source_offsets)
    assert asyncio.run(read_dead_letters(rl_config, names.dlq, timeout_s=3, quiet_s=1)) == []


def test_timeout_and_expiry(rl_config: RlstreamConfig, names: TopicNames, start_worker: Any) -> None:
    worker = start_worker(**{"streams.group_timeout_s": 3, "streams.min_group_size": 2})
    timed = [make_trajectory(run_id=rl_config.run_id, example_id="slow", group_size=4, generation_index=i,
                             reward=None) for i in range(3)]
    expiring = [make_trajectory(run_id=rl_config.run_id, example_id="dead", group_size=4, generation_index=0,
                                reward=None)]
    recs = [(names.trajectories, t.example_id.encode(), CODEC.encode(t)) for t in timed + expiring]
    recs += [(names.rewards, b"slow", CODEC.encode(make_reward(timed[0], 0.0))),
             (names.rewards, b"slow", CODEC.encode(make_reward(timed[1], 1.0)))]
    asyncio.run(publish(rl_config, recs))
    groups = asyncio.run(read_groups(rl_config, names.groups, expect=1, timeout_s=30))
    assert worker.alive(), worker.log_tail()
    assert len(groups) == 1
    g = groups[0]
    assert g.completion == GroupCompletion.timeout and g.example_id == "slow" and g.expected_size == 4
    assert {t.trajectory_id for t in g.trajectories} == {timed[0].trajectory_id, timed[1].trajectory_id}
    letters = asyncio.run(read_dead_letters(rl_config, names.dlq, expect=2, timeout_s=20))
    by_reason = {(d.error_type, d.key) for d in letters}
    assert by_reason == {(v.REWARD_TIMEOUT, b"slow"), (v.GROUP_EXPIRED, b"dead")}
    # a reward for the expired group's member now comes too late and is dead-lettered, not re-opened
    asyncio.run(publish(rl_config, [(names.rewards, b"dead", CODEC.encode(make_reward(expiring[0], 1.0)))]))
    assert asyncio.run(read_groups(rl_config, names.groups, timeout_s=5, quiet_s=4)) == groups


def malformed_records(cfg: RlstreamConfig, names: TopicNames) -> list[tuple[str, bytes | None, bytes | None, str]]:
    """(topic, key, value, expected reason) for 14 kinds of bad input."""
    def traj(**change: Any) -> bytes:
        return CODEC.encode(make_trajectory(run_id=cfg.run_id, example_id="bad", group_size=4).model_copy(update=change))

    good = make_trajectory(run_id=cfg.run_id, example_id="bad", group_size=4)
    unknown = b"\xc3\x01" + b"\x11" * 8 + CODEC.encode(good)[10:]
    T, R = names.trajectories, names.rewards
    return [
        (T, b"bad", b"not avro at all", v.CORRUPT_PAYLOAD),
        (T, b"bad", CODEC.encode(good)[:-20], v.CORRUPT_PAYLOAD),
        (T, b"bad", unknown, v.UNKNOWN_SCHEMA),
        (T, b"bad", CODEC.encode(make_reward(good, 1.0)), v.WRONG_EVENT_TYPE),
        (T, b"bad", None, v.EMPTY_VALUE),
        (T, b"other-key", CODEC.encode(good), v.KEY_MISMATCH),
        (T, b"bad", traj(group_id=""), v.MISSING_ID),
        (T, b"bad", traj(messages=[Message(role="assistant", content="x")]), v.BAD_FIRST_ROLE),
        (T, b"bad", traj(messages=[Message(role="user", content="q"), Message(role="assistant", content="a"),
                                   Message(role="assistant", content="b")]), v.CONSECUTIVE_ASSISTANT),
        (T, b"bad", traj(turns=[Turn(completion_token_ids=[1, 2], completion_logprobs=[-1.0])]),
         v.TOKEN_LOGPROB_MISMATCH),
        (T, b"bad", traj(reward=math.nan), v.NON_FINITE_REWARD),
        (T, b"bad", traj(group_size=1000, generation_index=0), v.GROUP_SIZE_OUT_OF_BOUNDS),
        (T, b"bad", traj(messages=[]), v.NO_MESSAGES),
        (R, b"bad", CODEC.encode(RewardEvent(trajectory_id="t", group_id="g", example_id="bad", reward=math.inf)),
         v.NON_FINITE_REWARD),
        (R, b"bad", b"\x00\x00\x00\x00\x07garbage", v.UNKNOWN_SCHEMA),
    ]


def test_malformed_events_go_to_dlq_while_good_ones_flow(rl_config: RlstreamConfig, names: TopicNames,
                                                         start_worker: Any) -> None:
    bad = malformed_records(rl_config, names)
    good, expected = interleaved_stream(rl_config, n_examples=6, group_size=3, seed=11)
    rng = random.Random(2)
    mixed: list[tuple[str, bytes | None, bytes | None]] = list(good)
    for topic, key, value, _ in bad:
        mixed.insert(rng.randrange(len(mixed) + 1), (topic, key, value))
    worker = start_worker(**{"streams.max_allowed_group_size": 64})
    asyncio.run(publish(rl_config, mixed))
    groups = asyncio.run(read_groups(rl_config, names.groups, expect=len(expected), timeout_s=60))
    assert_groups_match(groups, expected)
    pairs = asyncio.run(read_all(rl_config, names.dlq, DeadLetter,
                                 expect=len(bad), timeout_s=30))
    assert worker.alive(), worker.log_tail()
    letters = [d for _, d in pairs]
    got = sorted((d.source_topic, d.value or b"", d.error_type) for d in letters)
    want = sorted((t, value or b"", reason) for t, _, value, reason in bad)
    assert got == want
    assert len({reason for *_, reason in bad}) >= 10
    for d in letters:  # the offsets name the real source records
        assert d.source_offset >= 0 and d.error_message and d.service.startswith("streams")
        if d.error_type == v.KEY_MISMATCH:
            assert d.key == b"other-key"


def test_filters_and_metrics(rl_config: RlstreamConfig, names: TopicNames, start_worker: Any) -> None:
    pv = PolicyVersion(policy=rl_config.policy, version=10, base_model="tiny", uri="file:///x", learner_step=10)
    asyncio.run(announce_versions(rl_config, [pv]))  # only a version the fenced learner announced counts
    fresh, expected = interleaved_stream(rl_config, n_examples=3, group_size=2, seed=1, policy_version=7)
    stale, _ = interleaved_stream(rl_config, n_examples=2, group_size=2, seed=2, policy_version=5, prefix="old")
    flat = [make_trajectory(run_id=rl_config.run_id, example_id="flat", group_size=2, generation_index=i,
                            policy=rl_config.policy, policy_version=9, reward=0.5) for i in range(2)]
    recs = fresh + stale + [(names.trajectories, b"flat", CODEC.encode(t)) for t in flat]
    worker = start_worker(**{"streams.max_policy_lag": 3})
    asyncio.run(publish(rl_config, recs + [(names.trajectories, b"x", b"junk")]))
    groups = asyncio.run(read_groups(rl_config, names.groups, expect=len(expected), timeout_s=60))
    assert_groups_match(groups, expected)  # 7 >= 10 - 3 passes; 5 is stale; "flat" has no variance
    metrics = asyncio.run(wait_for_metrics(rl_config, names, {
        ("streams.groups_filtered", "stale"): 2, ("streams.groups_filtered", "zero_variance"): 1,
        ("streams.groups_completed", ""): 6, ("streams.dlq", "corrupt_payload"): 1, ("streams.events_out", ""): 3}))
    assert worker.alive(), worker.log_tail()
    names_seen = {m.name for m in metrics}
    for wanted in ("streams.events_in_per_s", "streams.events_out_per_s", "streams.assembly_latency_p50_s",
                   "streams.assembly_latency_p99_s", "streams.consumer_lag", "streams.events_in"):
        assert wanted in names_seen, wanted
    p99 = [m.value for m in metrics if m.name == "streams.assembly_latency_p99_s"][-1]
    assert 0 <= p99 < 30


async def wait_for_metrics(cfg: RlstreamConfig, names: TopicNames, want: dict[tuple[str, str], float],
                           timeout_s: float = 30) -> list[MetricEvent]:
    """Read the metrics topic until every wanted (name, reason) has reached its value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        metrics = [m for _, m in await read_all(cfg, names.metrics, MetricEvent, timeout_s=3, quiet_s=1)]
        latest = {(m.name, m.tags.get("reason", "")): m.value for m in metrics}
        if all(latest.get(k) == val for k, val in want.items()):
            return metrics  # type: ignore[return-value]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"metrics not reached: want {want}, have "
                                 f"{ {k: latest.get(k) for k in want} }")
        await asyncio.sleep(1)


def test_single_responses_join_late_feedback_and_carry_a_leave_one_out_baseline(
        rl_config: RlstreamConfig, names: TopicNames, start_worker: Any) -> None:
    """Production traffic: one response per request (group_size 1) with the task in its metadata; feedback comes
    after the GRPO group timeout and still joins, once; each emitted single carries the baseline of the rewards
    before it (hand-computed); the first reward of the key has nothing to compare with and is filtered, and so is
    the second: with one reward behind its baseline it would train with advantage 0 (learner.baseline_min_count 2)."""
    worker = start_worker(**{"streams.group_timeout_s": 2, "streams.min_reward_diff": 0})
    singles = [make_trajectory(run_id=rl_config.run_id, example_id="letters", group_id=f"req-{i}", group_size=1,
                               reward=None).model_copy(update={"metadata": {"task": "letters"}}) for i in range(5)]
    asyncio.run(publish(rl_config, [(names.trajectories, b"letters", CODEC.encode(t)) for t in singles]))
    time.sleep(4)  # past group_timeout_s: singles wait streams.reward_window_s for feedback
    rewards = [0.2, 0.8, 0.5, 0.9, 0.1]
    feedback = [(names.rewards, b"letters", CODEC.encode(make_reward(t, r))) for t, r in zip(singles, rewards)]
    asyncio.run(publish(rl_config, feedback + feedback[:2]))  # two repeated
    groups = asyncio.run(read_groups(rl_config, names.groups, expect=3, timeout_s=30))
    assert worker.alive(), worker.log_tail()
    by_id = {g.group_id: g for g in groups}
    assert sorted(by_id) == ["req-2", "req-3", "req-4"] and len(groups) == 3
    expected = {"req-2": (0.5, 0.42426, 2), "req-3": (0.5, 0.3, 3),
                "req-4": (0.6, 0.31623, 4)}
    for gid, (mean, std, count) in expected.items():
        b = by_id[gid].baseline
        assert b is not None and b.key == f"{singles[0].policy}|letters" and b.count == count
        assert b.mean == pytest.approx(mean) and b.std == pytest.approx(std, abs=1e-4)
        assert len(by_id[gid].trajectories) == 1
    assert asyncio.run(read_groups(rl_config, names.groups, timeout_s=3, quiet_s=2)) == groups  # nothing twice
    assert asyncio.run(read_dead_letters(rl_config, names.dlq, timeout_s=2, quiet_s=1)) == []


@pytest.mark.parametrize("group_commit_delay_s", [0.05, 0.0])
def test_a_sent_group_is_committed_promptly_not_at_the_commit_interval(
        rl_config: RlstreamConfig, names: TopicNames, start_worker: Any, group_commit_delay_s: float) -> None:
    # the periodic commit is 60 s away: within 20 s a group can only become readable (read_committed) through the
    # commit that follows a sent group; with that commit off (0.0, the negative control) the worker has written the
    # group (read_uncommitted sees it) but its transaction stays open
    worker = start_worker(**{"streams.commit_interval_s": 60, "streams.group_commit_delay_s": group_commit_delay_s})
    members = [make_trajectory(run_id=rl_config.run_id, example_id="prompt", group_size=2, generation_index=i,
                               reward=float(i)) for i in range(2)]
    asyncio.run(publish(rl_config, [(names.trajectories, b"prompt", CODEC.encode(t)) for t in members]))
    written = asyncio.run(read_groups(rl_config, names.groups, expect=1, timeout_s=20, quiet_s=0,
                                      isolation_level="read_uncommitted"))
    assert [g.example_id for g in written] == ["prompt"], worker.log_tail()
    committed = asyncio.run(read_groups(rl_config, names.groups, expect=1, timeout_s=5, quiet_s=0))
    assert worker.alive(), worker.log_tail()
    assert [g.example_id for g in committed] == (["prompt"] if group_commit_delay_s > 0 else [])
