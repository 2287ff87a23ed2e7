"""``rlstream up`` with the gate on takes its held-out curve from the gate's decisions (rlstream/ops/live.py,
rlstream/ops/evaluation.py) instead of evaluating every version a second time."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from rlstream.gate.evaluation import figures_of
from rlstream.gate.rules import SampleResult
from rlstream.ops.evaluation import VersionScore, score_from_gate
from rlstream.ops.live import LiveFigures, Watcher
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, PromotionDecision

pytestmark = pytest.mark.unit


def results(rewards: list[float], successes: list[float | None]) -> list[SampleResult]:
    return [SampleResult(key=f"e{i}#0", reward=r, parses=True, refusal=False, length=5, tool_calls=1,
                         tool_calls_parsed=1, success=s) for i, (r, s) in enumerate(zip(rewards, successes))]


def test_the_gate_figures_carry_task_success_only_where_every_sample_reports_it() -> None:
    measured = figures_of(3, results([1.0, 0.5, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0]))
    assert measured.task_success == 0.5
    assert measured.metrics()["task_success"] == 0.5
    partial = figures_of(3, results([1.0, 0.5], [1.0, None]))
    assert partial.task_success is None and "task_success" not in partial.metrics()  # no figure, not a 0


def test_a_decision_without_an_evaluation_gives_no_score() -> None:
    assert score_from_gate(2, "toy@2", {}, 0.0) is None  # a failed evaluation or an operator's decision
    assert score_from_gate(2, "toy@2", {"reward_mean": 0.0, "samples": 0.0}, 0.0) is None
    score = score_from_gate(2, "toy@2", {"reward_mean": 0.4, "samples": 48.0, "task_success": 0.25,
                                         "tool_call_parse_rate": 0.9, "answer_length": 7.0, "seconds": 3.0}, 1.0)
    assert score == VersionScore(2, "toy@2", 0.4, 48, 1.0, {"success": 0.25, "answer_tokens": 7.0})


def test_the_watcher_scores_both_sides_of_each_decision_once_in_version_order() -> None:
    figures = LiveFigures(heldout_from_gate=True)
    watcher = Watcher(RlstreamConfig(policy="toy"), None, figures)  # type: ignore[arg-type]
    at = datetime(2026, 11, 28, tzinfo=timezone.utc)

    def decision(version: int, kind: DecisionKind, serving: int | None, candidate: float,
                 serving_reward: float | None) -> PromotionDecision:
        return PromotionDecision(
            policy="toy", version=version, decision=kind, serving_before=serving, decided_at=at,
            candidate_metrics={"reward_mean": candidate, "samples": 48.0, "test.serving.reward.p_value": 0.01},
            serving_metrics={"reward_mean": serving_reward, "samples": 48.0} if serving_reward is not None else {})

    watcher._on_decision(decision(0, DecisionKind.promote, None, 0.2, None))
    watcher._on_decision(decision(4, DecisionKind.reject, 0, 0.3, 0.25))  # serving re-measured: the first stands
    watcher._on_decision(decision(3, DecisionKind.promote, 0, 0.5, 0.22))  # an older candidate decided later
    watcher._on_decision(PromotionDecision(policy="toy", version=5, decision=DecisionKind.reject,
                                           reason="rejected: evaluation failed"))  # no figures: no score
    watcher._on_decision(decision(9, DecisionKind.promote, 0, 0.9, 0.2).model_copy(update={"policy": "other"}))
    # a rollback to v1 carries the rolled-back canary's (v6) offline figures: they are v6's, not v1's
    rollback = decision(1, DecisionKind.rollback, None, 0.6, None)
    rollback.candidate_metrics["version"] = 6.0
    watcher._on_decision(rollback)
    assert [(s.version, s.reward_mean) for s in figures.heldout] == [(0, 0.2), (3, 0.5), (4, 0.3), (6, 0.6)]

    # control: without the flag (rlstream up evaluates itself) decisions add no score
    own = LiveFigures()
    Watcher(RlstreamConfig(policy="toy"), None, own)._on_decision(  # type: ignore[arg-type]
        decision(0, DecisionKind.promote, None, 0.2, None))
    assert own.heldout == [] and own.promotion.counts == {"promote": 1}
