"""The console's version timeline from the gate's decision records: each stage at the version it concerns."""
from __future__ import annotations

import pytest

from rlstream.ops.console.state import ConsoleState
from rlstream.schemas.models import DecisionKind, PromotionDecision

pytestmark = pytest.mark.unit


def decision(kind: DecisionKind, version: int, serving_before: int, **figures: float) -> PromotionDecision:
    return PromotionDecision(policy="p", version=version, decision=kind, reason=f"{kind.value} v{version}",
                             serving_before=serving_before, candidate_metrics=figures)


def test_canary_finish_and_rollback_stages() -> None:
    state = ConsoleState(policy="p", run_id="r")
    state.on_decision(decision(DecisionKind.canary, 1, 0, reward_mean=0.6, samples=8))
    assert state.versions[1].status == "canary" and state.versions[1].heldout["reward_mean"] == 0.6
    state.on_decision(decision(DecisionKind.finish_canary, 1, 0, canary_version=1.0))
    assert state.versions[1].status == "promoted"
    state.on_decision(decision(DecisionKind.canary, 2, 1, reward_mean=0.7))
    # the canary's rollback names the version production went back to; the canary is marked rolled back
    state.on_decision(decision(DecisionKind.rollback, 1, 1, canary_version=2.0))
    assert state.versions[2].status == "rolled back"
    assert state.versions[1].status == "serving (rollback)"
    # an operator's rollback from v3 to v1 marks v3
    state.on_decision(decision(DecisionKind.rollback, 1, 3))
    assert state.versions[3].status == "rolled back"
    assert [d["decision"] for d in state.overview()["decisions"]] == ["canary", "finish_canary", "canary", "rollback",
                                                                     "rollback"]
