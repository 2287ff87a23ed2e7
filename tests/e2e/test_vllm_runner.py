"""The reference rollout runner against real vLLM, broker and Redis: target functions, version tags,
failed generations, admission control."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from rlstream.learner.waiting import WaitingForGroups
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_consumer
from rlstream.ops.vllm import VllmServer
from rlstream.rollout.capture import target_function
from rlstream.rollout.loading import load_callable, load_examples
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.runner import RolloutRunner, dataset_examples
from rlstream.rollout.sampling import SamplingSettings
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from tests.e2e.vllm_support import SERVED_MODEL, vllm_fixture

vllm = vllm_fixture()


async def plan(client: Any, example: dict[str, Any], sampling: SamplingSettings) -> str:
    response = await client.chat.completions.create(
        model=sampling.model, max_tokens=4, temperature=1.0,
        messages=[{"role": "user", "content": f"Plan: {example['prompt']}"}])
    return response.choices[0].message.content or ""


@target_function("solver")
async def solve(client: Any, example: dict[str, Any], sampling: SamplingSettings, plan_text: str) -> str:
    response = await client.chat.completions.create(
        model=sampling.model, max_tokens=6, temperature=1.0,
        messages=[{"role": "user", "content": example["prompt"]}])
    return response.choices[0].message.content or ""


async def two_step_workflow(example: dict[str, Any], client: Any, sampling: SamplingSettings) -> str:
    """A planner (not trained) then a solver (the target function)."""
    return await solve(client, example, sampling, await plan(client, example, sampling))


def length_reward(example: dict[str, Any], output: str) -> dict[str, float]:
    return {"reward": float(len(output) % 3), "length": float(len(output))}


def write_dataset(path: Path, n: int) -> Path:
    path.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": f"Repeat the letter {'abc'[i % 3]}."})
                              for i in range(n)))
    return path


def runner_config(cfg: RlstreamConfig, server: VllmServer, **rollout: Any) -> RlstreamConfig:
    cfg = cfg.model_copy(deep=True)
    cfg.rollout = cfg.rollout.model_validate({**cfg.rollout.model_dump(), "base_url": server.base_url,
                                              "model": SERVED_MODEL, "max_tokens": 6, "admission_poll_s": 0.2,
                                              **rollout})
    return cfg


async def read_trajectories(cfg: RlstreamConfig, topic: str, expected: int) -> list[TrajectoryEvent]:
    consumer = make_consumer(cfg.kafka, topic, group_id=None)
    await consumer.start()
    out: list[TrajectoryEvent] = []
    try:
        for _ in range(60):
            for records in (await consumer.getmany(timeout_ms=300)).values():
                out.extend(AvroCodec().decode(r.value, TrajectoryEvent) for r in records)
            if len(out) >= expected:
                break
    finally:
        await consumer.stop()
    return out


async def run_runner(cfg: RlstreamConfig, topics: TopicNames, workflow: Any, reward: Any,
                     examples: list[dict[str, Any]], stop: asyncio.Event | None = None,
                     on_runner: Any = None) -> RolloutRunner:
    publisher = TrajectoryPublisher.from_config(cfg.kafka, topics.trajectories, topics.rewards)
    await publisher.start()
    control = ControlPlane(cfg.redis.url)
    client = AsyncOpenAI(base_url=cfg.rollout.base_url, api_key="x")
    runner = RolloutRunner(cfg, workflow, client, publisher, control, reward)
    try:
        run = asyncio.create_task(runner.run(dataset_examples(examples, cfg.rollout.mode, cfg.rollout.epochs), stop))
        if on_runner is not None:
            await on_runner(runner, control)
        await run
    finally:
        await publisher.close()
        await control.close()
        await client.close()
    return runner


async def paused(runner: RolloutRunner, timeout_s: float = 30.0) -> None:
    """Until the runner's admission control has paused it once."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not runner.stats.admission_waits and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)


def test_runner_records_target_functions_scores_and_survives_a_failed_generation(
    vllm: VllmServer, rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path,
) -> None:
    cfg = runner_config(rl_config, vllm, group_size=2, concurrency=4, mode="epoch", epochs=1)
    cfg.finetuning.target_functions = ["solver"]
    examples = load_examples(write_dataset(tmp_path / "data.jsonl", 3))
    workflow = load_callable("tests.e2e.test_vllm_runner:two_step_workflow")

    async def flaky(example: dict[str, Any], client: Any, sampling: SamplingSettings) -> str:
        if example["id"] == "q1" and not getattr(flaky, "failed", False):
            flaky.failed = True  # type: ignore[attr-defined]
            raise RuntimeError("tool backend unavailable")
        return await workflow(example, client, sampling)

    async def scenario() -> tuple[RolloutRunner, list[TrajectoryEvent]]:
        await ControlPlane(cfg.redis.url).publish_latest(cfg.policy, 4, "file:///v4", "abc")
        runner = await run_runner(cfg, created_topics, flaky, length_reward, examples)
        return runner, await read_trajectories(cfg, created_topics.trajectories, 5)

    runner, events = asyncio.run(scenario())
    assert runner.stats.groups_started == 3
    assert runner.stats.generations_ok == 5 and runner.stats.generations_failed == 1
    assert runner.stats.failures[0].example_id == "q1" and "tool backend" in runner.stats.failures[0].error
    assert len(events) == 5
    for event in events:
        assert event.policy == cfg.policy and event.policy_version == 4  # no worker: the learner's latest
        assert event.group_id == f"{cfg.run_id}:{event.example_id}:0" and event.group_size == 2
        planner, solver = event.turns
        assert (planner.function, planner.trainable) == ("<workflow>", False)
        assert (solver.function, solver.trainable) == ("solver", True)
        assert solver.completion_token_ids and len(solver.completion_logprobs) == len(solver.completion_token_ids)
        assert event.target == "solver"
        assert event.reward == event.reward_components["reward"] and "length" in event.reward_components
        assert event.messages[-1].role == "assistant"
    assert sorted(e.generation_index for e in events if e.example_id == "q1") == [0] or \
        sorted(e.generation_index for e in events if e.example_id == "q1") == [1]


def test_admission_control_pauses_until_the_learner_catches_up(
    vllm: VllmServer, rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path,
) -> None:
    cfg = runner_config(rl_config, vllm, group_size=1, concurrency=1, mode="continuous", max_groups=3,
                        groups_per_version=1, max_policy_lag=1)
    examples = load_examples(write_dataset(tmp_path / "data.jsonl", 2))
    workflow = load_callable("rlstream.rollout.workflows:single_turn")
    observed: dict[str, Any] = {}

    async def learner(runner: RolloutRunner, control: ControlPlane) -> None:
        # 1 group per version, lag 1: two groups may run ahead of the learner, the third must wait
        await paused(runner)
        await asyncio.sleep(1.5)
        observed["while_paused"] = runner.stats.groups_started
        observed["waits"] = runner.stats.admission_waits
        await control.publish_latest(cfg.policy, 1, "file:///v1", "abc")

    async def scenario() -> RolloutRunner:
        return await run_runner(cfg, created_topics, workflow, None, examples, on_runner=learner)

    runner = asyncio.run(scenario())
    assert observed == {"while_paused": 2, "waits": 1}
    assert runner.stats.groups_started == 3 and runner.stats.generations_ok == 3
    assert runner.stats.paused_s >= 1.5
    events = asyncio.run(read_trajectories(cfg, created_topics.trajectories, 3))
    assert len(events) == 3 and all(e.reward is None for e in events)  # rewards come later as RewardEvents
    assert {e.example_id for e in events} == {"q0", "q1"}  # continuous mode cycles the dataset


@pytest.mark.parametrize("learner_waits", [True, False], ids=["learner-starved", "control-learner-busy"])
def test_a_learner_waiting_for_groups_ends_a_pause_held_by_groups_that_never_train(
    vllm: VllmServer, rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path, learner_waits: bool,
) -> None:
    """Two groups run ahead of a learner that never trains them (filtered downstream, say): the count keeps the runner
    paused until the learner says it has nothing to read; then the runner counts from the learner's version again.
    Control: a learner that does not say so (busy training) keeps the runner paused."""
    cfg = runner_config(rl_config, vllm, group_size=1, concurrency=1, mode="continuous", max_groups=4,
                        groups_per_version=1, max_policy_lag=1, admission_resync_s=1.0)
    examples = load_examples(write_dataset(tmp_path / "data.jsonl", 2))
    workflow = load_callable("rlstream.rollout.workflows:single_turn")
    stop = asyncio.Event()
    observed: dict[str, Any] = {}

    async def learner(runner: RolloutRunner, control: ControlPlane) -> None:
        await paused(runner)
        observed["paused_at"] = runner.stats.groups_started
        waiting = WaitingForGroups(control, cfg.policy)  # the learner's own reporter, on the real Redis
        deadline = asyncio.get_running_loop().time() + 6.0
        while runner.stats.groups_started < 4 and asyncio.get_running_loop().time() < deadline:
            if learner_waits:
                await waiting.nothing_to_read()
            await asyncio.sleep(0.2)
        stop.set()

    runner = asyncio.run(run_runner(cfg, created_topics, workflow, None, examples, stop=stop, on_runner=learner))
    assert observed["paused_at"] == 2
    if learner_waits:
        assert runner.stats.groups_started == 4 and runner.stats.admission_resyncs >= 1
    else:
        assert runner.stats.groups_started == 2 and runner.stats.admission_resyncs == 0


def test_cli_rollout_run_publishes_scored_groups(
    vllm: VllmServer, rl_config: RlstreamConfig, topic_names: TopicNames, tmp_path: Path,
) -> None:
    from typer.testing import CliRunner

    from rlstream.cli.app import app

    dataset = write_dataset(tmp_path / "data.jsonl", 2)
    overrides = {"kafka.bootstrap_servers": rl_config.kafka.bootstrap_servers, "redis.url": rl_config.redis.url,
                 "topics.prefix": rl_config.topics.prefix, "topics.partitions": "2", "run_id": rl_config.run_id,
                 "policy": rl_config.policy, "rollout.group_size": "2", "rollout.max_tokens": "4",
                 "rollout.model": SERVED_MODEL}
    args = ["rollout", "run", "--dataset", str(dataset), "--workflow", "rlstream.rollout.workflows:single_turn",
            "--reward", "tests.e2e.test_vllm_runner:text_length_reward", "--mode", "epoch",
            "--base-url", vllm.base_url]
    for key, value in overrides.items():
        args += ["-o", key, value]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "groups 2  generations ok 4  failed 0" in result.output
    events = asyncio.run(read_trajectories(rl_config, topic_names.trajectories, 4))
    assert len(events) == 4 and {e.example_id for e in events} == {"q0", "q1"}
    assert all(e.reward == len(e.messages[-1].content or "") for e in events)


def text_length_reward(example: dict[str, Any], output: str) -> float:
    return float(len(output))
