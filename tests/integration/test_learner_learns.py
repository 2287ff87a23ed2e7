"""The toy task: held-out reward rises after training from groups that flowed through Kafka.

A small rollout loop stands in for the rollout runner: it samples completions with transformers ``generate``
from the latest published version (behaviour logprobs recorded), scores them with the toy reward, and sends
TrajectoryGroups to ``groups``; the learner (the real service) trains and publishes each step.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from rlstream.learner.publish import load_published
from rlstream.learner.service import Learner
from rlstream.transport.control import ControlPlane
from rlstream.ops.toy import held_out_toy_reward, sample_completions, toy_dataset, toy_reward
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from tests.support.learner_helpers import make_group, produce_groups, tiny_model

GROUP_SIZE, PROMPTS_PER_STEP, STEPS, MAX_NEW = 4, 8, 24, 8


def test_toy_reward_rises_on_held_out_prompts(rl_config: RlstreamConfig, created_topics: TopicNames,
                                              tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model(tmp_path)
    cfg = rl_config.model_copy(update={"learner": rl_config.learner.model_copy(update={
        "model": str(model_dir), "lora": rl_config.learner.lora.model_copy(update={"enabled": False}),
        "learning_rate": 1e-2, "groups_per_step": PROMPTS_PER_STEP, "micro_batch_size": 16, "publish_every": 1,
        "checkpoint_every": 1000, "total_steps": STEPS, "device": "cpu", "lease_ttl_s": 10.0})})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    train, held = toy_dataset(STEPS * PROMPTS_PER_STEP, seed=1), toy_dataset(24, seed=999)
    before = held_out_toy_reward(base, tokenizer, held)

    async def scenario() -> str:
        learner = Learner(cfg, holder="toy")
        task = asyncio.create_task(learner.run())
        control = ControlPlane(cfg.redis.url)
        model, version = base, 0
        try:
            for step in range(STEPS):
                batch = train[step * PROMPTS_PER_STEP:(step + 1) * PROMPTS_PER_STEP]
                rollouts = await asyncio.to_thread(sample_completions, model, tokenizer, batch, GROUP_SIZE, step,
                                                   MAX_NEW)
                groups = [make_group(policy=cfg.policy, run_id=cfg.run_id, example_id=ex["id"], prompt_ids=prompt,
                                     completions=comps, rewards=[toy_reward(ex, t) for t in texts], version=version)
                          for ex, (prompt, comps, texts) in zip(batch, rollouts)]
                await produce_groups(cfg, groups)
                while await control.latest_version(cfg.policy) < step + 1:  # wait for the new version
                    assert not task.done(), task
                    await asyncio.sleep(0.05)
                latest = await control.latest(cfg.policy)
                version = int(latest["version"])
                model = (await asyncio.to_thread(load_published, Path(latest["uri"]))).eval()
            await asyncio.wait_for(task, timeout=60)
            return latest["uri"]
        finally:
            await control.close()

    final_uri = asyncio.run(scenario())
    after = held_out_toy_reward(load_published(Path(final_uri)).eval(), tokenizer, held)
    assert after >= before + 0.15, (before, after)
    assert after >= 1.5 * before, (before, after)
