"""The promotion rule (rlstream/gate/rules.py) and the feedback-to-serving clock (rlstream/gate/feedback.py)."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from rlstream.gate.feedback import FeedbackClock, OnlineRewards, TrainedTrajectory, percentile
from rlstream.gate.rules import DecisionRule, EvalFigures, SampleResult, judge, next_anchor
from rlstream.schemas.models import RewardEvent, TrajectoryEvent, TrajectorySource

pytestmark = pytest.mark.unit

N = 60
#: A fixed, varied pattern of per-sample rewards (the prompts differ in difficulty).
BASE = [0.2 + 0.6 * ((i * 7) % 10) / 9 for i in range(N)]
#: A zero-mean disturbance per sample (a version's own sampling noise), std about 0.04.
NOISE = [0.05 * (1 if (i * 5) % 3 == 0 else -0.5) for i in range(N)]


def figures(version: int, shift: float = 0.0, noisy: bool = True, **changes: object) -> EvalFigures:
    """A version whose per-sample reward is BASE + shift (+ its own noise), with guards set by ``changes``."""
    parses = changes.get("parses", 1.0)
    refusals = changes.get("refusals", 0.0)
    length = int(changes.get("length", 8))  # type: ignore[call-overload]
    calls_ok = changes.get("calls_ok", 1.0)
    results = []
    for i in range(N):
        noise = NOISE[(i + version) % N] if noisy else 0.0
        results.append(SampleResult(
            key=f"{i}#0", reward=min(1.0, max(0.0, BASE[i] + shift + noise)),
            parses=i < N * float(parses),  # type: ignore[arg-type]
            refusal=i < N * float(refusals), length=length,  # type: ignore[arg-type]
            tool_calls=1, tool_calls_parsed=int(i < N * float(calls_ok))))  # type: ignore[arg-type]
    mean = sum(r.reward for r in results) / N
    return EvalFigures(version=version, reward_mean=mean, answer_parse_rate=float(parses),  # type: ignore[arg-type]
                       tool_call_parse_rate=float(calls_ok), refusal_rate=float(refusals),  # type: ignore[arg-type]
                       answer_length=float(length), samples=N, tool_calls=N, results=tuple(results))


RULE = DecisionRule(margin=0.1, alpha=0.025)
SERVING = figures(3)


def test_an_equal_or_slightly_worse_candidate_passes_every_test_and_records_the_evidence() -> None:
    verdict = judge(figures(4, shift=-0.03), SERVING, RULE)
    assert verdict.promote, verdict.reason
    reward = verdict.test("reward", "serving")
    assert reward is not None and reward.n == N and reward.mean_difference == pytest.approx(-0.03, abs=0.02)
    evidence = verdict.evidence()
    for name in ("mean_difference", "std", "n", "statistic", "p_value", "lower_bound", "margin", "alpha"):
        assert f"test.serving.reward.{name}" in evidence
    assert evidence["test.serving.reward.margin"] == 0.1 and evidence["test.serving.reward.alpha"] == 0.025
    assert "non-inferior to serving v3" in verdict.reason


@pytest.mark.parametrize("changes, named", [
    ({"shift": -0.15}, "reward vs serving v3: mean difference -0.1"),
    ({"parses": 0.8}, "answers_parse vs serving v3"),
    ({"calls_ok": 0.8}, "tool_calls_parse vs serving v3"),
    ({"refusals": 0.2}, "refusals vs serving v3"),
    ({"length": 40}, "length_not_longer vs serving v3"),
    ({"length": 1}, "length_not_shorter vs serving v3"),
])
def test_worse_beyond_a_margin_is_rejected_with_the_test_figures(changes: dict[str, float], named: str) -> None:
    verdict = judge(figures(4, **changes), SERVING, RULE)  # type: ignore[arg-type]
    assert not verdict.promote
    assert named in verdict.reason, verdict.reason
    assert "lower bound" in verdict.reason and "alpha 0.025" in verdict.reason


def test_task_success_is_a_guard_where_both_versions_report_it() -> None:
    def with_success(f: EvalFigures, rate: float | None) -> EvalFigures:
        results = tuple(SampleResult(**{**r.__dict__, "success": None if rate is None else float(i < N * rate)})
                        for i, r in enumerate(f.results))
        return EvalFigures(**{**f.__dict__, "results": results})

    serving = with_success(SERVING, 0.8)
    verdict = judge(with_success(figures(4), 0.6), serving, RULE)  # same reward, success 0.2 lower
    assert not verdict.promote and verdict.failures[0].startswith("task_success vs serving v3")
    assert judge(with_success(figures(4), 0.8), serving, RULE).promote
    unreported = judge(with_success(figures(4), None), serving, RULE)  # only one side reports it: no test
    assert unreported.promote and unreported.test("task_success", "serving") is None


def test_every_failing_test_is_named() -> None:
    verdict = judge(figures(4, shift=-0.3, refusals=0.3), SERVING, RULE)
    assert [f.split(" vs ")[0] for f in verdict.failures] == ["reward", "refusals"]


def test_without_serving_figures_min_reward_decides() -> None:
    assert judge(figures(4), None, DecisionRule(min_reward=0.1)).promote
    verdict = judge(figures(4, shift=-1.0), None, DecisionRule(min_reward=0.1))
    assert not verdict.promote and "gate.min_reward" in verdict.reason
    empty = EvalFigures(version=4, reward_mean=0.0, answer_parse_rate=0.0, tool_call_parse_rate=0.0,
                        refusal_rate=0.0, answer_length=0.0, samples=0)
    assert not judge(empty, SERVING, RULE).promote


def test_figures_without_per_sample_results_cannot_pass() -> None:
    bare = EvalFigures(version=4, reward_mean=0.9, answer_parse_rate=1.0, tool_call_parse_rate=1.0,
                       refusal_rate=0.0, answer_length=8.0, samples=N)
    verdict = judge(bare, SERVING, RULE)
    assert not verdict.promote and "too few to test" in verdict.reason


def test_the_anchor_rejects_what_serving_would_let_through() -> None:
    anchor = figures(1, shift=0.12)
    candidate = figures(4, shift=-0.03)  # within the margin of serving, 0.15 below the anchor
    assert judge(candidate, SERVING, RULE).promote
    verdict = judge(candidate, SERVING, RULE, anchor)
    assert not verdict.promote
    assert verdict.failures == [f for f in verdict.failures if f.startswith("reward vs anchor v1")]
    assert "test.anchor.reward.lower_bound" in verdict.evidence()
    same = judge(candidate, SERVING, RULE, SERVING)  # the anchor serves: one test, not two
    assert same.promote and same.test("reward", "anchor") is None


def test_the_anchor_moves_only_to_a_candidate_shown_better() -> None:
    better = judge(figures(4, shift=0.1), SERVING, RULE)
    assert next_anchor(better, 4, 3) == 4
    equal = judge(figures(4), SERVING, RULE)
    assert equal.promote and next_anchor(equal, 4, 3) == 3
    assert next_anchor(equal, 4, 0) == 0  # the base weights stay the anchor
    rejected = judge(figures(4, shift=-0.3), SERVING, RULE)
    assert next_anchor(rejected, 4, 3) == 3
    assert next_anchor(judge(figures(4), None, RULE), 4, None) == 4  # the first promotion


def _point_rule(candidate: EvalFigures, serving: EvalFigures, tolerance: float = 0.05) -> bool:
    """The rule the gate had before its tests: a point comparison of the means."""
    return candidate.reward_mean >= serving.reward_mean - tolerance


def test_a_chain_of_small_losses_cannot_ratchet_serving_down() -> None:
    """Ten candidates, each 0.04 (less than half the margin) worse than the version serving at its decision."""
    def run(decide: object) -> float:
        serving, anchor, loss = figures(0), figures(0), 0.0
        for k in range(1, 11):
            candidate = figures(k, shift=-0.04 * k)
            promoted, becomes_anchor = decide(candidate, serving, anchor)  # type: ignore[operator]
            if promoted:
                if becomes_anchor:
                    anchor = candidate
                serving, loss = candidate, 0.04 * k
        return loss

    def new_rule(candidate: EvalFigures, serving: EvalFigures, anchor: EvalFigures) -> tuple[bool, bool]:
        verdict = judge(candidate, serving, RULE, anchor)
        return verdict.promote, next_anchor(verdict, candidate.version, anchor.version) == candidate.version

    def old_rule(candidate: EvalFigures, serving: EvalFigures, anchor: EvalFigures) -> tuple[bool, bool]:
        return _point_rule(candidate, serving), False

    assert run(old_rule) == pytest.approx(0.4)  # negative control: every candidate promoted
    assert run(new_rule) <= RULE.margin


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
    held_out = trajectory("gate-answer", 8, reward=0.0).model_copy(update={"source": TrajectorySource.validation})
    online.on_trajectory(held_out, "p")  # the gate's held-out answers are not online traffic
    online.on_trajectory(held_out.model_copy(update={"trajectory_id": "c3", "source": TrajectorySource.production,
                                                     "reward": 1.0}), "p")  # control: the same as traffic counts
    assert (online.canary.count, online.canary.mean) == (3, 2 / 3)
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
