"""``nat finetune`` with rlstream's components, run by the real ``nvidia-nat`` CLI (tier ``nat``), and the same
config run by ``rlstream finetune``, which must give the same outputs.

The seed's Basic Configuration with only the three ``_type``s and the adapter's ``backend`` changed: a NAT
workflow (``rlstream_toy_letters``: a forced tool call, the tool's result, then the answer, through NAT's
LangChain wrapper of ``training_llm``), a custom evaluator as the reward, the session's vLLM, broker and Redis.
One example's evaluator score is NaN: its trajectories are dead-lettered and the rest trains.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlstream.finetune.outputs import (CURRICULUM_KEYS, CURRICULUM_STATE, EPOCH_KEYS, REWARD_HISTORY, REWARD_KEYS,
                                       REWARD_PLOT, TRAINING_METRICS, VALIDATION_HISTORY, VALIDATION_KEYS)
from rlstream.nat.examples import NAN_ANSWER, toy_nat_dataset
from rlstream.ops.vllm import VllmServer
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, PolicyVersion, TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from tests.support.learner_helpers import read_whole_topic
from tests.e2e.vllm_support import SERVED_MODEL, tiny_model_dir, vllm_fixture

pytestmark = pytest.mark.nat
vllm = vllm_fixture()
EPOCHS = 2
GENERATIONS = 3
EXAMPLES = 3
VALIDATION_EXAMPLES = 2


def rlstream_file(rl_config: RlstreamConfig, model_dir: Path) -> dict[str, Any]:
    """The rlstream deployment the adapter's backend names: the session's services, a LoRA learner."""
    data = rl_config.model_dump(mode="json")
    data["learner"].update({"device": "cpu", "learning_rate": 1e-3, "groups_per_step": 2,
                            "lora": {"enabled": True, "r": 8, "alpha": 16, "dropout": 0.0,
                                     "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}})
    data["finetuning"].update({"group_timeout_s": 10.0, "load_timeout_s": 120.0})
    return data


def nat_config(base_url: str, dataset: Path, output_dir: Path, rlstream_yaml: Path, model_dir: Path) -> dict:
    """The seed's Basic Configuration; only the three _types and the adapter's backend differ."""
    return {
        "llms": {"training_llm": {"_type": "openai", "model_name": SERVED_MODEL, "base_url": base_url,
                                  "api_key": "default", "temperature": 1.0}},
        "workflow": {"_type": "rlstream_toy_letters", "llm": "training_llm", "use_tool": True},
        "eval": {"general": {"max_concurrency": 8, "output_dir": str(output_dir / "eval"),
                             "dataset": {"_type": "json", "file_path": str(dataset)}},
                 "evaluators": {"my_reward": {"_type": "rlstream_toy_reward"}}},
        "trajectory_builders": {"rl_builder": {"_type": "rlstream_traj_builder", "num_generations": GENERATIONS}},
        "trainer_adapters": {"rl_adapter": {"_type": "rlstream_trainer_adapter",
                                            "backend": {"config_file": str(rlstream_yaml),
                                                        "base_model": str(model_dir)},
                                            "training": {"learning_rate": 1e-3}}},
        "trainers": {"rl_trainer": {"_type": "rlstream_trainer"}},
        "finetuning": {"enabled": True, "trainer": "rl_trainer", "trajectory_builder": "rl_builder",
                       "trainer_adapter": "rl_adapter", "reward_function": {"name": "my_reward"},
                       "target_model": "training_llm", "num_epochs": 1, "output_dir": str(output_dir / "out")},
    }


#: the same run started two ways: NAT's own CLI, and ``rlstream finetune`` (which hands a NAT config to NAT)
COMMANDS = {"nat": [str(Path(sys.executable).with_name("nat")), "finetune"],
            "rlstream": [sys.executable, "-m", "rlstream.cli", "finetune"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_nat_finetune_trains_through_kafka_with_tool_calls_and_a_poisoned_example(
    command: str, vllm: VllmServer, rl_config: RlstreamConfig, tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = tiny_model_dir(tmp_path_factory)
    rows = toy_nat_dataset(EXAMPLES, seed=0) + [{"id": "poisoned", "question": "Repeat the letter a.",
                                                 "answer": NAN_ANSWER}]
    train = tmp_path / "train.json"
    train.write_text(json.dumps(rows))
    held_out = tmp_path / "validation.json"
    held_out.write_text(json.dumps(toy_nat_dataset(VALIDATION_EXAMPLES, seed=1000)))
    rlstream_yaml = tmp_path / "rlstream.yaml"
    rlstream_yaml.write_text(yaml.safe_dump(rlstream_file(rl_config, model_dir), sort_keys=False))
    config = tmp_path / "nat.yml"
    config.write_text(yaml.safe_dump(nat_config(vllm.base_url, train, tmp_path, rlstream_yaml, model_dir)))
    cmd = [*COMMANDS[command], "--config_file", str(config), "--validation_dataset", str(held_out),
           "--validation_interval", "2", "-o", "finetuning.num_epochs", str(EPOCHS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, cwd=tmp_path)
    (tmp_path / "nat.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    # -- NAT's output files, with NAT's keys; the -o override made it 2 epochs (the file says 1)
    out = tmp_path / "out"
    lines = [json.loads(x) for x in (out / TRAINING_METRICS).read_text().splitlines()]
    assert [r["epoch"] for r in lines] == list(range(EPOCHS))
    for r in lines:
        assert set(r) == set(EPOCH_KEYS)
        # the poisoned example's NaN scores count in no reward statistic (its group is there, empty)
        assert r["num_groups"] == EXAMPLES + 1 and r["num_trajectories"] == EXAMPLES * GENERATIONS
        assert 0.0 <= r["min_reward"] <= r["avg_reward"] <= r["max_reward"] <= 1.0
    history = json.loads((out / REWARD_HISTORY).read_text())
    assert [set(h) for h in history] == [set(REWARD_KEYS)] * EPOCHS
    validations = json.loads((out / VALIDATION_HISTORY).read_text())
    assert [v["epoch"] for v in validations] == [0, EPOCHS]  # epoch 0, then the final model
    assert all(set(v) == set(VALIDATION_KEYS) and v["num_examples"] == VALIDATION_EXAMPLES for v in validations)
    assert set(json.loads((out / CURRICULUM_STATE).read_text())) == set(CURRICULUM_KEYS)
    assert (out / REWARD_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # -- Kafka: one version per epoch, each trained on the 3 good groups (the NaN example was dead-lettered)
    topics = TopicNames.from_config(rl_config.topics)
    versions = [v for v in asyncio.run(read_whole_topic(rl_config, topics.policy_versions, PolicyVersion))
                if v.policy == rl_config.policy]
    assert [v.version for v in versions] == [1, 2]
    assert [v.group_count for v in versions] == [EXAMPLES, EXAMPLES]
    letters = [d for d in asyncio.run(read_whole_topic(rl_config, topics.dlq, DeadLetter)) if d.service == "nat-adapter"]
    assert len(letters) == EPOCHS * GENERATIONS
    assert all("non-finite reward" in d.error_message and d.key and b"poisoned" in d.key for d in letters)

    # -- the tool calls reached Kafka as tool calls; epoch 1 generated with version 1 (vLLM loaded it and the
    # builder routed training_llm to it)
    events = [t for t in asyncio.run(read_whole_topic(rl_config, topics.trajectories, TrajectoryEvent))
              if t.policy == rl_config.policy]
    assert len(events) == EPOCHS * EXAMPLES * GENERATIONS
    for event in events:
        assert [m.role for m in event.messages] == ["user", "assistant", "tool", "assistant"]
        call = event.messages[1].tool_calls[0]
        assert call.name == "pick_letter" and event.messages[2].tool_call_id == call.id
        assert [t.message_index for t in event.turns] == [1, 3]
    assert {e.policy_version for e in events if e.metadata["nat_run_id"].endswith("_epoch_0")} == {0}
    assert {e.policy_version for e in events if e.metadata["nat_run_id"].endswith("_epoch_1")} == {1}

    # -- token ids and logprobs come from vLLM's responses (the builder's capturing twin of training_llm), not from
    # re-rendering: every turn has them, and the learner trains exactly the sampled tokens
    from transformers import AutoTokenizer

    from rlstream.learner.batch import samples_from_trajectory

    for event in events:
        tool_turn, answer_turn = event.turns
        for turn in event.turns:
            assert turn.prompt_token_ids and turn.completion_token_ids, event.trajectory_id
        # the forced tool call's logprobs are vLLM's grammar-masked ones: dropped; the free answer keeps its own
        assert tool_turn.completion_logprobs is None
        assert answer_turn.completion_logprobs and \
            len(answer_turn.completion_logprobs) == len(answer_turn.completion_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    event = events[0]
    first, second = samples_from_trajectory(event, 0, tokenizer, ["<workflow>"], None)
    assert first.completion_ids == event.turns[0].completion_token_ids and second.behaviour_logprobs is not None
    call = event.messages[1].tool_calls[0]
    # the first turn's completion is the tool call as the model generated it (vLLM's forced named tool call: the
    # arguments), and the second turn's prompt holds that call as the chat template rendered it
    assert json.loads(tokenizer.decode(first.completion_ids, skip_special_tokens=True)) == json.loads(call.arguments)
    assert "pick_letter" in tokenizer.decode(second.prompt_ids)
    assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
