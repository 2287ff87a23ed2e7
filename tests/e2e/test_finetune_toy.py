"""``rlstream finetune`` end to end on the toy task: real broker, Redis, streams worker (child process), vLLM
(the session's shared server; LoRA versions, so its base model is never changed) and the in-process learner.

One run of 3 epochs, started through the CLI with ``-o`` overrides over a config file that says otherwise,
so the same run shows that overrides change it."""
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
from rlstream.transport.metric_names import (CURRICULUM_PERCENTILE, REWARD_MEAN, REWARD_MEAN_FILTERED, STEP_EPOCH, STEP_TAG,
                              VALIDATION_REWARD_MEAN)
from rlstream.ops.toy import toy_dataset
from rlstream.rollout.sampling import SamplingSettings
from rlstream.ops.vllm import VllmServer
from rlstream.schemas.config import CurriculumConfig, RlstreamConfig
from rlstream.schemas.models import MetricEvent, PolicyVersion, TrajectoryEvent, TrajectoryGroup, TrajectorySource
from rlstream.schemas.topics import TopicNames
from rlstream.streams.curriculum import keep_count, percentile_schedule
from tests.support.learner_helpers import read_whole_topic
from tests.e2e.vllm_support import SERVED_MODEL, tiny_model_dir, vllm_fixture

vllm = vllm_fixture()
FLAKY_EXAMPLE = "toy-0-0"
_failed: set[str] = set()


async def flaky_single_turn(example: dict[str, Any], client: Any, sampling: SamplingSettings) -> str:
    """The reference workflow, except that the first generation of FLAKY_EXAMPLE fails (once per process)."""
    from rlstream.rollout.workflows import single_turn

    if example["id"] == FLAKY_EXAMPLE and FLAKY_EXAMPLE not in _failed:
        _failed.add(FLAKY_EXAMPLE)
        raise ConnectionError("simulated failed generation")
    return await single_turn(example, client, sampling)


EPOCHS = 3
EXAMPLES = 4
GENERATIONS = 4
VALIDATION_EXAMPLES = 3


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def file_config(rl_config: RlstreamConfig, model_dir: Path, output_dir: Path) -> dict[str, Any]:
    """The config file: says 1 epoch and the default expansion interval; the command line overrides both."""
    data = rl_config.model_dump(mode="json")
    data["finetuning"].update({
        "num_epochs": 1, "num_generations": GENERATIONS, "output_dir": str(output_dir), "group_timeout_s": 10.0,
        "load_timeout_s": 120.0,
        "curriculum_learning": {"enabled": True, "initial_percentile": 0.3, "increment_percentile": 0.2,
                                "expansion_interval": 5, "min_reward_diff": 0.0},
    })
    data["learner"].update({"model": str(model_dir), "device": "cpu", "learning_rate": 1e-3, "groups_per_step": 2,
                            "lora": {"enabled": True, "r": 8, "alpha": 16, "dropout": 0.0,
                                     "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}})
    data["rollout"].update({"workflow": "tests.e2e.test_finetune_toy:flaky_single_turn",
                            "reward_function": "rlstream.ops.toy:toy_reward", "model": SERVED_MODEL, "max_tokens": 8, "temperature": 1.0, "concurrency": 8})
    data["inference"].update({"served_model": SERVED_MODEL})
    return data


def test_finetune_runs_epochs_writes_outputs_and_follows_the_curriculum(
    vllm: VllmServer, rl_config: RlstreamConfig, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = tiny_model_dir(tmp_path_factory)
    output_dir = tmp_path / "out"
    config_path = tmp_path / "finetune.yaml"
    config_path.write_text(yaml.safe_dump(file_config(rl_config, model_dir, output_dir), sort_keys=False))
    train = write_jsonl(tmp_path / "train.jsonl", toy_dataset(EXAMPLES, seed=0))
    held_out = write_jsonl(tmp_path / "validation.jsonl", toy_dataset(VALIDATION_EXAMPLES, seed=1000))
    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "rlstream.cli", "--log-format", "json", "finetune", "--config_file", str(config_path),
           "--dataset", str(train), "--validation_dataset", str(held_out), "--validation_interval", "2",
           "--inference_url", vllm.base_url, "--summary_json", str(result),
           "-o", "finetuning.num_epochs", str(EPOCHS), "-o", "finetuning.curriculum_learning.expansion_interval", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=Path(__file__).resolve().parents[2])
    (tmp_path / "finetune.log").write_text(proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    # -- the overrides changed the run: 3 epochs (file: 1) and the schedule of expansion_interval 1 (file: 5)
    overridden = CurriculumConfig(initial_percentile=0.3, increment_percentile=0.2, expansion_interval=1,
                                  min_reward_diff=0.0, enabled=True)
    from_file = overridden.model_copy(update={"expansion_interval": 5})
    expected_schedule = percentile_schedule(overridden, EPOCHS)
    assert expected_schedule == [0.5, 0.7, 0.9]
    assert percentile_schedule(from_file, EPOCHS) != expected_schedule

    # -- training_metrics.jsonl: one line per epoch with exactly the documented keys (+ curriculum_state)
    lines = [json.loads(x) for x in (output_dir / TRAINING_METRICS).read_text().splitlines()]
    assert [r["epoch"] for r in lines] == list(range(EPOCHS))
    for r in lines:
        assert set(r) == set(EPOCH_KEYS) | {"curriculum_state"}
        assert r["run_id"] == rl_config.run_id
        # the failed generation (epoch 0) did not fail the epoch: its group came with the 3 members it had
        failed = 1 if r["epoch"] == 0 else 0
        assert r["num_groups"] == EXAMPLES and r["num_trajectories"] == EXAMPLES * GENERATIONS - failed
        assert r["min_reward"] <= r["avg_reward"] <= r["max_reward"]
    assert [r["curriculum_percentile"] for r in lines] == expected_schedule
    # kept = the first max(1, ceil(n * percentile)) groups by mean reward, highest first
    assert [r["filtered_groups"] for r in lines] == [keep_count(EXAMPLES, p) for p in expected_schedule] == [2, 3, 4]
    for r in lines:
        assert r["filtered_groups"] * GENERATIONS - r["filtered_trajectories"] in ((0, 1) if r["epoch"] == 0 else (0,))
        assert r["filtered_avg_reward"] >= r["avg_reward"] - 1e-9
        assert r["curriculum_state"]["current_percentile"] == r["curriculum_percentile"]
        assert r["curriculum_state"]["last_expansion_epoch"] == r["epoch"]

    # -- reward_history.json / validation_history.json / curriculum_state.json
    history = json.loads((output_dir / REWARD_HISTORY).read_text())
    assert [set(h) for h in history] == [set(REWARD_KEYS)] * EPOCHS
    assert [h["avg_reward"] for h in history] == [r["avg_reward"] for r in lines]
    validations = json.loads((output_dir / VALIDATION_HISTORY).read_text())
    assert [v["epoch"] for v in validations] == [0, 2, EPOCHS]  # every 2 epochs, and after the last one
    for v in validations:
        assert set(v) == set(VALIDATION_KEYS)
        assert v["num_examples"] == VALIDATION_EXAMPLES
        assert 0.0 <= v["min_reward"] <= v["avg_reward"] <= v["max_reward"] <= 1.0
    state = json.loads((output_dir / CURRICULUM_STATE).read_text())
    assert set(state) == set(CURRICULUM_KEYS)
    assert state["current_percentile"] == 0.9 and state["last_expansion_epoch"] == EPOCHS - 1
    assert state["config"]["expansion_interval"] == 1 and state["total_groups"] == EXAMPLES
    assert len(state["included_groups"]) == lines[-1]["filtered_groups"]
    png = (output_dir / REWARD_PLOT).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    summary = json.loads(result.read_text())
    assert summary["epochs"] == EPOCHS and summary["failed_jobs"] == 0

    # -- the Kafka side: one version per epoch, trained on the kept groups only; validation never trained on
    topics = TopicNames.from_config(rl_config.topics)
    versions = [v for v in asyncio.run(read_whole_topic(rl_config, topics.policy_versions, PolicyVersion))
                if v.policy == rl_config.policy]
    assert [v.version for v in versions] == [1, 2, 3]
    assert [v.group_count for v in versions] == [r["filtered_groups"] for r in lines]
    assert all(v.kind.value == "lora" and v.run_id == rl_config.run_id for v in versions)
    groups = [g for g in asyncio.run(read_whole_topic(rl_config, topics.groups, TrajectoryGroup))
              if g.run_id == rl_config.run_id]
    trained_ids = {g.group_id for g in groups if all(t.source == TrajectorySource.rollout for t in g.trajectories)}
    assert len(trained_ids) == EPOCHS * EXAMPLES
    flaky = next(g for g in groups if g.group_id == f"{rl_config.run_id}:{FLAKY_EXAMPLE}:0")
    assert flaky.completion.value == "timeout" and len(flaky.trajectories) == GENERATIONS - 1
    trajectories = [t for t in asyncio.run(read_whole_topic(rl_config, topics.trajectories, TrajectoryEvent))
                    if t.run_id == rl_config.run_id]
    validation = [t for t in trajectories if t.source == TrajectorySource.validation]
    assert len(validation) == 3 * VALIDATION_EXAMPLES
    assert not {t.group_id for t in validation} & trained_ids
    # epochs after the first generate with the version published by the previous epoch
    by_epoch = {e: {t.policy_version for t in trajectories if t.source == TrajectorySource.rollout
                    and t.group_id.endswith(f":{e}")} for e in range(EPOCHS)}
    assert by_epoch == {0: {0}, 1: {1}, 2: {2}}

    # -- MetricEvents with the documented names, step = epoch, tag step_kind=epoch
    metrics = [m for m in asyncio.run(read_whole_topic(rl_config, topics.metrics, MetricEvent))
               if m.run_id == rl_config.run_id and m.source == "finetune"]
    by_name: dict[str, dict[int, float]] = {}
    for m in metrics:
        assert m.tags.get(STEP_TAG) == STEP_EPOCH
        by_name.setdefault(m.name, {})[m.step] = m.value
    assert by_name[REWARD_MEAN] == {r["epoch"]: pytest.approx(r["avg_reward"]) for r in lines}
    assert by_name[REWARD_MEAN_FILTERED] == {r["epoch"]: pytest.approx(r["filtered_avg_reward"]) for r in lines}
    assert by_name[CURRICULUM_PERCENTILE] == dict(enumerate(expected_schedule))
    assert set(by_name[VALIDATION_REWARD_MEAN]) == {0, 2, EPOCHS}
