"""`rlstream up` config composition: toy defaults < user file < -o overrides, plumbing always wins for addresses."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlstream.ops.infra import LocalStack, ServiceProcess
from rlstream.ops.up_config import UpOptions, compose_config, task_inputs
from rlstream.schemas.config import ConfigError, load_config


def _stack() -> LocalStack:
    return LocalStack(kafka=ServiceProcess("kafka", "127.0.0.1:1", external=True),
                      redis=ServiceProcess("redis", "redis://127.0.0.1:2/0", external=True), root="/tmp")


def test_toy_defaults_then_overrides(tmp_path: Path) -> None:
    opts = UpOptions(overrides=[("learner.learning_rate", "0.02"), ("rollout.group_size", "4")])
    cfg, path = compose_config(opts, "run-x", tmp_path, _stack(), tmp_path / "model", "http://127.0.0.1:9", None)
    assert path.exists() and load_config(path) == cfg
    assert cfg.run_id == "run-x" and cfg.policy == "toy"
    assert cfg.learner.learning_rate == 0.02 and cfg.rollout.group_size == 4      # overrides win
    assert cfg.learner.lora.enabled is False and cfg.rollout.reward_function == "rlstream.ops.toy:toy_strict_reward"
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:1" and cfg.redis.url == "redis://127.0.0.1:2/0"
    assert cfg.rollout.base_url == "http://127.0.0.1:9/v1" and cfg.learner.model == str(tmp_path / "model")


def test_user_config_replaces_the_toy_task(tmp_path: Path) -> None:
    user = tmp_path / "mine.yaml"
    user.write_text(yaml.safe_dump({"policy": "mine", "learner": {"model": "/models/mine"},
                                    "rollout": {"workflow": "my.agent:run", "reward_function": "my.agent:score"}}))
    opts = UpOptions(config=user, overrides=[("rollout.concurrency", "3")])
    cfg, _ = compose_config(opts, "run-y", tmp_path, _stack(), None, "http://127.0.0.1:9", None)
    assert cfg.policy == "mine" and cfg.learner.model == "/models/mine"
    assert cfg.rollout.workflow == "my.agent:run" and cfg.rollout.concurrency == 3
    assert cfg.learner.lora.enabled is True  # no toy defaults leak into a user's run


def test_user_config_without_a_model_is_refused(tmp_path: Path) -> None:
    user = tmp_path / "mine.yaml"
    user.write_text(yaml.safe_dump({"rollout": {"workflow": "my.agent:run"}}))
    with pytest.raises(ConfigError, match="learner.model"):
        task_inputs(UpOptions(config=user), tmp_path, load_config(user))


def test_smollm2_toy_run_trains_a_lora_adapter_with_a_small_rate(tmp_path: Path) -> None:
    opts = UpOptions(model="smollm2")
    cfg, _ = compose_config(opts, "run-z", tmp_path, _stack(), tmp_path / "smollm2", "http://127.0.0.1:9", None)
    assert cfg.learner.lora.enabled is True and cfg.learner.learning_rate == 1e-4
    assert cfg.rollout.reward_function == "rlstream.ops.toy:toy_strict_reward"  # still the toy task


def test_the_best_constant_answer_is_what_ignoring_the_instruction_earns() -> None:
    from rlstream.ops.toy import best_constant_answer, toy_reward, toy_strict_reward

    examples = [{"target": "a"}, {"target": "a"}, {"target": "b"}]
    answer, reward = best_constant_answer(examples)
    assert answer == "aaaa"  # the most frequent target
    assert reward == pytest.approx((1 + 1 + toy_reward({"target": "b"}, "aaaa")) / 3)
    assert best_constant_answer(examples, toy_strict_reward) == ("aaaa", pytest.approx(2 / 3))


def test_under_the_default_reward_no_constant_answer_passes_for_skill() -> None:
    """The toy task separates skill from format: on `up`'s held-out prompts a constant answer earns <= 0.2 under the toy run's reward,
    while answering each prompt's own letter earns 1 (the partial-credit reward lets a constant earn 0.56)."""
    from rlstream.ops.toy import best_constant_answer, toy_dataset, toy_reward, toy_strict_reward
    from rlstream.ops.up_config import HELDOUT_SEED, TOY_DEFAULTS

    assert TOY_DEFAULTS["rollout"]["reward_function"] == "rlstream.ops.toy:toy_strict_reward"
    held = toy_dataset(24, seed=HELDOUT_SEED)
    assert best_constant_answer(held, toy_strict_reward)[1] <= 0.2
    assert best_constant_answer(held, toy_reward)[1] > 0.5  # the negative control: the old reward pays for format
    assert all(toy_strict_reward(e, f"{e['target']} {e['target']}") == 1.0 for e in held)
    assert toy_strict_reward(held[0], "") == 0.0 and toy_strict_reward(held[0], "x y") == 0.0


def test_the_copy_corpus_never_holds_a_toy_task_answer() -> None:
    """Pre-training gives a generic copy skill; whatever the model answers the toy prompts before RL is transfer."""
    import random

    from rlstream.ops.toy import TOY_LETTERS, copy_example, toy_target

    rng = random.Random(0)
    pairs = [copy_example(rng) for _ in range(2000)]
    letter_prompts = 0
    for prompt, answer in pairs:
        try:
            letter = toy_target({"prompt": prompt})
        except ValueError:  # a sequence copy: its letters are any of a-z, in a different prompt form
            assert answer.replace(" ", "") and answer in prompt
            continue
        letter_prompts += 1
        assert letter not in TOY_LETTERS and set(answer.replace(" ", "")) == {letter}
    assert 800 < letter_prompts < 1200  # both halves are there


def test_production_traffic_trains_larger_steps_of_single_responses(tmp_path: Path) -> None:
    synthetic, _ = compose_config(UpOptions(), "run-s", tmp_path, _stack(), tmp_path / "m", "http://127.0.0.1:9", None)
    production, _ = compose_config(UpOptions(traffic="production"), "run-p", tmp_path, _stack(), tmp_path / "m",
                                   "http://127.0.0.1:9", None)
    assert synthetic.learner.groups_per_step == 8 and production.learner.groups_per_step == 32
    overridden, _ = compose_config(UpOptions(traffic="production", overrides=[("learner.groups_per_step", "4")]),
                                   "run-o", tmp_path, _stack(), tmp_path / "m", "http://127.0.0.1:9", None)
    assert overridden.learner.groups_per_step == 4  # -o still wins
