"""The promotion rule (rlstream/gate/rules.py) and the feedback-to-serving clock (rlstream/gate/feedback.py)."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from rlstream.gate.feedback import FeedbackClock, OnlineRewards, TrainedTrajectory, percentile
from rlstream.gate.rules import EvalFigures, Tolerances, judge
from rlstream.schemas.models import RewardEvent, TrajectoryEvent

pytestmark = pytest.mark.unit

SERVING = EvalFigures(version=3, reward_mean=0.60, answer_parse_rate=0.95, tool_call_parse_rate=1.0,
                      refusal_rate=0.02, answer_length=8.0, samples=96)


def candidate(**changes: float) -> EvalFigures:
    base = dict(version=4, reward_mean=0.60, answer_parse_rate=0.95, tool_call_parse_rate=1.0, refusal_rate=0.02,
                answer_length=8.0, samples=96)
    return EvalFigures(**{**base, **changes})  # type: ignore[arg-type]


def test_not_worse_within_tolerance_is_promoted() -> None:
    verdict = judge(candidate(reward_mean=0.56, answer_parse_rate=0.91, refusal_rate=0.06, answer_length=15.9),
                    SERVING, Tolerances(reward_tolerance=0.05, rate_tolerance=0.05, length_tolerance=1.0))
    assert verdict.promote, verdict.reason


@pytest.mark.parametrize("changes, named", [
    ({"reward_mean": 0.54}, "reward 0.540 < serving v3 0.600"),
    ({"answer_parse_rate": 0.89}, "answers that parse 0.890"),
    ({"tool_call_parse_rate": 0.90}, "tool calls that parse 0.900"),
    ({"refusal_rate": 0.08}, "refusals 0.080"),
    ({"answer_length": 32.5}, "answer length 32.5"),
    ({"answer_length": 1.9}, "answer length 1.9"),
])
def test_worse_beyond_tolerance_is_rejected_with_the_figure(changes: dict[str, float], named: str) -> None:
    verdict = judge(candidate(**changes), SERVING, Tolerances())
    assert not verdict.promote
    assert named in verdict.reason


def test_every_failing_figure_is_named() -> None:
    verdict = judge(candidate(reward_mean=0.1, refusal_rate=0.5), SERVING, Tolerances())
    assert len(verdict.failures) == 2


def test_without_serving_figures_min_reward_decides() -> None:
    assert judge(candidate(reward_mean=0.2), None, Tolerances(min_reward=0.1)).promote
    verdict = judge(candidate(reward_mean=0.05), None, Tolerances(min_reward=0.1))
    assert not verdict.promote and "gate.min_reward" in verdict.reason
    assert not judge(candidate(samples=0), SERVING, Tolerances()).promote


def _reward(tid: str, value: float, at: float) -> RewardEvent:
    return RewardEvent(trajectory_id=tid, group_id="g", example_id="e", reward=value,
                       created_at=datetime.fromtimestamp(at, timezone.utc))


def test_feedback_to_serving_waits_for_a_version_at_or_above() -> None:
    clock = FeedbackClock()
    clock.on_reward(_reward("a", 1.0, 100.0))
    clock.on_reward(_reward("a", 0.0, 105.0))  # a correction: the first arrival counts
    clock.on_reward(_reward("b", 1.0, 110.0))
    clock.on_version(5, [TrainedTrajectory("a", None)])
    clock.on_version(6, [TrainedTrajectory("b", None), TrainedTrajectory("c", 112.0), TrainedTrajectory("x", None)])
    assert clock.on_serving(5, 130.0) == [30.0]  # version 6 does not serve yet
    assert sorted(clock.on_serving(7, 140.0)) == [28.0, 30.0]  # 7 trained on top of 6: b and c serve now
    assert clock.unresolved == 1  # x: production feedback never seen
    assert clock.on_serving(6, 150.0) == []  # a rollback or an older version adds nothing
    assert clock.quantiles() == (30.0, pytest.approx(30.0))
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


def test_online_rewards_join_and_corrections() -> None:
    since = datetime.fromtimestamp(1000.0, timezone.utc)
    online = OnlineRewards(canary_version=8, serving_version=7, since=since)

    def trajectory(tid: str, version: int, at: float = 1001.0, reward: float | None = None) -> TrajectoryEvent:
        return TrajectoryEvent(trajectory_id=tid, run_id="r", example_id="e", group_id=tid, group_size=1,
                               generation_index=0, policy="p", policy_version=version, messages=[], reward=reward,
                               created_at=datetime.fromtimestamp(at, timezone.utc))

    online.on_reward(_reward("early", 0.0, 1002.0))  # feedback before its trajectory is read
    online.on_trajectory(trajectory("early", 8), "p")
    online.on_trajectory(trajectory("s1", 7, reward=1.0), "p")
    online.on_trajectory(trajectory("old", 7, at=999.0, reward=0.0), "p")  # before the canary: not counted
    online.on_trajectory(trajectory("other", 6, reward=0.0), "p")  # neither arm
    online.on_trajectory(trajectory("c2", 8), "p")
    online.on_reward(_reward("c2", 0.0, 1003.0))
    online.on_reward(_reward("c2", 1.0, 1004.0))  # corrected
    assert (online.canary.count, online.canary.mean) == (2, 0.5)
    assert (online.serving.count, online.serving.mean) == (1, 1.0)


def test_rlstream_plot_marks_the_gate_moves() -> None:
    from rlstream.ops.plot import metrics_from_events
    from rlstream.schemas.models import MetricEvent
    from rlstream.transport import metric_names as mn

    events = [MetricEvent(source="learner", run_id="r", name=mn.REWARD_MEAN, value=0.5, step=v) for v in range(4)]
    events += [MetricEvent(source="gate", run_id="r", name=mn.GATE_DECISIONS, value=1.0, step=v,
                           tags={"decision": d}) for v, d in ((1, "promote"), (2, "reject"), (3, "rollback"))]
    metrics = metrics_from_events("r", events)
    assert metrics.decisions == [("promote", 1), ("reject", 2), ("rollback", 3)]
    assert [name for name, _ in metrics.series] == [mn.REWARD_MEAN]  # decisions are marks, not a series
