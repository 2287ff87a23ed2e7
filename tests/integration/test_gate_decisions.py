"""Offline decisions of the gate on the real broker and Redis: every decision measures the candidate, the serving
version and the anchor again (nothing is kept between decisions), the anchor stops a chain of small losses and
survives a gate restart (on the serving pointer), an evaluation that fails decides nothing, and each decision's
test figures are on ``promotions``. The held-out evaluation itself is scripted per version (``evaluate_version`` is
the one function replaced: each version's per-sample results are fixed), the fleet is one replica acknowledging
every version."""
from __future__ import annotations

import asyncio

import pytest

from rlstream.gate import service as gate_service
from rlstream.gate.evaluation import EvaluationFailed, EvaluationSet
from rlstream.gate.rules import DecisionRule, EvalFigures, SampleResult, judge
from rlstream.gate.service import PromotionGate
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, MetricEvent, PolicyVersion, PromotionDecision
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.serving import ReplicaAck, ServingControl
from tests.support.gate_helpers import serving_fleet
from tests.support.learner_helpers import read_whole_topic

pytestmark = pytest.mark.integration
CODEC = AvroCodec()
EXAMPLES = 20
#: Each version's mean reward below version 1 (per sample: a fixed pattern minus this, plus the version's own noise).
LOSS = {1: 0.0, 2: 0.04, 3: 0.08, 4: 0.12}


def scripted_figures(version: int, evaluation: EvaluationSet) -> EvalFigures:
    results = []
    for e, example in enumerate(evaluation.examples):
        for s in range(evaluation.samples):
            i = e * evaluation.samples + s
            noise = 0.02 * (1 if (i + version) % 2 else -1)
            reward = 0.3 + 0.4 * ((i * 7) % 5) / 4 - LOSS.get(version, 0.0) + noise
            results.append(SampleResult(key=f"{example['id']}#{s}", reward=reward, parses=True, refusal=False,
                                        length=6, tool_calls=0, tool_calls_parsed=0))
    n = len(results)
    return EvalFigures(version=version, reward_mean=sum(r.reward for r in results) / n, answer_parse_rate=1.0,
                       tool_call_parse_rate=1.0, refusal_rate=0.0, answer_length=6.0, samples=n,
                       results=tuple(results))


class ScriptedEvaluation:
    """Stands in for ``evaluate_version``: the scripted figures, every call counted; ``fail`` versions raise
    EvaluationFailed once each."""

    def __init__(self, fail: set[int] | None = None) -> None:
        self.calls: list[int] = []
        self.fail = set(fail or ())

    async def __call__(self, evaluation: EvaluationSet, version: int, base_url: str, model: str,
                       api_key: str | None = None, on_request_failure: object = None) -> EvalFigures:
        self.calls.append(version)
        if version in self.fail:
            self.fail.discard(version)
            raise EvaluationFailed(f"version {version}: connection error (scripted)")
        return scripted_figures(version, evaluation)


def gate_config(rl_config: RlstreamConfig) -> RlstreamConfig:
    return rl_config.model_copy(update={"gate": rl_config.gate.model_copy(update={
        "canary_share": 0.0, "load_timeout_s": 10.0, "margin": 0.1, "alpha": 0.025, "examples": EXAMPLES,
        "samples": 2})})


async def start_gate(cfg: RlstreamConfig, control: ControlPlane) -> PromotionGate:
    evaluation = EvaluationSet(examples=[{"id": str(i), "prompt": f"q{i}"} for i in range(EXAMPLES)],
                               reward_function=lambda e, t: 0.0, samples=2)
    gate = PromotionGate(cfg, control, evaluation, codec=CODEC)
    await gate._start()
    return gate


def announce(gate: PromotionGate, version: int) -> None:
    gate.known[version] = PolicyVersion(policy=gate.policy, version=version, base_model="m", uri=f"/v{version}",
                                        learner_step=version)


async def setup_fleet(cfg: RlstreamConfig, control: ControlPlane) -> ServingControl:
    """Serving v1, one replica acknowledging versions 1-4."""
    return await serving_fleet(cfg, control, LOSS, url="http://127.0.0.1:9")


def test_each_decision_measures_serving_and_the_anchor_again_and_the_anchor_stops_a_chain(
        rl_config: RlstreamConfig, created_topics: TopicNames, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = gate_config(rl_config)
    scripted = ScriptedEvaluation()
    monkeypatch.setattr(gate_service, "evaluate_version", scripted)
    monkeypatch.setattr(gate_service, "ERROR_BACKOFF_S", 0.0)

    async def scenario() -> tuple[list[PromotionDecision], int | None, int | None]:
        control = ControlPlane(str(cfg.redis.url))
        serving = await setup_fleet(cfg, control)
        gate = await start_gate(cfg, control)
        try:
            for version in (2, 3):  # each 0.04 below the version before: within the margin of serving and anchor
                announce(gate, version)
                await gate.step()
            announce(gate, 4)  # 0.04 below serving v3, 0.12 below the anchor v1
            await gate.step()
        finally:
            await gate._stop()
        pointer = await serving.serving(cfg.policy)
        restarted = await start_gate(cfg, control)  # a restarted gate knows the anchor
        await restarted._stop()
        await control.close()
        return gate.decisions, pointer.anchor_version if pointer else None, restarted.anchor

    decided, pointer_anchor, restarted_anchor = asyncio.run(scenario())
    assert [(d.version, d.decision) for d in decided] == [
        (2, DecisionKind.promote), (3, DecisionKind.promote), (4, DecisionKind.reject)], [d.reason for d in decided]
    rejected = decided[-1]
    assert "reward vs anchor v1: mean difference -0.12" in rejected.reason, rejected.reason
    assert "vs serving" not in rejected.reason  # within the margin of serving v3
    # control: against serving alone (what the gate had without the anchor) version 4 passes
    evaluation = EvaluationSet(examples=[{"id": str(i)} for i in range(EXAMPLES)], reward_function=lambda e, t: 0.0,
                               samples=2)
    assert judge(scripted_figures(4, evaluation), scripted_figures(3, evaluation), DecisionRule(0.1, 0.025)).promote
    # measured fresh: version 1 as serving (decision 1) and as the anchor (decisions 2, 3); version 2 as candidate
    # and as serving; nothing kept
    assert scripted.calls == [2, 1, 3, 2, 1, 4, 3, 1], scripted.calls
    metrics = rejected.candidate_metrics
    for name in ("mean_difference", "std", "n", "statistic", "p_value", "lower_bound", "margin", "alpha"):
        assert f"test.anchor.reward.{name}" in metrics and f"test.serving.reward.{name}" in metrics
    assert metrics["test.anchor.reward.n"] == EXAMPLES * 2 and metrics["test.anchor.reward.passed"] == 0.0
    assert metrics["anchor_version"] == 1 and metrics["plan.examples"] == EXAMPLES and metrics["plan.samples"] == 2
    assert pointer_anchor == 1 and restarted_anchor == 1
    recorded = asyncio.run(read_whole_topic(cfg, created_topics.promotions, PromotionDecision))
    gate_records = [d for d in recorded if d.decided_by == "gate"]
    assert [d.version for d in gate_records] == [2, 3, 4]
    assert all("test.serving.reward.lower_bound" in d.candidate_metrics for d in gate_records)


def test_an_evaluation_that_fails_decides_nothing(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = gate_config(rl_config)
    scripted = ScriptedEvaluation(fail={2})  # the candidate's evaluation fails once
    monkeypatch.setattr(gate_service, "evaluate_version", scripted)
    monkeypatch.setattr(gate_service, "ERROR_BACKOFF_S", 0.0)

    async def scenario() -> tuple[list[PromotionDecision], list[PromotionDecision]]:
        control = ControlPlane(str(cfg.redis.url))
        await setup_fleet(cfg, control)
        gate = await start_gate(cfg, control)
        try:
            announce(gate, 2)
            await gate.step()
            after_failure = list(gate.decisions)
            await gate.step()  # tried again
        finally:
            await gate._stop()
            await control.close()
        return after_failure, gate.decisions

    after_failure, decided = asyncio.run(scenario())
    assert after_failure == []  # no promotion, no rejection
    assert [(d.version, d.decision) for d in decided] == [(2, DecisionKind.promote)], [d.reason for d in decided]
    assert scripted.calls == [2, 2, 1]
    metrics = asyncio.run(read_whole_topic(cfg, created_topics.metrics, MetricEvent))
    failures = [m for m in metrics if m.name == mn.GATE_EVALUATION_FAILURES]
    assert [(m.step, m.tags.get("role")) for m in failures] == [(2, "candidate")]
    # control: the failed evaluation scored as a result (every answer 0) would have rejected version 2
    evaluation = EvaluationSet(examples=[{"id": str(i)} for i in range(EXAMPLES)], reward_function=lambda e, t: 0.0,
                               samples=2)
    serving = scripted_figures(1, evaluation)
    zeros = EvalFigures(version=2, reward_mean=0.0, answer_parse_rate=0.0, tool_call_parse_rate=0.0, refusal_rate=0.0,
                        answer_length=0.0, samples=serving.samples, results=tuple(
                            SampleResult(key=r.key, reward=0.0, parses=False, refusal=False, length=0)
                            for r in serving.results))
    assert not judge(zeros, serving, DecisionRule(0.1, 0.025)).promote


def test_an_anchor_no_replica_holds_is_judged_on_its_latest_measurement(
        rl_config: RlstreamConfig, created_topics: TopicNames, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full weights: once serving moved on, no replica holds the anchor (the serve replica holds serving, the
    evaluation replica the candidate); the gate judges against the anchor's latest measurement instead of waiting
    for it forever. Control: a restarted gate, which never measured the anchor, takes the serving version as anchor."""
    cfg = gate_config(rl_config)
    scripted = ScriptedEvaluation()
    monkeypatch.setattr(gate_service, "evaluate_version", scripted)
    monkeypatch.setattr(gate_service, "ERROR_BACKOFF_S", 0.0)

    async def scenario() -> tuple[list[PromotionDecision], list[PromotionDecision]]:
        control = ControlPlane(str(cfg.redis.url))
        serving = await setup_fleet(cfg, control)
        gate = await start_gate(cfg, control)
        try:
            announce(gate, 2)
            await gate.step()  # v2 promoted; v1 stays the anchor
            await serving.record_replica(cfg.policy, ReplicaAck("w0", 4, f"{cfg.policy}-v4", url="http://127.0.0.1:9",
                                                                loaded={2: f"{cfg.policy}-v2",
                                                                        4: f"{cfg.policy}-v4"}), 120.0)
            announce(gate, 4)  # 0.08 below serving v2, 0.12 below the anchor v1 that no replica holds now
            await gate.step()
        finally:
            await gate._stop()
        restarted = await start_gate(cfg, control)
        try:
            announce(restarted, 4)
            restarted.decided = 2
            await restarted.step()
        finally:
            await restarted._stop()
            await control.close()
        return gate.decisions, restarted.decisions

    decided, after_restart = asyncio.run(scenario())
    assert [(d.version, d.decision) for d in decided] == [(2, DecisionKind.promote), (4, DecisionKind.reject)]
    rejected = decided[-1]
    assert "reward vs anchor v1" in rejected.reason and "vs serving" not in rejected.reason, rejected.reason
    assert rejected.candidate_metrics["anchor_fresh"] == 0.0 and rejected.candidate_metrics["anchor_version"] == 1
    assert scripted.calls[:4] == [2, 1, 4, 2]  # v1 not measured for the second decision
    assert [(d.version, d.decision) for d in after_restart] == [(4, DecisionKind.promote)]  # the control
    assert after_restart[0].candidate_metrics["anchor_version"] == 2


def test_a_candidate_trimmed_the_moment_its_hold_ends_keeps_its_figures(
        rl_config: RlstreamConfig, created_topics: TopicNames, monkeypatch: pytest.MonkeyPatch) -> None:
    # a serve replica keeps inference.keep_adapters LoRA versions: one it held for the gate goes as soon as the hold
    # ends, so whether the version stayed loaded through the evaluation is asked while the hold stands
    import contextlib

    base = gate_config(rl_config)
    monkeypatch.setattr(gate_service, "evaluate_version", ScriptedEvaluation())

    async def scenario(trim_before_release: bool) -> EvalFigures | None:
        cfg = base.model_copy(update={"policy": f"{base.policy}-{int(trim_before_release)}"})
        control = ControlPlane(str(cfg.redis.url))
        serving = await setup_fleet(cfg, control)
        gate = await start_gate(cfg, control)
        held = gate.serving.held_for_evaluation

        @contextlib.asynccontextmanager
        async def trimmed_at_release(policy: str, worker_id: str, version: int, ttl_s: float):  # type: ignore[no-untyped-def]
            async with held(policy, worker_id, version, ttl_s):
                if trim_before_release:  # control: replaced while held (a full reload), figures dropped
                    await trim(version)
                yield
            await trim(version)  # what the sync worker does once the hold is gone

        async def trim(version: int) -> None:
            await serving.record_replica(cfg.policy, ReplicaAck(
                "w0", 4, f"{cfg.policy}-v4", url="http://127.0.0.1:9",
                loaded={v: f"{cfg.policy}-v{v}" for v in LOSS if v != version}), 120.0)

        monkeypatch.setattr(gate.serving, "held_for_evaluation", trimmed_at_release)
        try:
            return await gate.measure(2, gate.evaluation, "candidate")
        finally:
            await gate._stop()
            await control.close()

    measured = asyncio.run(scenario(trim_before_release=False))
    assert measured is not None and measured.version == 2
    assert asyncio.run(scenario(trim_before_release=True)) is None
