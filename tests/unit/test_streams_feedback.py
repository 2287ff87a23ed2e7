"""Feedback corrections in assembly: a reward repeating the feedback_id of the reward a trajectory holds replaces
it while the group is open (last write wins), is recorded on the dead letters and counted once the group has left,
and never trains twice; rewards without that feedback_id keep first-reward-wins."""
from __future__ import annotations

from typing import Any

import pytest

from rlstream.schemas.codec import HISTORY_DIR, AvroCodec
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from rlstream.streams import validation as v
from rlstream.streams.assembly import (AssemblyRules, ClosedGroup, GroupAssembler, OpenGroup, Outcome, SourceRef,
                                       group_state_from_json)
from tests.support.factories import make_reward, make_trajectory

CODEC = AvroCodec()
T, R = "p.trajectories", "p.rewards"


class Harness:
    def __init__(self) -> None:
        self.groups: dict[str, Any] = {}
        self.asm = GroupAssembler(self.groups, {}, CODEC, AssemblyRules(10.0, 2, 100.0))
        self.offset = 0

    def traj(self, t: TrajectoryEvent) -> Outcome:
        self.offset += 1
        return self.asm.on_trajectory(t, CODEC.encode(t), t.example_id.encode(), SourceRef(T, 0, self.offset), 0, 0)

    def reward(self, t: TrajectoryEvent, r: float, feedback_id: str | None = None,
               components: dict[str, float] | None = None) -> Outcome:
        self.offset += 1
        ev = make_reward(t, r).model_copy(update={"feedback_id": feedback_id, "components": components or {}})
        return self.asm.on_reward(ev, CODEC.encode(ev), t.example_id.encode(), SourceRef(R, 0, self.offset), 0, 0)


def pair() -> list[TrajectoryEvent]:
    return [make_trajectory(example_id="ex", group_size=2, generation_index=i, reward=None) for i in range(2)]


def test_a_correction_before_the_group_leaves_replaces_the_reward() -> None:
    h, (a, b) = Harness(), pair()
    h.traj(a); h.traj(b)  # noqa: E702
    assert h.reward(a, 0.0, "fa", {"thumbs": 0.0, "stars": 1.0}).counts["rewards_joined"] == 1
    corrected = h.reward(a, 1.0, "fa", {"thumbs": 1.0})
    assert corrected.counts["rewards_corrected"] == 1 and not corrected.finished and not corrected.rejects
    correcting_offset = h.offset
    out = h.reward(b, 0.0, "fb")
    group = out.finished[0].group
    member = {t.trajectory_id: t for t in group.trajectories}[a.trajectory_id]
    assert member.reward == 1.0 and member.reward_components == {"thumbs": 1.0}  # the correction's, all of them
    rewards_read = sorted(o.offset for o in group.source_offsets if o.topic == R)
    assert rewards_read == [correcting_offset, h.offset]  # lineage names the record that won


def test_a_correction_after_the_group_left_is_recorded_never_trained() -> None:
    h, (a, b) = Harness(), pair()
    h.traj(a); h.traj(b)  # noqa: E702
    h.reward(a, 0.0, "fa")
    assert len(h.reward(b, 1.0).finished) == 1
    late = h.reward(a, 1.0, "fa")
    assert not late.finished and late.counts["rewards_corrected_after_emit"] == 1
    assert [r.reason for r in late.rejects] == [v.CORRECTION_AFTER_EMIT]
    assert late.rejects[0].source == SourceRef(R, 0, h.offset) and late.rejects[0].value  # the record, kept
    again = h.reward(b, 0.0)  # b's reward had no feedback id: a repeat is a duplicate, as before
    assert again.counts["duplicate_reward"] == 1 and not again.rejects


def test_a_single_is_corrected_only_after_it_left() -> None:
    h = Harness()
    t = make_trajectory(example_id="ex", group_size=1, reward=None)
    h.traj(t)
    assert len(h.reward(t, 0.2, "f1").finished) == 1  # a single leaves at its first reward
    late = h.reward(t, 0.9, "f1")
    assert [r.reason for r in late.rejects] == [v.CORRECTION_AFTER_EMIT] and not late.finished


@pytest.mark.parametrize("first, second", [(None, "f2"), ("f1", "f2"), ("f1", None), (None, None)])
def test_other_feedback_keeps_first_reward_wins(first: str | None, second: str | None) -> None:
    h, (a, b) = Harness(), pair()
    h.traj(a); h.traj(b)  # noqa: E702
    h.reward(a, 0.3, first)
    dup = h.reward(a, 0.7, second)
    assert dup.counts["duplicate_reward"] == 1 and not dup.rejects
    out = h.reward(b, 0.0)
    assert {t.trajectory_id: t.reward for t in out.finished[0].group.trajectories}[a.trajectory_id] == 0.3
    after = h.reward(a, 0.9, second)
    assert after.counts["duplicate_reward"] == 1 and not after.rejects  # after it left: a duplicate, as before


def test_a_trajectory_with_its_own_reward_is_never_corrected_by_feedback() -> None:
    h = Harness()
    a, b = (make_trajectory(example_id="ex", group_size=2, generation_index=i, reward=0.5) for i in range(2))
    h.traj(a)
    assert h.reward(a, 1.0, "fa").counts["duplicate_reward"] == 1
    assert h.traj(b).finished[0].group.trajectories[0].reward == 0.5


def test_a_reward_held_before_its_trajectory_is_corrected_too() -> None:
    h, (a, b) = Harness(), pair()
    assert h.reward(a, 0.2, "fa").counts["rewards_held"] == 1
    assert h.reward(a, 0.7, "fa").counts["rewards_corrected"] == 1
    assert h.reward(a, 0.1, "other").counts["duplicate_reward"] == 1
    h.traj(a)
    out = h.traj(b)
    assert not out.finished
    out = h.reward(b, 0.0, "fb")
    assert {t.trajectory_id: t.reward for t in out.finished[0].group.trajectories}[a.trajectory_id] == 0.7
    # the feedback id travelled from the held reward to the member, then to the closed group
    closed = group_state_from_json(h.groups[a.group_id])
    assert isinstance(closed, ClosedGroup) and closed.feedback_ids == {a.trajectory_id: "fa", b.trajectory_id: "fb"}


def test_feedback_ids_survive_the_changelog_and_old_states_read() -> None:
    h, (a, b) = Harness(), pair()
    h.traj(a); h.traj(b)  # noqa: E702
    h.reward(a, 0.4, "fa", {"x": 1.0})
    stored = h.groups[a.group_id]
    assert stored["m"][a.trajectory_id]["fid"] == "fa" and stored["m"][a.trajectory_id]["fc"] == ["x"]
    state = group_state_from_json(stored)
    assert isinstance(state, OpenGroup) and state.to_json() == stored
    assert "fid" not in stored["m"][b.trajectory_id]  # a member without feedback keeps the earlier layout
    old_closed = {"g": "g1", "p": 0, "closed": True, "closed_at": 1.0, "ids": ["t1"]}
    closed = group_state_from_json(old_closed)
    assert isinstance(closed, ClosedGroup) and closed.feedback_ids == {} and closed.to_json() == old_closed


@pytest.mark.parametrize("feedback_id, ok", [("fb-1", True), ("", False), ("   ", False),
                                             ("x" * v.MAX_FEEDBACK_ID_CHARS, True),
                                             ("x" * (v.MAX_FEEDBACK_ID_CHARS + 1), False)])
def test_feedback_ids_are_bounded(feedback_id: str, ok: bool) -> None:
    event = make_reward(make_trajectory(reward=None), 0.5).model_copy(update={"feedback_id": feedback_id})
    invalid = v.validate_reward(event)
    assert (invalid is None) if ok else (invalid is not None and invalid.reason == v.BAD_FEEDBACK_ID)


def test_reward_events_written_before_feedback_ids_still_decode() -> None:
    import json

    old_schema = json.loads((HISTORY_DIR / "rlstream.v1.RewardEvent.1.json").read_text())
    assert all(f["name"] != "feedback_id" for f in old_schema["fields"])
    record = CODEC.decode_record(CODEC.encode(make_reward(make_trajectory(), 0.5)), RewardEvent.avro_name)
    record.pop("feedback_id")
    decoded = CODEC.decode(CODEC.encode_record(record, old_schema), RewardEvent)
    assert decoded.feedback_id is None and decoded.reward == 0.5
    event = make_reward(make_trajectory(), 0.5).model_copy(update={"feedback_id": "fb-7"})
    assert CODEC.decode(CODEC.encode(event), RewardEvent).feedback_id == "fb-7"
