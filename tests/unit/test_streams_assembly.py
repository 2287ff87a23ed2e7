"""Group assembly and filters as pure functions over dict stores."""
from __future__ import annotations

from typing import Any

import pytest

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import CurriculumConfig, StreamsConfig
from rlstream.schemas.models import GroupCompletion, TrajectoryEvent
from rlstream.streams import validation as v
from rlstream.streams.assembly import (AssemblyRules, ClosedGroup, GroupAssembler, OpenGroup, Outcome, SourceRef,
                                       group_state_from_json, group_stats)
from rlstream.streams.filters import CURRICULUM, STALE, ZERO_VARIANCE, apply_filters
from tests.support.factories import make_reward, make_trajectory

CODEC = AvroCodec()
T, R = "p.trajectories", "p.rewards"


class Harness:
    def __init__(self, timeout: float = 10.0, min_group_size: int = 2) -> None:
        self.groups: dict[str, Any] = {}
        self.members: dict[SourceRef, bytes] = {}  # the payload cache
        self.asm = GroupAssembler(self.groups, self.members, CODEC, AssemblyRules(timeout, min_group_size, 100.0))
        self.offset = 0

    def traj(self, t: TrajectoryEvent, now: float = 0.0) -> Outcome:
        self.offset += 1
        return self.asm.on_trajectory(t, CODEC.encode(t), t.example_id.encode(), SourceRef(T, 0, self.offset), now, now)

    def reward(self, t: TrajectoryEvent, r: float, now: float = 0.0) -> Outcome:
        self.offset += 1
        ev = make_reward(t, r)
        return self.asm.on_reward(ev, CODEC.encode(ev), t.example_id.encode(), SourceRef(R, 0, self.offset), now, now)


def gen(n: int = 4, reward: float | None = None, example: str = "ex") -> list[TrajectoryEvent]:
    return [make_trajectory(example_id=example, group_size=n, generation_index=i, reward=reward) for i in range(n)]


def test_inline_and_late_rewards_complete_once_with_lineage() -> None:
    h, ts = Harness(), gen(4)
    out = Outcome()
    out.extend(h.reward(ts[0], 1.0))            # reward before its trajectory: held
    for t in ts:
        out.extend(h.traj(t))
    assert not out.finished
    out.extend(h.reward(ts[1], 0.0))
    out.extend(h.reward(ts[2], 0.5))
    out.extend(h.reward(ts[3], 0.5))
    assert len(out.finished) == 1 and not out.rejects
    g = out.finished[0].group
    assert [t.generation_index for t in g.trajectories] == [0, 1, 2, 3]
    assert [t.reward for t in g.trajectories] == [1.0, 0.0, 0.5, 0.5]
    assert (g.reward_mean, g.reward_min, g.reward_max) == (0.5, 0.0, 1.0)
    assert g.reward_std == pytest.approx(group_stats([1.0, 0.0, 0.5, 0.5])[1])
    assert g.completion == GroupCompletion.full
    assert sorted((o.topic, o.offset) for o in g.source_offsets) == sorted(
        [(T, 2), (T, 3), (T, 4), (T, 5), (R, 1), (R, 6), (R, 7), (R, 8)])
    assert h.members == {} and h.groups[g.group_id]["closed"]
    assert out.counts["rewards_held"] == 1 and out.counts["groups_completed"] == 1


def test_duplicates_are_ignored_before_and_after_emission() -> None:
    h, ts = Harness(), gen(2, reward=1.0)
    ts[1] = ts[1].model_copy(update={"reward": 0.0})
    assert h.traj(ts[0]).counts["trajectories_accepted"] == 1
    assert h.traj(ts[0]).counts["duplicate_trajectory"] == 1
    assert h.reward(ts[0], 0.3).counts["duplicate_reward"] == 1  # inline reward kept
    out = h.traj(ts[1])
    assert len(out.finished) == 1 and out.finished[0].group.reward_max == 1.0
    after = h.traj(ts[1])
    assert after.counts["duplicate_trajectory"] == 1 and not after.finished and not after.rejects
    late = make_trajectory(example_id="ex", group_id=ts[0].group_id, group_size=2, generation_index=1)
    assert h.traj(late).rejects[0].reason == "group_closed"


def test_timeout_emits_rewarded_members_and_dead_letters_the_rest() -> None:
    h, ts = Harness(timeout=10, min_group_size=2), gen(4)
    for t in ts:
        h.traj(t, now=0.0)
    h.reward(ts[0], 1.0, now=1.0)
    h.reward(ts[1], 0.0, now=1.0)
    assert not h.asm.on_tick(0, now=9.0).finished
    out = h.asm.on_tick(0, now=10.0)
    assert len(out.finished) == 1 and out.finished[0].group.completion == GroupCompletion.timeout
    assert len(out.finished[0].group.trajectories) == 2
    assert sorted(r.reason for r in out.rejects) == [v.REWARD_TIMEOUT] * 2
    assert all(r.value is not None and r.source.topic == T for r in out.rejects)
    assert h.asm.on_tick(0, now=50.0).finished == []  # closed: never twice
    assert h.asm.on_tick(0, now=200.0).counts["closed_forgotten"] == 1
    assert h.groups == {}


def test_expiry_below_min_group_size() -> None:
    h, ts = Harness(timeout=5, min_group_size=3), gen(4)
    h.traj(ts[0]); h.traj(ts[1])  # noqa: E702
    h.reward(ts[0], 1.0)
    orphan = make_trajectory(example_id="ex", group_id=ts[0].group_id, group_size=4, generation_index=3)
    h.reward(orphan, 0.2)
    out = h.asm.on_tick(0, now=6.0)
    assert not out.finished and out.counts["groups_expired"] == 1
    assert sorted(r.reason for r in out.rejects) == sorted([v.GROUP_EXPIRED, v.GROUP_EXPIRED, v.ORPHAN_REWARD])


def test_stored_state_keeps_the_changelog_layout() -> None:
    """States written by earlier versions decode to the dataclasses and encode back unchanged (recovery)."""
    open_json = {"g": "g1", "e": "ex", "r": "run", "pol": "pol", "n": 2, "p": 3, "t0": 1.5, "t1": 2.5,
                 "m": {"t1": {"src": [T, 3, 7], "rw": None, "comp": {}, "rsrc": None, "v": 4, "k": "ex"},
                       "t2": {"src": [T, 3, 8], "rw": 1.0, "comp": {"a": 1.0}, "rsrc": [R, 3, 9], "v": 5, "k": None}},
                 "pr": {"t3": {"rw": 0.5, "comp": {"b": 0.5}, "src": [R, 3, 10]}}}
    state = group_state_from_json(open_json)
    assert isinstance(state, OpenGroup) and state.group_size == 2 and state.rewarded_ids() == ["t2"]
    assert state.members["t2"].reward_source == SourceRef(R, 3, 9) and state.pending_rewards["t3"].reward == 0.5
    # keys added since (task, generation index) take their defaults, and a current state round-trips
    current = {**open_json, "tk": "", "m": {tid: {**m, "gi": 0} for tid, m in open_json["m"].items()}}
    assert state.to_json() == current
    assert group_state_from_json(current).to_json() == current
    closed_json = {"g": "g1", "p": 3, "closed": True, "closed_at": 9.0, "ids": ["t1", "t2"]}
    closed = group_state_from_json(closed_json)
    assert isinstance(closed, ClosedGroup) and closed.member_ids == ["t1", "t2"]
    assert closed.to_json() == closed_json


def test_tick_only_touches_its_partition() -> None:
    h, ts = Harness(timeout=1), gen(2, reward=1.0)
    h.traj(ts[0])
    assert h.asm.on_tick(1, now=5.0).counts["groups_expired"] == 0
    assert h.asm.on_tick(0, now=5.0).counts["groups_expired"] == 1


def test_group_size_and_example_mismatch_rejected() -> None:
    h, ts = Harness(), gen(4)
    h.traj(ts[0])
    other = make_trajectory(example_id="ex", group_id=ts[0].group_id, group_size=3, generation_index=1)
    assert h.traj(other).rejects[0].reason == v.GROUP_SIZE_MISMATCH
    stranger = make_trajectory(example_id="zz", group_id=ts[0].group_id, group_size=4, generation_index=1)
    assert h.traj(stranger).rejects[0].reason == v.REWARD_GROUP_MISMATCH


def finished_group(rewards: list[float], versions: list[int] | None = None, example: str = "ex"):  # type: ignore[no-untyped-def]
    h = Harness()
    ts = [make_trajectory(example_id=example, group_size=len(rewards), generation_index=i, reward=r,
                          policy_version=(versions or [0] * len(rewards))[i]) for i, r in enumerate(rewards)]
    out = Outcome()
    for t in ts:
        out.extend(h.traj(t))
    return out.finished[0].group


def test_filters_in_order() -> None:
    config = StreamsConfig(max_policy_lag=2, min_reward_diff=0.1)
    stale_and_flat = finished_group([1.0, 1.0], versions=[3, 5])
    assert apply_filters(stale_and_flat, config, 6, {}, 0).reason == STALE  # 3 < 6 - 2
    assert apply_filters(stale_and_flat, config, 5, {}, 0).reason == ZERO_VARIANCE  # 3 == 5 - 2: not stale
    assert apply_filters(stale_and_flat, config, None, {}, 0).reason == ZERO_VARIANCE
    good = finished_group([0.0, 1.0])
    verdict = apply_filters(good, config, None, {}, 0)
    assert verdict.reason is None and verdict.group.curriculum is None


def test_under_a_gate_staleness_is_judged_against_the_serving_version_where_it_is_behind() -> None:
    config = StreamsConfig(max_policy_lag=2, min_reward_diff=0.0)
    sampled_at_3 = finished_group([0.0, 1.0], versions=[3, 3])
    assert apply_filters(sampled_at_3, config, 12, {}, 0).reason == STALE  # control: 3 < 12 - 2
    assert apply_filters(sampled_at_3, config, 12, {}, 0, serving_version=3).reason is None  # what serves
    assert apply_filters(sampled_at_3, config, 12, {}, 0, serving_version=6).reason == STALE  # 3 < 6 - 2
    verdict = apply_filters(sampled_at_3, config, 12, {}, 0, serving_version=20)  # serving ahead: the latest
    assert verdict.reason == STALE and "latest 12" in verdict.detail


def test_online_curriculum_filter_keeps_state_per_partition() -> None:
    config = StreamsConfig(curriculum=CurriculumConfig(enabled=True, initial_percentile=0.5), curriculum_window=4)
    store: dict[str, Any] = {}
    first = apply_filters(finished_group([0.0, 1.0], example="a"), config, 0, store, 0)
    assert first.reason is None and first.group.curriculum is not None and first.group.curriculum.rank == 0
    worse = apply_filters(finished_group([0.0, 0.2], example="b"), config, 0, store, 0)
    assert worse.reason == CURRICULUM
    other_partition = apply_filters(finished_group([0.0, 0.2], example="c"), config, 0, store, 1)
    assert other_partition.reason is None
    assert set(store) == {"curriculum:0:policy", "curriculum:1:policy"}


def test_online_curriculum_keeps_one_window_per_policy() -> None:
    """Two policies on one partition: a weak policy's groups are ranked among its own, not against the other's
    (in a shared window this group would be rejected, as the test above shows for one policy)."""
    config = StreamsConfig(curriculum=CurriculumConfig(enabled=True, initial_percentile=0.5), curriculum_window=4)
    store: dict[str, Any] = {}
    strong = finished_group([0.0, 1.0], example="a")
    assert apply_filters(strong, config, 0, store, 0).reason is None
    weak = finished_group([0.0, 0.2], example="b")
    weak = weak.model_copy(update={"policy": "weak-policy"})
    verdict = apply_filters(weak, config, 0, store, 0)
    assert verdict.reason is None and verdict.group.curriculum.rank == 0
    assert set(store) == {"curriculum:0:policy", "curriculum:0:weak-policy"}


def test_a_state_decoded_by_the_caller_gives_the_same_outcomes_as_one_read_from_the_store() -> None:
    """The app decodes a group's stored state once and hands it to the assembler (``stored``): every record then has
    the outcome, the stored state and the group record it has when the assembler reads the state itself."""
    ts = gen(4)
    own, handed = Harness(), Harness()
    closed_late = make_trajectory(example_id="ex", group_size=4, generation_index=3, reward=None)
    records: list[tuple[str, TrajectoryEvent, float]] = [("reward", ts[0], 1.0)] + [("traj", t, 0.0) for t in ts] + [
        ("reward", ts[1], 0.0), ("reward", ts[1], 0.25), ("reward", ts[2], 0.5), ("reward", ts[3], 0.5),
        ("traj", ts[2], 0.0), ("traj", closed_late, 0.0), ("reward", ts[0], 0.5)]
    for kind, t, r in records:
        outcomes = []
        for h, decoded in ((own, False), (handed, True)):
            data = h.groups.get(t.group_id)
            state = group_state_from_json(data) if decoded and data is not None else None
            h.offset += 1
            if kind == "traj":
                outcomes.append(h.asm.on_trajectory(t, CODEC.encode(t), t.example_id.encode(),
                                                    SourceRef(T, 0, h.offset), 0.0, 0.0, state))
            else:
                ev = make_reward(t, r)
                outcomes.append(h.asm.on_reward(ev, CODEC.encode(ev), t.example_id.encode(),
                                                SourceRef(R, 0, h.offset), 0.0, 0.0, state))
        a, b = outcomes
        assert a.counts == b.counts and a.rejects == b.rejects
        assert len(a.finished) == len(b.finished)
        for f, g in zip(a.finished, b.finished):  # (assembled_at is the clock's)
            assert f.header.model_dump(exclude={"assembled_at"}) == g.header.model_dump(exclude={"assembled_at"})
            assert [m.body(CODEC) for m in f.members] == [m.body(CODEC) for m in g.members]
        assert {k: v for k, v in own.groups.items()} == {k: v for k, v in handed.groups.items()}
    assert len(own.asm.groups) == 1 and own.groups[ts[0].group_id]["closed"]
