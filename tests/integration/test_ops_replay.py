"""``rlstream replay`` on the real broker: the new run sees exactly the slice, the live run is untouched."""
from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

import pytest

from rlstream.ops.replay import Position, ReplayFilter, ReplayError, parse_position, replay, replay_group_id, replay_trajectory_id
from rlstream.schemas.models import DeadLetter, MetricEvent, TrajectoryEvent, TrajectorySource
from tests.support.factories import make_reward, make_trajectory
from tests.support.ops_helpers import publish, publish_raw, read_all

NEW_RUN = "replay-run"


def live_batch(run_id: str, policy: str, tag: str, examples: int = 6, gens: int = 4, version: int = 0,
               unrewarded: bool = False) -> list[TrajectoryEvent]:
    out = []
    for e in range(examples):
        for g in range(gens):
            unrewarded_one = unrewarded and g % 2 == 1
            out.append(make_trajectory(run_id=run_id, example_id=f"{tag}-ex{e}", group_size=gens, generation_index=g,
                                       policy=policy, policy_version=version, seed=e * 10 + g,
                                       reward=None if unrewarded_one else float(g % 2)))
    return out


def by_key(event: TrajectoryEvent) -> str:
    return event.example_id


async def test_replay_offset_slice_while_live_run_continues(rl_config, created_topics):
    live_run, topic = rl_config.run_id, created_topics.trajectories
    first = live_batch(live_run, rl_config.policy, "a", unrewarded=True)
    placed = await publish(rl_config, topic, first, by_key)
    late = [make_reward(e, 0.5 + i) for i, e in enumerate(first) if e.reward is None]
    await publish(rl_config, created_topics.rewards, late, lambda r: r.example_id)
    expected = {e.trajectory_id: (p, o, e) for e, (p, o) in zip(first, placed) if 1 <= o < 4}
    assert expected and len(expected) < len(first)

    more = live_batch(live_run, rl_config.policy, "b", version=1)

    async def live_run_goes_on() -> None:
        for event in more:
            await publish(rl_config, topic, [event], by_key)

    report, _ = await asyncio.gather(
        replay(rl_config, NEW_RUN, parse_position("1"), parse_position("4")), live_run_goes_on())

    assert report.published == len(expected) and report.read == len(expected)
    assert report.dead_lettered == 0 and report.filtered == 0
    assert report.rewards_joined == sum(1 for *_, e in expected.values() if e.reward is None)

    everything = await read_all(rl_config, topic, TrajectoryEvent)
    replayed = [e for _, _, e in everything if e.run_id == NEW_RUN]
    assert sorted(e.metadata["replay_of_trajectory_id"] for e in replayed) == sorted(expected)
    rewards_late = {r.trajectory_id: r.reward for r in late}
    for event in replayed:
        p, o, original = expected[event.metadata["replay_of_trajectory_id"]]
        assert event.source == TrajectorySource.replay
        assert event.trajectory_id == replay_trajectory_id(NEW_RUN, original.trajectory_id) != original.trajectory_id
        assert event.group_id == replay_group_id(NEW_RUN, original.group_id)
        assert event.metadata["replay_of_offset"] == f"{topic}:{p}:{o}"
        assert event.metadata["replay_of_run_id"] == live_run and event.metadata["task"] == "test"
        assert event.messages == original.messages and event.turns == original.turns
        assert event.reward == (original.reward if original.reward is not None else rewards_late[original.trajectory_id])

    # the live run: every event it wrote, unchanged, and nothing else
    live = [e for _, _, e in everything if e.run_id == live_run]
    assert sorted((e.model_dump() for e in live), key=lambda d: d["trajectory_id"]) == \
        sorted((e.model_dump() for e in first + more), key=lambda d: d["trajectory_id"])
    assert {e.run_id for _, _, e in everything} == {live_run, NEW_RUN}

    metrics = [e for _, _, e in await read_all(rl_config, created_topics.metrics, MetricEvent)]
    assert [(m.run_id, m.name, m.value) for m in metrics] == [(NEW_RUN, "replay/published", float(len(expected)))]


async def test_replay_time_range_and_filters(rl_config, created_topics):
    topic = created_topics.trajectories
    before = live_batch(rl_config.run_id, rl_config.policy, "before", examples=3, gens=2)
    await publish(rl_config, topic, before, by_key)
    time.sleep(0.05)
    t_from = datetime.now(timezone.utc)
    time.sleep(0.05)
    inside = [e for v in range(4) for e in live_batch(rl_config.run_id, rl_config.policy, f"in{v}", examples=2,
                                                       gens=2, version=v)]
    await publish(rl_config, topic, inside, by_key)
    time.sleep(0.05)
    t_to = datetime.now(timezone.utc)
    time.sleep(0.05)
    after = live_batch(rl_config.run_id, rl_config.policy, "after", examples=3, gens=2)
    await publish(rl_config, topic, after, by_key)

    report = await replay(rl_config, "by-time", parse_position(t_from.isoformat()),
                          parse_position(t_to.isoformat().replace("+00:00", "Z")))
    assert report.published == len(inside)
    # policy version range and example filter on top of the same window
    selection = ReplayFilter(min_policy_version=1, max_policy_version=2, example_ids=frozenset({"in1-ex0", "in2-ex1"}))
    report2 = await replay(rl_config, "filtered", parse_position(t_from.isoformat()), parse_position(t_to.isoformat()),
                           selection)
    # a source filter that matches nothing (the live events are source=rollout)
    report3 = await replay(rl_config, "none", None, None, ReplayFilter(sources=frozenset({"production"})))
    assert report3.published == 0 and report3.filtered == report3.read > 0

    everything = [e for _, _, e in await read_all(rl_config, topic, TrajectoryEvent)]
    by_time = {e.metadata["replay_of_trajectory_id"] for e in everything if e.run_id == "by-time"}
    assert by_time == {e.trajectory_id for e in inside}
    filtered = {e.metadata["replay_of_trajectory_id"] for e in everything if e.run_id == "filtered"}
    assert filtered == {e.trajectory_id for e in inside
                        if e.example_id in {"in1-ex0", "in2-ex1"} and 1 <= e.policy_version <= 2}
    assert report2.published == len(filtered) == 4
    assert not [e for e in everything if e.run_id == "none"]


async def test_replay_partition_offsets_and_dead_letters(rl_config, created_topics):
    topic = created_topics.trajectories
    events = live_batch(rl_config.run_id, rl_config.policy, "p", examples=8, gens=2)
    placed = await publish(rl_config, topic, events, by_key)
    garbage_at = await publish_raw(rl_config, topic, b"\xc3\x01not avro at all", key=b"p-ex0")
    partition = garbage_at[0]
    report = await replay(rl_config, "one-partition", parse_position(f"{partition}:0"), None)
    assert set(report.ranges) == {partition}
    assert report.dead_lettered == 1
    expected = {e.trajectory_id for e, (p, _) in zip(events, placed) if p == partition}
    got = {e.metadata["replay_of_trajectory_id"] for _, _, e in await read_all(rl_config, topic, TrajectoryEvent)
           if e.run_id == "one-partition"}
    assert got == expected and report.published == len(expected)
    letters = [e for _, _, e in await read_all(rl_config, created_topics.dlq, DeadLetter)]
    assert len(letters) == 1
    assert (letters[0].source_topic, letters[0].source_partition, letters[0].source_offset) == (topic, *garbage_at)
    assert letters[0].service == "replay" and letters[0].value == b"\xc3\x01not avro at all"

    with pytest.raises(ReplayError, match="no partition"):
        await replay(rl_config, "x", Position(per_partition={99: 0}), None)
