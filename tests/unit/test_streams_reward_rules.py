"""The operator's reward rule in group assembly (pure functions over dict stores): named scores combined with their
weights once all are in or their window ended, corrections inside a single's correction window, and the old rule
(first reward wins) when no score is named."""
from __future__ import annotations

from typing import Any

import pytest

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from rlstream.streams import validation as v
from rlstream.streams.assembly import AssemblyRules, GroupAssembler, Outcome, SourceRef
from rlstream.streams.reward_rules import RewardRules, combined
from tests.support.factories import make_reward, make_trajectory

pytestmark = pytest.mark.unit
CODEC = AvroCodec()
WEIGHTS = {"helpfulness": 0.75, "correctness": 0.25}


class Harness:
    def __init__(self, rules: RewardRules) -> None:
        self.groups: dict[str, Any] = {}
        self.asm = GroupAssembler(self.groups, {}, CODEC, AssemblyRules(10.0, 1, 100.0, single_timeout_s=1000.0,
                                                                        reward=rules))
        self.offset = 0

    def traj(self, t: TrajectoryEvent, now: float) -> Outcome:
        self.offset += 1
        return self.asm.on_trajectory(t, CODEC.encode(t), b"k", SourceRef("t", 0, self.offset), now, now)

    def score(self, t: TrajectoryEvent, name: str, value: float, now: float, fid: str | None = None) -> Outcome:
        self.offset += 1
        ev: RewardEvent = make_reward(t, value).model_copy(update={"components": {name: value}, "feedback_id": fid})
        return self.asm.on_reward(ev, CODEC.encode(ev), b"k", SourceRef("r", 0, self.offset), now, now)

    def tick(self, now: float) -> Outcome:
        return self.asm.on_tick(0, now)


def single() -> TrajectoryEvent:
    return make_trajectory(group_size=1, reward=None)


def test_two_named_scores_combine_with_their_weights_and_other_scores_stay_components() -> None:
    h, t = Harness(RewardRules(scores=WEIGHTS, score_window_s=30.0)), single()
    h.traj(t, now=t.created_at.timestamp())
    now = t.created_at.timestamp()
    assert not h.score(t, "helpfulness", 1.0, now).finished
    assert not h.score(t, "tone", -1.0, now + 1).finished  # not named: a component only
    out = h.score(t, "correctness", 0.2, now + 2)
    [member] = out.finished[0].members
    assert member.reward == pytest.approx(0.75 * 1.0 + 0.25 * 0.2)
    assert member.reward_components == {"helpfulness": 1.0, "tone": -1.0, "correctness": 0.2}


def test_the_window_ends_with_the_named_scores_present() -> None:
    h, t = Harness(RewardRules(scores=WEIGHTS, score_window_s=30.0)), single()
    now = t.created_at.timestamp()
    h.traj(t, now)
    assert not h.score(t, "helpfulness", 0.4, now).finished
    assert not h.tick(now + 29).finished
    out = h.tick(now + 31)
    assert [m.reward for m in out.finished[0].members] == [pytest.approx(0.4)]


def test_a_correction_inside_the_window_replaces_the_score_and_one_after_it_is_dead_lettered() -> None:
    h, t = Harness(RewardRules(scores={"thumbs": 1.0}, score_window_s=0.0, correction_window_s=60.0,
                               correction_grace_s=5.0)), single()
    now = t.created_at.timestamp()
    h.traj(t, now)
    assert not h.score(t, "thumbs", 0.0, now + 1, fid="fb-1").finished  # held for the correction window
    assert not h.score(t, "thumbs", 1.0, now + 50, fid="fb-1").finished  # the correction replaces it
    assert not h.tick(now + 64).finished
    out = h.tick(now + 66)
    assert [m.reward for m in out.finished[0].members] == [1.0]
    late = h.score(t, "thumbs", 0.5, now + 70, fid="fb-1")
    assert [r.reason for r in late.rejects] == [v.CORRECTION_AFTER_EMIT]


def test_without_named_scores_the_first_reward_wins() -> None:
    h, t = Harness(RewardRules()), single()
    now = t.created_at.timestamp()
    h.traj(t, now)
    out = h.score(t, "helpfulness", 1.0, now)
    assert [m.reward for m in out.finished[0].members] == [1.0]  # left at its first score
    assert h.score(t, "correctness", 0.2, now + 1).counts["duplicate_reward"] == 1


def test_combined_is_the_weighted_mean_of_the_named_scores_present() -> None:
    rules = RewardRules(scores=WEIGHTS)
    assert combined(rules, {"helpfulness": [1.0, None], "correctness": [0.0, None]}) == pytest.approx(0.75)
    assert combined(rules, {"correctness": [0.2, None]}) == pytest.approx(0.2)
    assert combined(rules, {"tone": [1.0, None]}) is None
