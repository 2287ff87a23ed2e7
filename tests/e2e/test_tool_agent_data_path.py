"""The tool-agent task's data path, short (docs/tool-agent.md): the task's own OpenAI Agents SDK agent
(``rlstream.ops.tool_task.tool_agent``) runs through the capture gateway (API key, session and task headers) in front
of the suite's shared vLLM server on the tiny model, its first call forced to be a ``lookup`` call (vLLM's structured
outputs), the SDK running the tool and sending its result back for the final answer. Sessions are stitched by a
streams worker, the verifier's reward comes back as feedback through the gateway, the learner trains a LoRA version
on the groups and the sync worker loads it into the same vLLM server. A session whose agent may not call the tool is
the negative control: no call, no tool message, the verifier's lower reward."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from rlstream.inference.sync import InferenceSyncWorker, adapter_name
from rlstream.inference.vllm_backend import VllmBackend
from rlstream.learner.service import Learner
from rlstream.ops.lineage import version_lineage
from rlstream.ops.tool_task import DEMONSTRATION, TASK_NAME, TOOL_NAME, ToolEpisode, tool_agent, tool_dataset, tool_reward
from rlstream.ops.vllm import VllmServer
from rlstream.gateway.app import Gateway
from rlstream.gateway.auth import AccessConfig
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.sampling import SamplingSettings
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import PolicyVersion, TrajectoryEvent, WeightsKind
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.transport.control import ControlPlane
from tests.e2e.vllm_support import SERVED_MODEL, tiny_model_dir, vllm_fixture, wait_until
from tests.support.learner_helpers import read_topic
from tests.support.streams_helpers import Worker, read_all, read_groups

vllm = vllm_fixture()
KEY = "tool-agent-key-0123456789abcdef"
#: tool results in the prompt's worked exchanges (every trajectory's messages start with them)
DEMONSTRATED_RESULTS = sum(item.get("type") == "function_call_output" for item in DEMONSTRATION)
#: the first agent run's reward starts the keyed baseline (that single is filtered); the other three train
#: (learner.baseline_min_count 1: the second, with one reward behind its baseline, too)
CHOICES = ("required", "required", "none", "required")


def test_a_forced_lookup_call_is_captured_rewarded_trained_and_loaded(
        vllm: VllmServer, rl_config: RlstreamConfig, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    started = time.monotonic()
    base_dir = tiny_model_dir(tmp_path_factory)
    cfg = rl_config.model_copy(deep=True)
    cfg.topics.partitions = 1  # one keyed baseline (baselines are per partition)
    cfg.streams.min_reward_diff = 0.0  # equal rewards of the forced calls still train
    cfg.learner = cfg.learner.model_copy(update={
        "model": str(base_dir), "lora": cfg.learner.lora.model_copy(update={"enabled": True}),
        "groups_per_step": len(CHOICES) - 1, "publish_every": 1, "total_steps": 1, "device": "cpu",
        "lease_ttl_s": 10.0, "run_ids": [cfg.run_id], "output_dir": tmp_path / "learner", "baseline_min_count": 1})
    cfg.inference.url = vllm.url
    cfg.inference.worker_id = "tool-agent-sync"
    cfg.inference.weights_roots = [str(tmp_path / "learner")]
    cfg.inference.served_model = SERVED_MODEL
    asyncio.run(prepare_topics(cfg))
    names = TopicNames.from_config(cfg.topics)
    # every single after the first trains (learner.baseline_min_count 1): the first starts its task's baseline
    worker = Worker(cfg, "w1", tmp_path, **{"streams.min_reward_diff": 0.0, "streams.session_idle_s": 120,
                                            "learner.baseline_min_count": 1}).start()
    try:
        examples = tool_dataset(len(CHOICES), seed=3)
        episodes = asyncio.run(_sessions(cfg, names, vllm, examples))
        scores = [tool_reward(example, episode) for example, episode in zip(examples, episodes)]
        rewards = [score["reward"] for score in scores]
        for episode, score, choice in zip(episodes, scores, CHOICES):
            assert episode.error is None, episode.error
            forced = choice == "required"
            assert (len(episode.calls), len(episode.tool_results)) == ((1, 1) if forced else (0, 0))
            assert score["tool_call_parsed"] == float(forced)  # the verifier saw the call (and no call without it)

        events = [e for _, e in asyncio.run(read_all(cfg, names.trajectories, TrajectoryEvent, expect=len(CHOICES),
                                                      timeout_s=90, quiet_s=1))]
        by_session = {f"tool-session-{i}": e for e in events for i in range(len(CHOICES))
                      if e.metadata["session_id"].endswith(f"tool-session-{i}")}
        assert len(events) == len(by_session) == len(CHOICES), worker.log_tail()
        for i, (episode, choice) in enumerate(zip(episodes, CHOICES)):
            event = by_session[f"tool-session-{i}"]
            roles = [m.role for m in event.messages]
            if choice == "none":  # the negative control: one call answering the question, no tool message of its own
                assert roles[-2:] == ["user", "assistant"] and not event.messages[-1].tool_calls, roles
                assert roles.count("tool") == DEMONSTRATED_RESULTS and len(event.turns) == 1, roles
                continue
            assert roles.count("tool") == DEMONSTRATED_RESULTS + 1, roles
            # the SDK's demonstration exchanges, then this episode's question, call, result and answer
            assert roles[-4:] == ["user", "assistant", "tool", "assistant"], roles
            assert event.messages[-4].content == examples[i]["prompt"]
            (call,) = event.messages[-3].tool_calls
            assert call.name == TOOL_NAME == episode.calls[0].name
            assert json.loads(call.arguments) == json.loads(episode.calls[0].arguments)
            assert set(json.loads(call.arguments)) == {"entity", "attribute"}
            assert event.messages[-2].tool_call_id == call.id and event.messages[-2].content == episode.tool_results[0]
            assert len(event.turns) == 2 and all(t.prompt_token_ids and t.completion_token_ids for t in event.turns)
            assert len(event.turns[1].prompt_token_ids) > len(event.turns[0].prompt_token_ids)

        groups = asyncio.run(read_groups(cfg, names.groups, expect=len(CHOICES) - 1, timeout_s=60, quiet_s=1))
        trajectory_of = {e.trajectory_id: s for s, e in by_session.items()}
        member = {trajectory_of[t.trajectory_id]: (g.group_id, t.reward) for g in groups for t in g.trajectories}
        assert sorted(member) == [f"tool-session-{i}" for i in range(1, len(CHOICES))], worker.log_tail()
        for i in range(1, len(CHOICES)):  # the verifier's reward, sent as feedback through the gateway
            assert member[f"tool-session-{i}"][1] == pytest.approx(rewards[i])

        version, loaded = asyncio.run(_train_and_load(cfg, names))
        assert version.kind == WeightsKind.lora and version.version == 1
        trained = {g.group_id for g in asyncio.run(version_lineage(cfg, 1)).groups}
        assert trained == {group_id for group_id, _ in member.values()}  # the forced-call groups and the control's
        assert adapter_name(cfg.policy, 1) in loaded  # vLLM serves the version (/v1/models)
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()
    print(f"tool-agent data path: {time.monotonic() - started:.0f} s")


async def _sessions(cfg: RlstreamConfig, names: TopicNames, server: VllmServer,
                    examples: list[dict[str, Any]]) -> list[ToolEpisode]:
    """One agent run per example through the gateway, each its own session, then the verifier's reward as
    feedback on that session."""
    publisher = TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards, calls_topic=names.calls)
    await publisher.start()
    gateway = Gateway(GatewaySettings(port=0, upstream_url=server.url, run_id=cfg.run_id, policy=cfg.policy,
                                    served_model=SERVED_MODEL, session_stitching="streams", session_idle_s=120),
                      publisher, access=AccessConfig(api_keys=[KEY]))
    # a forced call on the tiny model's byte-level vocabulary takes 50-67 tokens (300 calls: p50 59, p90 63): a
    # budget of 64 cut about one in 25 short (finish_reason length, no call, no text)
    sampling = SamplingSettings(model=SERVED_MODEL, temperature=0.7, max_tokens=128)
    episodes = []
    try:
        async with serving(gateway) as url:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {KEY}"}) as http:
                for i, (example, choice) in enumerate(zip(examples, CHOICES)):
                    session = f"tool-session-{i}"
                    headers = {"X-Session-Id": session, "X-Rlstream-Task": TASK_NAME}
                    episode = await tool_agent(example, client, sampling, headers, tool_choice=choice)
                    episodes.append(episode)
                    assert (await http.post(f"{url}/v1/sessions/{session}/end")).status_code in (200, 202)
                    reward = tool_reward(example, episode)["reward"]
                    fb = await http.post(f"{url}/v1/feedback", json={"session_id": session, "reward": reward})
                    assert fb.status_code == 202, fb.text
            await client.close()
    finally:
        await publisher.close()
    return episodes


async def _train_and_load(cfg: RlstreamConfig, names: TopicNames) -> tuple[PolicyVersion, list[str]]:
    """One learner step on the groups (a LoRA version), loaded by the sync worker into the vLLM server; returns the
    version and the server's model names while it is loaded. The adapter is unloaded afterwards (the server's base
    weights never change)."""
    backend = VllmBackend(str(cfg.inference.url))
    control = ControlPlane(str(cfg.redis.url))
    stop = asyncio.Event()
    sync = asyncio.create_task(InferenceSyncWorker(cfg, backend, control).run(stop))
    try:
        state = await Learner(cfg, holder="tool-agent-learner").run()
        assert state.step == 1 and state.groups_trained == len(CHOICES) - 1
        base, version = await read_topic(cfg, names.policy_versions, PolicyVersion, expect=2)
        assert base.version == 0  # the base weights, announced before the first step

        async def loaded() -> bool:
            info = (await control.workers(cfg.policy)).get(cfg.inference.worker_id)
            return bool(info and int(info["version"]) == version.version)

        await wait_until(loaded, 60, "the version loaded by the sync worker")
        models = await backend.models()
        return version, models
    finally:
        stop.set()
        await asyncio.wait_for(sync, 30)
        if adapter_name(cfg.policy, 1) in await backend.models():
            await backend.unload_lora(adapter_name(cfg.policy, 1))
        await backend.close()
        await control.close()
