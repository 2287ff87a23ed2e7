"""Shadow sampling against the session's vLLM, broker and Redis: production responses (one per prompt) become
full GRPO groups (the production answer + samples from the policy, all scored by the reward function), the
stream app assembles them, and the learner trains on them."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import yaml

from rlstream.learner.service import Learner
from rlstream.ops.toy import toy_reward
from rlstream.ops.vllm import VllmServer
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.shadow import shadow_id
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import Message, TrajectoryEvent, TrajectoryGroup, TrajectorySource, Turn
from rlstream.schemas.topics import TopicNames
from tests.e2e.vllm_support import SERVED_MODEL, tiny_model_dir, vllm_fixture
from tests.support.learner_helpers import read_whole_topic
from tests.support.streams_helpers import Worker, read_groups

vllm = vllm_fixture()
GROUP_SIZE = 3


def production(cfg: RlstreamConfig, prompt: str, answer: str, task: str) -> TrajectoryEvent:
    """A trajectory as the gateway records one response (group_size 1, source production)."""
    event = TrajectoryEvent(run_id=cfg.run_id, example_id=task, group_id="", group_size=1, generation_index=0,
                            policy=cfg.policy, policy_version=0, source=TrajectorySource.production,
                            messages=[Message(role="user", content=prompt), Message(role="assistant", content=answer)],
                            turns=[Turn(message_index=1, model=SERVED_MODEL)], metadata={"task": task})
    return event.model_copy(update={"group_id": event.trajectory_id})


def test_production_responses_become_shadow_groups_that_the_learner_trains(
    vllm: VllmServer, rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path,
    tmp_path_factory: object,
) -> None:
    cfg = rl_config.model_copy(update={
        "rollout": rl_config.rollout.model_copy(update={"model": SERVED_MODEL, "max_tokens": 6}),
        "learner": rl_config.learner.model_copy(update={
            "model": str(tiny_model_dir(tmp_path_factory)), "device": "cpu", "groups_per_step": 2,
            "total_steps": 1, "publish_every": 1, "output_dir": tmp_path / "learner",
            "lora": rl_config.learner.lora.model_copy(update={"enabled": True})})})
    originals = [production(cfg, "Repeat the letter c.", "ccc", "toy"),
                 production(cfg, "Say b again and again.", "bb a", "toy"),
                 production(cfg, "Repeat the letter d.", "d", "other-task")]

    async def publish() -> None:
        async with TrajectoryPublisher.from_config(cfg.kafka, created_topics.trajectories,
                                                   created_topics.rewards) as pub:
            for event in originals:
                await pub.publish_trajectory(event)

    asyncio.run(publish())
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.run([sys.executable, "-m", "rlstream.cli", "rollout", "shadow", "-c", str(path), "--reward",
                           "rlstream.ops.toy:toy_reward", "--group-size", str(GROUP_SIZE), "--task", "toy",
                           "--base-url", vllm.base_url, "--max-groups", "2", "--duration", "120"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "shadowed 2" in proc.stdout, proc.stdout

    shadow = [e for e in asyncio.run(read_whole_topic(cfg, created_topics.trajectories, TrajectoryEvent))
              if e.source == TrajectorySource.shadow]
    assert len(shadow) == 2 * GROUP_SIZE
    for original in originals[:2]:
        group = sorted((e for e in shadow if e.group_id == f"shadow-{original.trajectory_id}"),
                       key=lambda e: e.generation_index)
        assert [e.generation_index for e in group] == list(range(GROUP_SIZE))
        assert [e.trajectory_id for e in group] == [shadow_id(original.trajectory_id, i) for i in range(GROUP_SIZE)]
        assert group[0].messages == original.messages  # the production answer, scored like the samples
        example = {"prompt": original.messages[0].content}
        for member in group:
            assert member.reward == toy_reward(example, member.messages[-1].content or "")
            assert member.group_size == GROUP_SIZE and member.metadata["shadow_of"] == original.trajectory_id
        assert all(m.turns[0].completion_token_ids for m in group[1:])  # samples carry the served tokens
    assert not any(e.metadata.get("shadow_of") == originals[2].trajectory_id for e in shadow)  # other task

    worker = Worker(cfg, "shadow-w", tmp_path, **{"streams.min_reward_diff": 0}).start()
    try:
        groups = [g for g in asyncio.run(read_groups(cfg, created_topics.groups, expect=2, timeout_s=60))
                  if g.group_id.startswith("shadow-")]
    finally:
        worker.stop()
    assert len(groups) == 2 and all(len(g.trajectories) == GROUP_SIZE and g.baseline is None for g in groups)
    state = asyncio.run(Learner(cfg, holder="shadow-test").run())
    assert state.step == 1 and state.groups_trained == 2
    assert isinstance(groups[0], TrajectoryGroup)
