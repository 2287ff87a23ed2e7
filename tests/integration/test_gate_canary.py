"""Canaries on the real broker and Redis: the gate gives a promoted candidate a share of new sessions, reads the
online feedback of both versions from ``trajectories`` and ``rewards`` (synthetic production events), and rolls a
worse canary back automatically (the time from its start to the rollback measured and bounded) or finishes the
promotion of one that is as good. The fleet is one replica acknowledging both versions (the sync worker's heartbeat
hash); no evaluation runs here (the offline figures are given)."""
from __future__ import annotations

import asyncio
import math
import random
import time
from datetime import datetime, timezone
from typing import Any

import pytest

from rlstream.gate.evaluation import EvaluationSet
from rlstream.gate.rules import EvalFigures, Verdict
from rlstream.gate.service import PromotionGate
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.gate.feedback import OnlineRewards
from rlstream.gate.sequential import SequentialOutcome, SprtSettings, sprt
from rlstream.schemas.models import DecisionKind, PolicyVersion, PromotionDecision, TrajectoryEvent, TrajectorySource
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_producer
from rlstream.transport.serving import ReplicaAck, ServingControl
from rlstream.transport.topic_reader import TopicReader, open_reader, read_to_end
from tests.support.factories import make_reward, make_trajectory
from tests.support.gate_helpers import serving_fleet

pytestmark = pytest.mark.integration
CODEC = AvroCodec()
#: A canary's rollback must come within this many seconds of its start once its feedback is in.
ROLLBACK_BOUND_S = 30.0


def figures(version: int) -> EvalFigures:
    return EvalFigures(version=version, reward_mean=0.5, answer_parse_rate=1.0, tool_call_parse_rate=1.0,
                       refusal_rate=0.0, answer_length=4.0, samples=8)


async def new_gate(cfg: RlstreamConfig, control: ControlPlane) -> PromotionGate:
    evaluation = EvaluationSet(examples=[{"id": "0", "prompt": "x"}], reward_function=lambda e, t: 0.0)
    gate = PromotionGate(cfg, control, evaluation, codec=CODEC)
    await gate._start()
    gate.known[2] = PolicyVersion(policy=cfg.policy, version=2, base_model="m", uri="/v2", learner_step=2)
    return gate


def production(cfg: RlstreamConfig, version: int, tag: str, reward: float | None = None) -> TrajectoryEvent:
    trajectory = make_trajectory(policy=cfg.policy, policy_version=version, reward=reward, group_size=1,
                                 example_id=f"ex-{version}-{tag}", run_id=cfg.run_id)
    trajectory.source = TrajectorySource.production
    return trajectory


async def send_feedback(producer: Any, names: TopicNames, feedback: list[tuple[TrajectoryEvent, float]]) -> None:
    """Each production trajectory (answered now: the canary counts what was answered since its start), then its
    reward (a RewardEvent)."""
    for trajectory, value in feedback:
        trajectory.created_at = datetime.now(timezone.utc)
        await producer.send(names.trajectories, CODEC.encode(trajectory), key=trajectory.example_id.encode())
        reward = make_reward(trajectory, value)
        await producer.send(names.rewards, CODEC.encode(reward), key=reward.example_id.encode())
    await producer.flush()


def bernoulli(cfg: RlstreamConfig, per_arm: int, canary_p: float, serving_p: float, seed: int = 7,
              tag: str = "") -> list[tuple[TrajectoryEvent, float]]:
    rng = random.Random(seed)
    return [(production(cfg, version, f"{tag}{i}"), float(rng.random() < p))
            for i in range(per_arm) for version, p in ((2, canary_p), (1, serving_p))]


async def drive(gate: PromotionGate, seconds: float = 60.0) -> None:
    """Pump and step the canary until it is decided (asserted) or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while gate.canary is not None and time.monotonic() < deadline:
        await gate.pump(timeout_ms=200)
        await gate.step_canary()
    assert gate.canary is None, f"the canary was not decided within {seconds:g} s"


async def run_canary(cfg: RlstreamConfig, names: TopicNames, canary_p: float = 0.5, serving_p: float = 0.5,
                     per_arm: int = 0, feedback: list[tuple[TrajectoryEvent, float]] | None = None,
                     extra: list[Any] | None = None) -> tuple[PromotionGate, float]:
    """Serving v1, canary v2 on a quarter of sessions; ``per_arm`` rewarded production trajectories per version
    (Bernoulli rewards, fixed seed), or ``feedback`` as given, and ``extra`` records ((topic, event) pairs);
    returns the gate once the canary is decided, and the seconds it took."""
    control = ControlPlane(str(cfg.redis.url))
    serving = await serving_fleet(cfg, control)
    producer = make_producer(cfg.kafka)
    await producer.start()
    gate = await new_gate(cfg, control)
    try:
        started = time.monotonic()
        await gate.start_canary(2, 1, figures(2), figures(1), Verdict(True))
        pointer = await serving.serving(cfg.policy)
        assert pointer is not None and (pointer.version, pointer.canary_version, pointer.canary_share) == (1, 2, 0.25)
        for topic, event in extra or []:
            event.created_at = datetime.now(timezone.utc)
            await producer.send(topic, CODEC.encode(event), key=event.example_id.encode())
        await send_feedback(producer, names, feedback if feedback is not None
                            else bernoulli(cfg, per_arm, canary_p, serving_p))
        await drive(gate)
        return gate, time.monotonic() - started
    finally:
        await gate._stop()
        await producer.stop()
        await control.close()


async def decisions(cfg: RlstreamConfig, names: TopicNames) -> list[PromotionDecision]:
    reader = await open_reader(cfg.kafka)
    try:
        return [item.event async for item in TopicReader(reader, CODEC, PromotionDecision).stream(
            read_to_end(reader, names.promotions))]
    finally:
        await reader.stop()


def canary_config(rl_config: RlstreamConfig) -> RlstreamConfig:
    return rl_config.model_copy(update={"gate": rl_config.gate.model_copy(update={
        "canary_share": 0.25, "canary_min_samples": 20, "canary_min_effect": 0.1, "load_timeout_s": 10.0,
        "canary_alpha": 0.05, "canary_beta": 0.2})})


def test_worse_canary_is_rolled_back_automatically(rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    cfg = canary_config(rl_config)
    gate, seconds = asyncio.run(run_canary(cfg, created_topics, canary_p=0.2, serving_p=0.8, per_arm=60))
    last = gate.decisions[-1]
    print(f"canary rolled back {last.candidate_metrics.get('canary_seconds', float('nan')):.2f}s after its start")
    assert last.decision == DecisionKind.rollback and last.version == 1, last.reason
    assert last.candidate_metrics["canary_version"] == 2
    assert last.candidate_metrics["canary_reward_mean"] < last.candidate_metrics["serving_reward_mean"]
    assert 0 < last.candidate_metrics["canary_seconds"] <= seconds <= ROLLBACK_BOUND_S
    pointer = asyncio.run(_pointer(cfg))
    assert pointer is not None and pointer.version == 1 and pointer.canary_version is None
    recorded = asyncio.run(decisions(cfg, created_topics))
    assert [d.decision for d in recorded] == [DecisionKind.canary, DecisionKind.rollback]


def test_as_good_canary_finishes_its_promotion(rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    cfg = canary_config(rl_config)
    gate, _ = asyncio.run(run_canary(cfg, created_topics, canary_p=0.5, serving_p=0.5, per_arm=300))
    last = gate.decisions[-1]
    assert last.decision == DecisionKind.finish_canary and last.version == 2, last.reason
    # the move is measured at once (feedback-to-serving), not at a later read an evaluation may hold off for minutes
    assert gate.clock.served_version == 2
    pointer = asyncio.run(_pointer(cfg))
    assert pointer is not None and pointer.version == 2 and pointer.canary_version is None
    recorded = asyncio.run(decisions(cfg, created_topics))
    assert [d.decision for d in recorded] == [DecisionKind.canary, DecisionKind.finish_canary]


async def _pointer(cfg: RlstreamConfig):  # type: ignore[no-untyped-def]
    control = ControlPlane(str(cfg.redis.url))
    try:
        return await ServingControl(control).serving(cfg.policy)
    finally:
        await control.close()


def test_the_gate_reads_exactly_the_groups_a_version_trained_on(rl_config: RlstreamConfig,
                                                                 created_topics: TopicNames) -> None:
    """Feedback latency starts from the trajectories of the groups in a version's ``trained_on``: non-contiguous
    ranges of several partitions, read in one pass, and nothing in between (groups skipped by the learner)."""
    from rlstream.schemas.models import OffsetRange
    from tests.support.learner_helpers import produce_groups, random_group

    cfg = rl_config
    groups = [random_group(cfg.policy, cfg.run_id, i) for i in range(12)]

    async def scenario() -> tuple[set[str], set[str]]:
        placed = await produce_groups(cfg, groups)
        # every other offset of a partition was skipped by the learner, not trained
        trained = sorted((i for i, (_, offset) in enumerate(placed) if offset % 2 == 0), key=lambda i: placed[i])
        ranges: list[OffsetRange] = []
        for i in trained:
            partition, offset = placed[i]
            last = ranges[-1] if ranges else None
            if last is not None and last.partition == partition and last.last + 1 == offset:
                last.last = offset
            else:
                ranges.append(OffsetRange(topic=created_topics.groups, partition=partition, first=offset, last=offset))
        skipped = set(placed) - {placed[i] for i in trained}
        assert any(r.partition == p and r.first < o for r in ranges for p, o in skipped)  # a gap inside a span
        control = ControlPlane(str(cfg.redis.url))
        evaluation = EvaluationSet(examples=[{"id": "0", "prompt": "x"}], reward_function=lambda e, t: 0.0)
        gate = PromotionGate(cfg, control, evaluation, codec=CODEC)
        await gate._start()
        try:
            version = PolicyVersion(policy=cfg.policy, version=3, base_model="m", uri="/v3", learner_step=3,
                                    trained_on=ranges)
            read = {t.trajectory_id for t in await gate._trained_on(version)}
        finally:
            await gate._stop()
            await control.close()
        expected = {t.trajectory_id for i in trained for t in groups[i].trajectories}
        return read, expected

    read, expected = asyncio.run(scenario())
    assert read == expected and expected


def legacy_truncation(outcome: SequentialOutcome, llr: float) -> SequentialOutcome:
    """What an undecided canary became before it failed closed: the sign of the llr (0 with no evidence) decided,
    so a canary with no feedback, or too little to test, was promoted."""
    return SequentialOutcome.rollback if llr > 0 else SequentialOutcome.finish


def timeout_config(rl_config: RlstreamConfig, **update: Any) -> RlstreamConfig:
    cfg = canary_config(rl_config)
    return cfg.model_copy(update={"gate": cfg.gate.model_copy(update={"canary_max_s": 2.0, **update})})


def test_undecided_canary_without_feedback_is_rejected_at_canary_max_s(rl_config: RlstreamConfig,
                                                                        created_topics: TopicNames) -> None:
    cfg = timeout_config(rl_config)
    gate, seconds = asyncio.run(run_canary(cfg, created_topics, feedback=[]))
    last = gate.decisions[-1]
    assert last.decision == DecisionKind.reject and last.version == 2, last.reason
    assert "undecided" in last.reason and "canary_max_s" in last.reason
    assert last.candidate_metrics["canary_undecided"] == 1.0 and last.candidate_metrics["canary_rewards"] == 0
    assert 2.0 <= seconds < 30.0
    pointer = asyncio.run(_pointer(cfg))
    assert pointer is not None and pointer.version == 1 and pointer.canary_version is None
    assert [d.decision for d in asyncio.run(decisions(cfg, created_topics))] == [DecisionKind.canary,
                                                                                  DecisionKind.reject]
    # negative control: the same test state under the old truncation is a promotion
    state = sprt(OnlineRewards(2, 1, gate.decisions[0].decided_at).canary,
                 OnlineRewards(2, 1, gate.decisions[0].decided_at).serving, gate.sprt)
    assert state.outcome == SequentialOutcome.wait and legacy_truncation(state.outcome, state.llr) == \
        SequentialOutcome.finish


def test_19_zeros_against_200_ones_is_rejected_not_promoted(rl_config: RlstreamConfig,
                                                             created_topics: TopicNames) -> None:
    cfg = timeout_config(rl_config, canary_max_s=10.0)  # time for every reward to be read first
    feedback = [(production(cfg, 2, f"c{i}"), 0.0) for i in range(19)] + \
        [(production(cfg, 1, f"s{i}"), 1.0) for i in range(200)]
    gate, _ = asyncio.run(run_canary(cfg, created_topics, feedback=feedback))
    last = gate.decisions[-1]
    assert last.decision == DecisionKind.reject and last.version == 2, last.reason
    assert (last.candidate_metrics["canary_rewards"], last.candidate_metrics["serving_rewards"]) == (19, 200)
    assert last.candidate_metrics["canary_reward_mean"] == 0.0 and last.candidate_metrics["serving_reward_mean"] == 1
    pointer = asyncio.run(_pointer(cfg))
    assert pointer is not None and pointer.version == 1 and pointer.canary_version is None
    # negative control: 19 < canary_min_samples, so the test waits, and the old truncation (llr 0) promoted it
    state = sprt(*_arms([0.0] * 19, [1.0] * 200), gate.sprt)
    assert state.outcome == SequentialOutcome.wait and legacy_truncation(state.outcome, state.llr) == \
        SequentialOutcome.finish


def _arms(canary: list[float], serving: list[float]) -> tuple[Any, Any]:
    from rlstream.gate.sequential import RewardStats

    arms = (RewardStats(), RewardStats())
    for arm, values in zip(arms, (canary, serving)):
        for value in values:
            arm.add(value)
    return arms


def test_invalid_rewards_on_the_topic_are_counted_not_tested(rl_config: RlstreamConfig,
                                                              created_topics: TopicNames) -> None:
    """A worse canary plus a NaN and a 1e200 reward on ``rewards`` (and a trajectory carrying 1e200 inline), all on
    the canary's arm: the gate leaves them out (counted) and rolls the canary back."""
    cfg = canary_config(rl_config)
    feedback = bernoulli(cfg, 60, canary_p=0.2, serving_p=0.8)
    hostile = [(production(cfg, 2, "nan"), math.nan), (production(cfg, 2, "huge"), 1e200)]
    inline = production(cfg, 2, "inline", reward=1e200)
    gate, _ = asyncio.run(run_canary(cfg, created_topics, feedback=hostile + feedback,
                                     extra=[(created_topics.trajectories, inline)]))
    last = gate.decisions[-1]
    assert last.decision == DecisionKind.rollback and last.version == 1, last.reason
    assert last.candidate_metrics["invalid_rewards"] == 3
    assert last.candidate_metrics["canary_rewards"] == 60  # none of the invalid ones

    # negative control: the same records into the test without the reward rules
    def unchecked(records: list[tuple[TrajectoryEvent, float]]) -> Any:
        rewards = OnlineRewards(2, 1, gate.decisions[0].decided_at)
        for trajectory, value in records:
            rewards.on_trajectory(trajectory, cfg.policy)
            rewards.on_reward(make_reward(trajectory, value))
        return sprt(rewards.canary, rewards.serving, gate.sprt)

    assert unchecked(feedback).outcome == SequentialOutcome.rollback  # the clean records alone roll back
    for bad in hostile:  # one of them turns the certain rollback into a wait, and the old timeout into a promotion
        state = unchecked([bad] + feedback)
        assert state.outcome == SequentialOutcome.wait
        assert legacy_truncation(state.outcome, state.llr) == SequentialOutcome.finish


def test_a_restarted_gate_resumes_the_canary_test(rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    """15 rewards per arm before the restart, 10 after: the restarted gate reads the first 15 back from Redis and
    rolls the worse canary back on all 25 (control: without the saved state a restarted gate starts from zero)."""
    cfg = canary_config(rl_config)

    async def scenario() -> tuple[int, int, PromotionDecision]:
        control = ControlPlane(str(cfg.redis.url))
        serving = await serving_fleet(cfg, control)
        producer = make_producer(cfg.kafka)
        await producer.start()
        try:
            first = await new_gate(cfg, control)
            try:
                await first.start_canary(2, 1, figures(2), figures(1), Verdict(True))
                await send_feedback(producer, created_topics, bernoulli(cfg, 15, 0.1, 0.9, seed=3, tag="a"))
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    await first.pump(timeout_ms=200)
                    await first.step_canary()
                    assert first.canary is not None
                    if min(first.canary.rewards.canary.count, first.canary.rewards.serving.count) == 15:
                        break
            finally:
                await first._stop()  # the gate dies mid-canary
            saved = await serving.canary_state(cfg.policy)
            assert saved is not None and (saved.canary.count, saved.serving_arm.count) == (15, 15)
            # control: a restarted gate that finds no saved state starts the test from zero
            await serving.clear_canary_state(cfg.policy)
            blank = await new_gate(cfg, control)
            try:
                assert blank.canary is not None and blank.canary.version == 2
                from_zero = blank.canary.rewards.canary.count + blank.canary.rewards.serving.count
            finally:
                await blank._stop()
            await serving.save_canary_state(cfg.policy, saved)
            second = await new_gate(cfg, control)
            try:
                assert second.canary is not None
                resumed = second.canary.rewards.canary.count + second.canary.rewards.serving.count
                assert second.canary.started_at == saved.started_at
                await send_feedback(producer, created_topics, bernoulli(cfg, 10, 0.1, 0.9, seed=4, tag="b"))
                await drive(second)
                return from_zero, resumed, second.decisions[-1]
            finally:
                await second._stop()
        finally:
            await producer.stop()
            await control.close()

    from_zero, resumed, last = asyncio.run(scenario())
    assert from_zero == 0 and resumed == 30
    assert last.decision == DecisionKind.rollback, last.reason
    assert last.candidate_metrics["canary_n"] == 25 and last.candidate_metrics["serving_n"] == 25
    assert asyncio.run(_saved(cfg)) is None  # the decided canary's state is gone


async def _saved(cfg: RlstreamConfig) -> Any:
    control = ControlPlane(str(cfg.redis.url))
    try:
        return await ServingControl(control).canary_state(cfg.policy)
    finally:
        await control.close()


def test_an_operator_rollback_ends_the_running_canary(rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    """Serving v2 with canary v3; ``rlstream rollback --to 1`` (ops.promotion.operator_move): the canary is gone
    from the pointer in the same move, its rejection is recorded with the operator's reason, and the gate drops its
    test (control: without the operator's move the canary keeps running)."""
    from rlstream.ops.promotion import operator_move
    from tests.support.version_helpers import announce_versions

    cfg = canary_config(rl_config)
    policy = cfg.policy

    async def scenario() -> tuple[bool, Any, PromotionGate]:
        await announce_versions(cfg, [PolicyVersion(policy=policy, version=v, base_model="m", uri=f"/v{v}",
                                                    learner_step=v) for v in (1, 2, 3)])
        control = ControlPlane(str(cfg.redis.url))
        serving = await serving_fleet(cfg, control, loaded=(1, 2, 3))
        await serving.promote(policy, 2, token=await serving.issue_token(policy), reason="up", decided_by="test")
        gate = await new_gate(cfg, control)
        try:
            gate.known[3] = PolicyVersion(policy=policy, version=3, base_model="m", uri="/v3", learner_step=3)
            await gate.start_canary(3, 2, figures(3), figures(2), Verdict(True))
            for _ in range(4):  # control: nothing ends it by itself
                await gate.pump(timeout_ms=100)
                await gate.step_canary()
            still_running = gate.canary is not None and (await serving.serving(policy)).canary_version == 3
            outcome = await operator_move(cfg, 1, DecisionKind.rollback, "bad answers", timeout_s=5.0)
            pointer = await serving.serving(policy)
            await gate.step_canary()
            return still_running, (outcome.moved, pointer, await serving.canary_state(policy)), gate
        finally:
            await gate._stop()
            await control.close()

    still_running, (moved, pointer, saved), gate = asyncio.run(scenario())
    assert still_running
    assert moved and pointer.version == 1 and pointer.canary_version is None and pointer.canary_share == 0.0
    assert gate.canary is None and saved is None
    recorded = asyncio.run(decisions(cfg, created_topics))
    ended = [d for d in recorded if d.decision == DecisionKind.reject and d.version == 3]
    assert len(ended) == 1 and "ended by an operator's rollback to v1: bad answers" in ended[0].reason
    assert [d.decision for d in recorded].count(DecisionKind.rollback) == 1


def test_an_undecided_canary_held_for_an_operator_waits_then_the_operator_ends_it(
        rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    """``gate.canary_undecided: hold``: at canary_max_s the canary keeps its share and is recorded as held (never
    promoted); ``rlstream rollback --to`` the serving version ends it, serving staying at v1."""
    from rlstream.ops.promotion import operator_move

    cfg = timeout_config(rl_config, canary_max_s=1.0, canary_undecided="hold")

    async def scenario() -> tuple[Any, Any, Any, PromotionGate]:
        control = ControlPlane(str(cfg.redis.url))
        serving = await serving_fleet(cfg, control)
        gate = await new_gate(cfg, control)
        try:
            await gate.start_canary(2, 1, figures(2), figures(1), Verdict(True))
            deadline = time.monotonic() + 20
            while not (gate.canary is not None and gate.canary.held) and time.monotonic() < deadline:
                await gate.pump(timeout_ms=100)
                await gate.step_canary()
            for _ in range(3):  # held: it stays, whatever time passes
                await gate.step_canary()
            held = (gate.canary is not None and gate.canary.held, await serving.serving(cfg.policy),
                    await serving.canary_state(cfg.policy))
            outcome = await operator_move(cfg, 1, DecisionKind.rollback, "not worth the wait", timeout_s=5.0)
            await gate.step_canary()
            return held, outcome, await serving.serving(cfg.policy), gate
        finally:
            await gate._stop()
            await control.close()

    (held, pointer, saved), outcome, after, gate = asyncio.run(scenario())
    assert held and pointer.version == 1 and pointer.canary_version == 2 and saved is not None and saved.held
    assert outcome.moved and after.version == 1 and after.canary_version is None and gate.canary is None
    recorded = asyncio.run(decisions(cfg, created_topics))
    assert [d.decision for d in recorded] == [DecisionKind.canary, DecisionKind.canary, DecisionKind.reject]
    assert "held for an operator" in recorded[1].reason and recorded[1].candidate_metrics["canary_held"] == 1
    assert "serving stays at v1: not worth the wait" in recorded[2].reason and recorded[2].version == 2
    assert not any(d.decision in (DecisionKind.promote, DecisionKind.finish_canary) for d in recorded)


def test_a_full_weights_canary_runs_on_its_share_of_the_replicas(rl_config: RlstreamConfig,
                                                                 created_topics: TopicNames) -> None:
    """Two serve replicas holding full weights v1: the canary v2 goes to one of them (the pointer's
    ``canary_workers``), whose sync worker loads it while the other keeps v1 (``full_version_for_serve``); the router
    sends the canary's share of sessions there and everything else to v1 (control: every replica following the newest
    of serving and canary, the old rule, answers all traffic with the canary)."""
    from rlstream.inference.sync import full_version_for_serve
    from rlstream.rollout.routing import FleetRouter, NoServingVersion
    from rlstream.schemas.models import WeightsKind

    cfg = canary_config(rl_config)
    policy = cfg.policy

    async def ack(serving: ServingControl, loaded: dict[str, int]) -> None:
        for wid, version in loaded.items():
            await serving.record_replica(policy, ReplicaAck(wid, version, policy, url=f"http://{wid}:1",
                                                            loaded={version: policy}, follows="serving"), 120.0)

    async def sync_workers(serving: ServingControl, stop: asyncio.Event) -> None:
        """What each replica's sync worker loads: the full version the pointer asks of it."""
        while not stop.is_set():
            wanted = await serving.wanted(policy)
            await ack(serving, {wid: full_version_for_serve("serving", None, wanted, wid) or 1
                                for wid in ("w0", "w1")})
            await asyncio.sleep(0.2)

    async def shares(router: FleetRouter, tag: str) -> dict[tuple[int, str | None], int]:
        out: dict[tuple[int, str | None], int] = {}
        for i in range(600):
            try:
                route = await router.route(session_id=f"{tag}-{i}")
                key = (route.version, route.worker_id)
            except NoServingVersion:  # the serving version is loaded nowhere
                key = (-1, None)
            out[key] = out.get(key, 0) + 1
        return out

    async def scenario() -> tuple[Any, Any, dict[tuple[int, str | None], int], dict[tuple[int, str | None], int]]:
        control = ControlPlane(str(cfg.redis.url))
        serving = ServingControl(control)
        await serving.promote(policy, 1, token=await serving.issue_token(policy), reason="start", decided_by="test",
                              expected_version=-1)
        await ack(serving, {"w0": 1, "w1": 1})
        gate = await new_gate(cfg, control)
        stop = asyncio.Event()
        workers = asyncio.create_task(sync_workers(serving, stop))
        try:
            gate.known[2] = PolicyVersion(policy=policy, version=2, base_model="m", uri="/v2", learner_step=2,
                                          kind=WeightsKind.full)
            await gate.start_canary(2, 1, figures(2), figures(1), Verdict(True))
            pointer = await serving.serving(policy)
            await asyncio.sleep(0.5)
            routed = await shares(FleetRouter(control, policy, policy, ttl_s=30), "s")
            stop.set()
            await workers
            await ack(serving, {"w0": 2, "w1": 2})  # control: the old rule, max(serving, canary) on every replica
            old_rule = await shares(FleetRouter(control, policy, policy, ttl_s=30), "t")
            return pointer, gate.decisions[-1], routed, old_rule
        finally:
            stop.set()
            await gate._stop()
            await control.close()

    pointer, started, routed, old_rule = asyncio.run(scenario())
    assert started.decision == DecisionKind.canary and pointer.canary_version == 2, started.reason
    assert len(pointer.canary_workers) == 1
    chosen = pointer.canary_workers[0]
    other = ({"w0", "w1"} - {chosen}).pop()
    assert set(routed) == {(2, chosen), (1, other)}, routed  # the canary only on its replica, serving on the other
    n = sum(routed.values())
    assert abs(routed[(2, chosen)] - 0.25 * n) <= 4 * math.sqrt(n * 0.25 * 0.75), routed
    # control: no replica holds v1 any more: the canary answers every request it may take, and the serving share of
    # the traffic finds no replica with its version
    assert not any(version == 1 for version, _ in old_rule), old_rule
    assert {version for version, _ in old_rule} == {2, -1}, old_rule


def test_sessionless_requests_through_the_gateway_reach_the_canary_at_its_share(rl_config: RlstreamConfig) -> None:
    """Requests without a session id, each from another caller (the ``user`` field), through the gateway to a replica
    holding serving v1 and canary v2 at a 0.25 share: the canary answers its share, within a binomial bound
    (control: the same requests with nothing that identifies the caller never reach the canary)."""
    import httpx

    from rlstream.gateway.app import Gateway
    from rlstream.gateway.config import GatewaySettings
    from rlstream.gateway.server import serving as serving_gateway
    from rlstream.rollout.routing import FleetRouter
    from tests.support.fleet_support import canned_replica

    policy, n = rl_config.policy, 200

    class Discard:
        trajectories_topic, rewards_topic, calls_topic = "trajectories", "rewards", "calls"

        async def submit(self, topic: str, key: str, event: Any) -> "asyncio.Future[Any]":
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

    async def scenario() -> tuple[list[str], list[str]]:
        control = ControlPlane(str(rl_config.redis.url))
        serving = ServingControl(control)
        try:
            async with canned_replica() as replica:
                await serving.record_replica(policy, ReplicaAck("w0", 2, "p-v2", url=replica.url, loaded={
                    1: "p-v1", 2: "p-v2"}), 60)
                token = await serving.issue_token(policy)
                await serving.promote(policy, 1, token=token, reason="t", decided_by="test", expected_version=-1)
                await serving.set_canary(policy, 2, 0.25, token)
                gateway = Gateway(GatewaySettings(session_stitching="gateway", port=0, policy=policy,
                                                  served_model="base", run_id=rl_config.run_id),
                                  Discard(), fleet=FleetRouter(control, policy, "base", ttl_s=5))
                async with serving_gateway(gateway) as url, httpx.AsyncClient(timeout=30) as http:
                    for i in range(n):
                        for user in (f"user-{i}", None):
                            body: dict[str, Any] = {"model": policy,
                                                    "messages": [{"role": "user", "content": f"{user or 'anon'}-{i}"}]}
                            if user is not None:
                                body["user"] = user
                            answer = await http.post(f"{url}/v1/chat/completions", json=body)
                            assert answer.status_code == 200, answer.text
                named = [m for m, u in replica.requests if u.startswith("user-")]
                anonymous = [m for m, u in replica.requests if u.startswith("anon-")]
                return named, anonymous
        finally:
            await control.close()

    named, anonymous = asyncio.run(scenario())
    assert len(named) == len(anonymous) == n
    hits = named.count("p-v2")
    assert abs(hits - 0.25 * n) <= 4 * math.sqrt(n * 0.25 * 0.75), hits
    assert anonymous.count("p-v2") == 0  # control: no identity, no canary
