"""The gate publishes the held-out answers of every version it evaluates (real broker, Redis and stream worker; the
replica is a scripted OpenAI-compatible upstream run through the tool agent's own episode): the first sample of the
first ``gate.publish_answers`` examples of each version, as ``validation`` trajectories with the conversation, the
tool calls and their results, the reward and its components, the version, example id and seed. The stream app never
groups them (counted ``streams.validation_skipped``); control: the same trajectories without the validation mark do
reach ``groups``. ``rlstream console``'s state shows both versions' answers to one example side by side."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rlstream.gate.evaluation import EvaluationSet, seed_of
from rlstream.gate.service import PromotionGate
from rlstream.ops.console.state import ConsoleFeed, ConsoleState
from rlstream.ops.tool_task import gate_episode, lookup_value, tool_reward
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import PolicyVersion, TrajectoryEvent, TrajectoryGroup, TrajectorySource
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from tests.integration.test_streams_assembly import wait_for_metrics
from tests.support.gate_helpers import serving_fleet
from tests.support.scripted_upstream import Reply, scripted_upstream
from tests.support.streams_helpers import CODEC, Worker, publish, read_all
from tests.unit.test_gate_episodes import HELDOUT, guesser, tool_caller

pytestmark = pytest.mark.integration
EXAMPLES = 4
PUBLISHED = 2


def by_version(body: dict[str, Any]) -> Reply:
    """Version 2 calls the tool and answers with its result; version 1 guesses without it."""
    return tool_caller(body) if body["model"].endswith("-v2") else guesser(body)


async def evaluate_candidate(cfg: RlstreamConfig) -> None:
    """One gate decision about candidate v2 against serving v1 on a replica that has both loaded."""
    async with scripted_upstream(by_version) as upstream:
        control = ControlPlane(str(cfg.redis.url))
        await serving_fleet(cfg, control, url=upstream.url.removesuffix("/v1"))
        evaluation = EvaluationSet(examples=HELDOUT[:EXAMPLES], reward_function=tool_reward, samples=2,
                                   temperature=0.7, max_tokens=48, episode=gate_episode, retries=1,
                                   retry_backoff_s=0.01, request_timeout_s=5.0)
        gate = PromotionGate(cfg, control, evaluation, codec=CODEC)
        await gate._start()
        try:
            gate.known[2] = PolicyVersion(policy=gate.policy, version=2, base_model="m", uri="/v2", learner_step=2)
            await gate.step()
            assert gate.decisions and gate.decisions[-1].version == 2
        finally:
            await gate._stop()
            await control.close()


async def console_state(cfg: RlstreamConfig) -> ConsoleState:
    """The console's state once it has read every topic."""
    state = ConsoleState(cfg.policy, cfg.run_id)
    feed = ConsoleFeed(cfg, state)
    stop = asyncio.Event()
    task = asyncio.create_task(feed.follow_topics(stop))
    try:
        await asyncio.wait_for(feed.caught_up.wait(), timeout=30)
    finally:
        stop.set()
        await task
    return state


def test_the_gate_publishes_held_out_answers_that_are_never_grouped_and_the_console_pairs_them(
        rl_config: RlstreamConfig, tmp_path: Path) -> None:
    cfg = rl_config.model_copy(update={"gate": rl_config.gate.model_copy(update={
        "canary_share": 0.0, "load_timeout_s": 10.0, "examples": EXAMPLES, "samples": 2,
        "publish_answers": PUBLISHED})})
    asyncio.run(prepare_topics(cfg))
    names = TopicNames.from_config(cfg.topics)
    worker = Worker(cfg, "w1", tmp_path).start()
    try:
        asyncio.run(evaluate_candidate(cfg))
        published = [t for _, t in asyncio.run(read_all(cfg, names.trajectories, TrajectoryEvent,
                                                        expect=2 * PUBLISHED, timeout_s=30, quiet_s=1))]
        # the first sample of the first two examples, of the candidate and of the serving version, once each
        assert sorted((t.policy_version, t.example_id) for t in published) == sorted(
            (v, str(e["id"])) for v in (1, 2) for e in HELDOUT[:PUBLISHED])
        for t in published:
            example = next(e for e in HELDOUT if str(e["id"]) == t.example_id)
            assert t.source == TrajectorySource.validation and t.policy == cfg.policy and t.run_id == cfg.run_id
            assert t.metadata["gate.seed"] == str(seed_of(t.example_id, 0))
            assert t.metadata["gate.model"] == f"{cfg.policy}-v{t.policy_version}"
            assert t.messages[0].role == "user" and example["entity"] in (t.messages[0].content or "")
            assert set(t.reward_components) >= {"success", "tool_call_parsed", "tool_calls"}
            value = lookup_value(example["entity"], example["attribute"])
            if t.policy_version == 2:  # the tool call, its result, the answer naming it
                call = t.messages[1].tool_calls[0]  # type: ignore[index]
                assert call.name == "lookup" and example["entity"] in call.arguments
                assert t.messages[2].role == "tool" and t.messages[2].content == value
                assert value in (t.messages[-1].content or "") and t.reward == pytest.approx(1.0)
                assert t.reward_components["success"] == 1.0
            else:
                assert [m.role for m in t.messages] == ["user", "assistant"]
                assert t.reward_components["tool_calls"] == 0.0 and t.reward is not None and t.reward <= 0.5

        # negative control: the two versions' answers to one example without the validation mark, as one group of
        # two generations, are grouped
        first = str(HELDOUT[0]["id"])
        pair = sorted((t for t in published if t.example_id == first), key=lambda t: t.policy_version)
        control = [t.model_copy(update={"trajectory_id": f"control-{i}", "group_id": "control-group",
                                        "group_size": 2, "generation_index": i, "source": TrajectorySource.rollout})
                   for i, t in enumerate(pair)]
        asyncio.run(publish(cfg, [(names.trajectories, t.example_id.encode(), CODEC.encode(t)) for t in control]))
        asyncio.run(wait_for_metrics(cfg, names, {(mn.STREAMS_VALIDATION_SKIPPED, ""): 2 * PUBLISHED,
                                                  (mn.STREAMS_TRAJECTORIES_ACCEPTED, ""): 2}, timeout_s=60))
        groups = [g for _, g in asyncio.run(read_all(cfg, names.groups, TrajectoryGroup, expect=1, timeout_s=30,
                                                     quiet_s=2))]
        assert [g.group_id for g in groups] == ["control-group"]
        assert sorted(t.trajectory_id for g in groups for t in g.trajectories) == ["control-0", "control-1"]
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()

    state = asyncio.run(console_state(cfg))
    listed = state.overview()["compare_examples"]
    assert listed[0]["heldout"] and {e["example_id"] for e in listed if e["heldout"]} == {
        str(e["id"]) for e in HELDOUT[:PUBLISHED]}
    pair = state.compare(first, 1, 2)
    assert pair["heldout"]
    (a,), (b,) = pair["a"]["answers"], pair["b"]["answers"]
    assert a["source"] == b["source"] == "validation" and a["policy_version"] == 1 and b["policy_version"] == 2
    assert any(c["name"] == "lookup" for m in b["messages"] for c in m["tool_calls"])
    assert a["messages"][0]["content"] == b["messages"][0]["content"]  # the same prompt
