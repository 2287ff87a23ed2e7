"""``rlstream console`` in a real browser: Debian's chromium, driven by Playwright, opens the console of a stack whose
topics hold real trajectories, groups, gate decisions, feedback and dead letters (written by the project's own
publishers and decision writers on the session's broker and Redis), and checks what a person sees; a second test opens
it on a stack where the promotion gate itself decided (a promotion and a rejection) on answers the tool agent's
episode produced. The screenshots are kept under the test's tmp dir (and copied to ``$RLSTREAM_ARTIFACTS_DIR`` when
set; docs/console.png is one)."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import pytest

from rlstream.gate.evaluation import EvaluationSet, figures_of
from rlstream.gate.rules import DecisionRule, SampleResult, judge
from rlstream.gate.service import PromotionGate
from rlstream.ops.tool_task import gate_episode, tool_reward
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.codec import codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import (DecisionKind, GroupCompletion, Message, PolicyVersion, PromotionDecision,
                                     RewardEvent, ToolCall, TrajectoryEvent, TrajectoryGroup, TrajectorySource, Turn)
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.kafka import make_producer
from rlstream.transport.control import ControlPlane
from rlstream.transport.metrics import MetricsPublisher
from rlstream.transport.serving import ReplicaAck, ServingControl, publish_decision
from rlstream.transport.topic_reader import SourceRecord
from tests.support.browser import chromium_page, keep_screenshot, served_console
from tests.support.scripted_upstream import Reply, scripted_upstream
from tests.support.version_helpers import announce_versions
from tests.unit.test_gate_episodes import HELDOUT, guesser, tool_caller

pytestmark = pytest.mark.integration

HELDOUT_EXAMPLE = "heldout-weather-1"


def tool_trajectory(cfg: RlstreamConfig, version: int, index: int, reward: float, city: str,
                    source: TrajectorySource = TrajectorySource.rollout,
                    example_id: str = HELDOUT_EXAMPLE) -> TrajectoryEvent:
    """An agent run with one tool call, its result and the final answer; one turn with token logprobs."""
    call = ToolCall(id=f"call-{version}-{index}", name="get_weather", arguments=f'{{"city": "{city}"}}')
    return TrajectoryEvent(
        run_id=cfg.run_id, example_id=example_id, group_id=f"g-{version}-{example_id}", group_size=2,
        generation_index=index, policy=cfg.policy, policy_version=version, source=source,
        messages=[Message(role="user", content=f"What is the weather in {city}?"),
                  Message(role="assistant", content=None, tool_calls=[call]),
                  Message(role="tool", content=f"{city}: 18°C, light rain", tool_call_id=call.id),
                  Message(role="assistant", content=f"It is 18°C with light rain in {city} (v{version}).")],
        turns=[Turn(message_index=1, completion_token_ids=[101, 202, 303, 404],
                    completion_logprobs=[-0.01, -2.3, -0.2, -4.0])],
        reward=reward, reward_components={"success": reward, "tool_call_parsed": 1.0})


def evaluation(version: int, rewards: list[float]) -> list[SampleResult]:
    return [SampleResult(key=f"e{i}#0", reward=r, parses=True, refusal=False, length=12, tool_calls=1,
                         tool_calls_parsed=1, success=r) for i, r in enumerate(rewards)]


async def seed_stack(cfg: RlstreamConfig) -> None:
    """Versions 1-3 announced by a fenced learner; trajectories (held-out and training), a group, the gate's
    decisions (v1, v2 promoted, v3 rejected by the paired test), feedback and a dead letter."""
    names = TopicNames.from_config(cfg.topics)
    await announce_versions(cfg, [PolicyVersion(policy=cfg.policy, version=v, base_model="tiny", uri=f"file:///w/v{v}",
                                                learner_step=10 * v, group_count=4 * v, run_id=cfg.run_id)
                                  for v in (1, 2, 3)])
    codec = codec_for(cfg)
    async with TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards, codec=codec) as publisher:
        for version in (0, 1, 2, 3):
            await publisher.publish_trajectory(tool_trajectory(cfg, version, 0, 0.25 * version, "Paris",
                                                               TrajectorySource.validation))
        for i in range(3):
            await publisher.publish_reward(RewardEvent(trajectory_id=f"t{i}", group_id="g", example_id="e",
                                                       run_id=cfg.run_id, reward=1.0, feedback_id=f"f{i % 2}"))
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        group_members = [tool_trajectory(cfg, 2, i, r, "Oslo", example_id="train-7") for i, r in enumerate((1.0, 0.0))]
        group = TrajectoryGroup(group_id="g-2-train-7", run_id=cfg.run_id, example_id="train-7", policy=cfg.policy,
                                min_policy_version=2, max_policy_version=2, expected_size=2,
                                trajectories=group_members, reward_mean=0.5, reward_std=0.5, reward_min=0.0,
                                reward_max=1.0, completion=GroupCompletion.full)
        await producer.send_and_wait(names.groups, codec.encode(group), key=group.example_id.encode())

        rule = DecisionRule()
        base = figures_of(0, evaluation(0, [0.2, 0.3, 0.2, 0.3]))
        v1 = figures_of(1, evaluation(1, [0.5, 0.6, 0.5, 0.6]))
        v2 = figures_of(2, evaluation(2, [0.7, 0.8, 0.7, 0.8]))
        v3 = figures_of(3, evaluation(3, [0.0, 0.1, 0.0, 0.1]))
        decisions = []
        for candidate, serving in ((v1, base), (v2, v1), (v3, v2)):
            verdict = judge(candidate, serving, rule)
            kind = DecisionKind.promote if verdict.promote else DecisionKind.reject
            decisions.append(PromotionDecision(
                policy=cfg.policy, version=candidate.version, decision=kind,
                reason=f"{'promoted' if verdict.promote else 'rejected'}: {verdict.reason}",
                serving_before=serving.version, candidate_metrics={**candidate.metrics(), **verdict.evidence()},
                serving_metrics=serving.metrics(), decided_by="gate"))
        assert [d.decision for d in decisions] == [DecisionKind.promote, DecisionKind.promote, DecisionKind.reject]
        for decision in decisions:
            await publish_decision(producer, codec, names.promotions, decision)

        metrics = MetricsPublisher(producer, codec, names.metrics, source="up", run_id=cfg.run_id)
        await metrics.emit(mn.GATE_FEEDBACK_TO_SERVING_P50_S, 42.0)
        sink = DeadLetterSink(producer, codec, names.dlq, service="streams")
        await sink.send(SourceRecord(names.trajectories, 0, 7, b"k", b"\x00bad"),
                        "first message must be user or system, got assistant")
    finally:
        await producer.stop()


@pytest.fixture
def console(rl_config: RlstreamConfig, created_topics: TopicNames) -> Iterator[str]:
    """The console of the seeded stack."""
    asyncio.run(seed_stack(rl_config))
    with served_console(rl_config, lambda state: len(state["versions"]) == 4 and state["dlq"]["total"] == 1
                        and len(state["decisions"]) == 3) as url:
        yield url


def test_console_shows_versions_trajectories_and_decisions(console: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    with chromium_page(console) as page:
        # a version row per promoted version, and the rejected candidate with the gate's reason and figures
        for version in (1, 2):
            expect(page.locator(f'#versions tr[data-version="{version}"]')).to_have_attribute(
                "data-status", "promoted")
        rejected = page.locator('#versions tr[data-version="3"]')
        expect(rejected).to_have_attribute("data-status", "rejected")
        reason = rejected.locator(".stage-rejected .reason")
        expect(reason).to_contain_text("rejected:")
        expect(reason).to_contain_text("serving v2")
        expect(rejected.locator(".stage-evaluated .reason")).to_contain_text("held-out reward 0.050")
        expect(page.locator('#versions tr[data-version="1"] .stage-candidate')).to_contain_text("step 10")
        # a trajectory's tool call and its result, reward, advantage and shaded tokens
        page.select_option("#sample-version", "2")
        sample = page.locator("#samples .trajectory").filter(has_text="Oslo").first
        expect(sample.locator(".tool-call")).to_have_text('get_weather({"city": "Oslo"})')
        expect(sample).to_contain_text("Oslo: 18°C, light rain")
        expect(sample.locator(".head")).to_contain_text("advantage")
        expect(sample.locator(".tok")).to_have_count(4)
        # the same held-out prompt answered by two versions, side by side
        page.select_option("#compare-example", HELDOUT_EXAMPLE)
        page.select_option("#compare-a", "1")
        page.select_option("#compare-b", "3")
        expect(page.locator("#compare > div").nth(0)).to_contain_text("(v1)")
        expect(page.locator("#compare > div").nth(1)).to_contain_text("(v3)")
        # feedback and dead letters with the reason
        expect(page.locator("#feedback")).to_contain_text("3 rewards")
        expect(page.locator("#feedback")).to_contain_text("1 corrections")
        expect(page.locator("#dlq-reasons")).to_contain_text("first message must be user or system")
        expect(page.locator("#chart canvas")).to_have_count(1)
        keep_screenshot(page, tmp_path / "console.png")


def by_version(body: dict[str, Any]) -> Reply:
    """Version 2 calls the lookup tool and answers with its result; every other version guesses without it."""
    return tool_caller(body) if body["model"].endswith("-v2") else guesser(body)


async def gate_decides(cfg: RlstreamConfig) -> None:
    """The promotion gate, in-process on the stack, decides twice through the tool agent's own episode on a replica
    that has versions 1-3 loaded (a scripted OpenAI-compatible upstream): candidate v2 (calls the tool) against
    serving v1 (guesses) is promoted; then candidate v3 (guesses) against serving v2 is rejected. Each evaluation
    publishes the held-out answers of both versions as validation trajectories."""
    async with scripted_upstream(by_version) as upstream:
        control = ControlPlane(str(cfg.redis.url))
        serving = ServingControl(control)
        await serving.promote(cfg.policy, 1, token=await serving.issue_token(cfg.policy), reason="start",
                              decided_by="test", expected_version=-1)
        await serving.record_replica(cfg.policy, ReplicaAck(
            "w0", 3, f"{cfg.policy}-v3", url=upstream.url.removesuffix("/v1"),
            loaded={v: f"{cfg.policy}-v{v}" for v in (1, 2, 3)}), 120.0)
        evaluation = EvaluationSet(examples=HELDOUT[:4], reward_function=tool_reward, samples=2, temperature=0.7,
                                   max_tokens=48, episode=gate_episode, retries=1, retry_backoff_s=0.01,
                                   request_timeout_s=5.0)
        gate = PromotionGate(cfg, control, evaluation, codec=codec_for(cfg))
        await gate._start()
        try:
            for version in (2, 3):
                gate.known[version] = PolicyVersion(policy=gate.policy, version=version, base_model="m",
                                                    uri=f"/v{version}", learner_step=version)
                await gate.step()
            assert [(d.version, d.decision) for d in gate.decisions[-2:]] == [
                (2, DecisionKind.promote), (3, DecisionKind.reject)], gate.decisions
        finally:
            await gate._stop()
            await control.close()


def test_console_shows_the_gates_own_decisions_and_answers(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                           tmp_path: Path) -> None:
    """The console of a stack where the real gate decided (a promotion, a rejection by its paired test) on answers
    the tool agent's episode produced: the promoted version's row, the rejected candidate's reason, the promoted
    version's held-out answer with its tool call and result."""
    from playwright.sync_api import expect

    cfg = rl_config.model_copy(update={"gate": rl_config.gate.model_copy(update={
        "canary_share": 0.0, "load_timeout_s": 10.0, "examples": 4, "samples": 2, "publish_answers": 2})})
    asyncio.run(gate_decides(cfg))
    with served_console(cfg, lambda state: len(state["decisions"]) >= 2) as url, chromium_page(url) as page:
        expect(page.locator('#versions tr[data-version="2"]')).to_have_attribute("data-status", "promoted")
        expect(page.locator('#versions tr[data-version="2"] .stage-promoted .reason')).to_contain_text("promoted:")
        rejected = page.locator('#versions tr[data-version="3"]')
        expect(rejected).to_have_attribute("data-status", "rejected")
        expect(rejected.locator(".stage-rejected .reason")).to_contain_text("rejected:")
        expect(rejected.locator(".stage-rejected .reason")).to_contain_text("serving v2")
        page.select_option("#sample-version", "2")
        answer = page.locator("#samples .trajectory").first
        expect(answer.locator(".tool-call").first).to_contain_text("lookup(")
        expect(answer).to_contain_text("validation")
        keep_screenshot(page, tmp_path / "console-gate.png")
