"""NAT's own documented finetuning configs, moved to rlstream by changing the three finetuning ``_type``s only, run by
the real ``nat finetune`` against one vLLM server (tier ``nat``).

The configs are the documents' text. Besides the three ``_type``s, the workflow's and the evaluator's ``_type``s name
rlstream's toy workflow and reward (the documents' ``my_workflow`` / ``my_custom_evaluator`` are the user's own), and
the command line points the target LLM at the test's vLLM server (``-o llms.<llm>.base_url ... -o
llms.<llm>.model_name ...``) and shortens the run (``-o finetuning.num_epochs``). ``base_model`` is the document's
model id: a local directory of that name holding the tiny model vLLM serves. No broker or Redis is configured, so
every run starts its own; the vLLM server outlives the runs, as it does for users.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from rlstream.finetune.outputs import REWARD_HISTORY, REWARD_PLOT, TRAINING_METRICS
from rlstream.nat.examples import toy_nat_dataset
from rlstream.ops.vllm import VllmServer
from tests.e2e.vllm_support import SERVED_MODEL, tiny_model_dir, vllm_fixture

pytestmark = pytest.mark.nat
vllm = vllm_fixture()
EPOCHS = 2
NAT = str(Path(sys.executable).with_name("nat"))

#: rl_with_openpipe.md, "Basic Configuration", as written
BASIC_CONFIGURATION = """
llms:
  training_llm:
    _type: openai
    model_name: Qwen/Qwen2.5-3B-Instruct
    base_url: http://localhost:8000/v1  # ART inference endpoint
    api_key: default
    temperature: 0.4

workflow:
  _type: my_workflow
  llm: training_llm

eval:
  general:
    max_concurrency: 16
    output_dir: .tmp/nat/finetuning/eval
    dataset:
      _type: json
      file_path: data/training_data.json

  evaluators:
    my_reward:
      _type: my_custom_evaluator

trajectory_builders:
  art_builder:
    _type: openpipe_art_traj_builder
    num_generations: 2

trainer_adapters:
  art_adapter:
    _type: openpipe_art_trainer_adapter
    backend:
      ip: "localhost"
      port: 7623
      name: "my_training_run"
      project: "my_project"
      base_model: "Qwen/Qwen2.5-3B-Instruct"
      api_key: "default"
    training:
      learning_rate: 1e-6

trainers:
  art_trainer:
    _type: openpipe_art_trainer

finetuning:
  enabled: true
  trainer: art_trainer
  trajectory_builder: art_builder
  trainer_adapter: art_adapter
  reward_function:
    name: my_reward
  num_epochs: 20
  output_dir: .tmp/nat/finetuning/output
"""

#: extending_finetuning.md, "Complete YAML Configuration", as written
COMPLETE_CONFIGURATION = """
llms:
  my_model:
    _type: openai
    model_name: gpt-4
    base_url: http://localhost:8000/v1

workflow:
  _type: my_agent_workflow
  llm: my_model

eval:
  general:
    max_concurrency: 8
    output_dir: .tmp/finetuning/eval
    dataset:
      _type: json
      file_path: data/train.json

  evaluators:
    my_reward:
      _type: my_custom_evaluator

trajectory_builders:
  my_builder:
    _type: my_traj_builder
    num_generations: 4
    include_tool_calls: true
    min_episode_length: 3

trainer_adapters:
  my_adapter:
    _type: my_trainer_adapter
    backend:
      endpoint: http://training-server:8080
      api_key: ${TRAINING_API_KEY}
      learning_rate: 1e-5
      batch_size: 8
    validate_trajectories: true

trainers:
  my_trainer:
    _type: my_trainer

finetuning:
  enabled: true
  trainer: my_trainer
  trajectory_builder: my_builder
  trainer_adapter: my_adapter
  reward_function:
    name: my_reward
  num_epochs: 20
  output_dir: .tmp/finetuning/output

  curriculum_learning:
    enabled: true
    initial_percentile: 0.3
    increment_percentile: 0.2
    expansion_interval: 5
"""

#: the only edits: the three finetuning _types, and the user's own workflow and evaluator
TYPES = {"openpipe_art_traj_builder": "rlstream_traj_builder", "my_traj_builder": "rlstream_traj_builder",
         "openpipe_art_trainer_adapter": "rlstream_trainer_adapter", "my_trainer_adapter": "rlstream_trainer_adapter",
         "openpipe_art_trainer": "rlstream_trainer", "my_trainer": "rlstream_trainer",
         "my_workflow": "rlstream_toy_letters", "my_agent_workflow": "rlstream_toy_letters",
         "my_custom_evaluator": "rlstream_toy_reward"}


def with_rlstream_types(text: str) -> str:
    """The document's config with each ``_type`` in :data:`TYPES` replaced, nothing else touched."""
    return re.sub(r"(_type: )(\w+)", lambda m: m.group(1) + TYPES.get(m.group(2), m.group(2)), text)


def run_nat(workdir: Path, config_text: str, llm: str, server: VllmServer, *extra: str) -> subprocess.CompletedProcess:
    config = workdir / "config.yml"
    config.write_text(config_text if "rlstream_trainer" in config_text else with_rlstream_types(config_text))
    cmd = [NAT, "finetune", "--config_file", str(config), "-o", "finetuning.num_epochs", str(EPOCHS),
           "-o", f"llms.{llm}.base_url", server.base_url, "-o", f"llms.{llm}.model_name", SERVED_MODEL, *extra]
    # the extending guide's LLM has no api_key: like its users, the environment carries one (vLLM checks none)
    env = {**os.environ, "TRAINING_API_KEY": "unused", "OPENAI_API_KEY": "unused"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=workdir, env=env)
    with open(workdir / "nat.log", "a") as log_file:
        log_file.write(proc.stdout + proc.stderr)
    return proc


def served_names(server: VllmServer) -> list[str]:
    return [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]


def assert_trained_every_epoch(proc: subprocess.CompletedProcess, output_dir: Path) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert "Finetuning completed successfully!" in text
    assert len(re.findall(r"Message: version \d+ trained and served", text)) == EPOCHS, text[-4000:]
    lines = [json.loads(x) for x in (output_dir / TRAINING_METRICS).read_text().splitlines()]
    assert [r["epoch"] for r in lines] == list(range(EPOCHS))
    assert len(json.loads((output_dir / REWARD_HISTORY).read_text())) == EPOCHS
    assert (output_dir / REWARD_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_openpipe_basic_configuration_runs_twice_on_one_vllm(vllm: VllmServer, tmp_path: Path,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    # the document's model id, as a local directory holding the tiny model vLLM serves
    shutil.copytree(tiny_model_dir(tmp_path_factory), tmp_path / "Qwen" / "Qwen2.5-3B-Instruct")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "training_data.json").write_text(json.dumps(toy_nat_dataset(3, seed=0)))
    before = set(served_names(vllm))
    first = run_nat(tmp_path, BASIC_CONFIGURATION, "training_llm", vllm)
    # ART's server keys are warned about by name, with what rlstream uses instead
    for key in ("backend.ip", "backend.port", "backend.api_key"):
        assert f"key={key}" in first.stdout + first.stderr
    assert_trained_every_epoch(first, tmp_path / ".tmp" / "nat" / "finetuning" / "output")
    assert {json.loads(x)["num_groups"] for x in (tmp_path / ".tmp" / "nat" / "finetuning" / "output" /
                                                   TRAINING_METRICS).read_text().splitlines()} == {3}
    # the second run takes NAT's --dataset (2 examples instead of the config's 3)
    (tmp_path / "other.json").write_text(json.dumps(toy_nat_dataset(2, seed=7)))
    second = run_nat(tmp_path, BASIC_CONFIGURATION, "training_llm", vllm, "--dataset", "other.json")
    assert_trained_every_epoch(second, tmp_path / ".tmp" / "nat" / "finetuning" / "output")
    assert {json.loads(x)["num_groups"] for x in (tmp_path / ".tmp" / "nat" / "finetuning" / "output" /
                                                   TRAINING_METRICS).read_text().splitlines()} == {2}
    # each run's versions have their own adapter names (project prefix, a per-run id): none was refused
    runs = {n.rsplit("-v", 1)[0] for n in set(served_names(vllm)) - before if n.startswith("my_project-")}
    assert len(runs) == 2, served_names(vllm)


def test_extending_complete_configuration(vllm: VllmServer, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text(json.dumps(toy_nat_dataset(4, seed=3)))
    # base_model is not in this config: the model vLLM serves is trained (its /v1/models). The workflow makes its
    # tool call (4 messages: the guide's min_episode_length 3 drops the 2-message episodes of the plain workflow),
    # and the curriculum keeps groups without a reward spread too (min_reward_diff 0), so that every epoch trains
    proc = run_nat(tmp_path, COMPLETE_CONFIGURATION, "my_model", vllm, "-o", "workflow.use_tool", "true",
                   "-o", "finetuning.curriculum_learning.min_reward_diff", "0")
    for key in ("backend.endpoint", "backend.api_key"):
        assert f"key={key}" in proc.stdout + proc.stderr
    assert_trained_every_epoch(proc, tmp_path / ".tmp" / "finetuning" / "output")


def basic_configuration_with(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, **adapter: object) -> str:
    """The Basic Configuration (rlstream _types) with more trainer adapter keys, its model and dataset in place."""
    model = tmp_path / "Qwen" / "Qwen2.5-3B-Instruct"
    if not model.exists():
        shutil.copytree(tiny_model_dir(tmp_path_factory), model)
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "training_data.json").write_text(json.dumps(toy_nat_dataset(2, seed=5)))
    config = yaml.safe_load(with_rlstream_types(BASIC_CONFIGURATION))
    config["trainer_adapters"]["art_adapter"].update(adapter)
    return yaml.safe_dump(config)


@pytest.mark.parametrize("continue_on_failure", [False, True])
def test_a_version_vllm_refuses_fails_the_job_at_once_with_vllms_reason(
        continue_on_failure: bool, vllm: VllmServer, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # LoRA rank 16 on a server started with --max-lora-rank 8: vLLM refuses every version
    config = basic_configuration_with(tmp_path, tmp_path_factory, continue_on_failure=continue_on_failure,
                                      backend={"base_model": "Qwen/Qwen2.5-3B-Instruct",
                                               "settings": {"learner.lora.r": 16, "learner.lora.alpha": 32}})
    proc = run_nat(tmp_path, config, "training_llm", vllm)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-4000:]
    assert "Finetuning completed successfully" not in text
    assert re.search(r"version 1 published but vLLM did not load it: .*max_lora_rank", text), text[-4000:]
    epochs = (tmp_path / ".tmp" / "nat" / "finetuning" / "output" / TRAINING_METRICS).read_text().splitlines()
    if continue_on_failure:  # every epoch ran; the run still exits non-zero and says why
        assert len(epochs) == EPOCHS and f"{EPOCHS} of {EPOCHS} epochs failed" in text
    else:  # stopped at the first failed epoch, as ART's trainer does
        assert len(epochs) == 1 and "epoch 0 failed" in text and "continue_on_failure" in text
    # reported when vLLM answered, not after finetuning.load_timeout_s (300 s)
    assert "within 300 s" not in text


def test_an_epoch_where_every_generation_fails_stops_the_run(vllm: VllmServer, tmp_path: Path,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    config = basic_configuration_with(tmp_path, tmp_path_factory)
    # questions longer than the model's context: vLLM answers 400 to every call, no workflow run has a turn
    rows = [{"id": f"long-{i}", "question": "Repeat the letter a. " * 600, "answer": "a"} for i in range(2)]
    (tmp_path / "data" / "training_data.json").write_text(json.dumps(rows))
    proc = run_nat(tmp_path, config, "training_llm", vllm)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-4000:]
    assert "epoch 0: every generation failed, nothing to train on" in text, text[-4000:]
    assert not (tmp_path / ".tmp" / "nat" / "finetuning" / "output" / TRAINING_METRICS).read_text().strip()


@pytest.mark.parametrize("case", ["typo", "missing dataset", "empty --dataset"])
def test_config_and_dataset_mistakes_exit_non_zero_at_once(case: str, tmp_path: Path) -> None:
    """No vLLM needed: these stop before anything starts (the base_url is never called)."""
    config = yaml.safe_load(with_rlstream_types(BASIC_CONFIGURATION))
    extra: list[str] = []
    expected = ""
    if case == "typo":
        config["trajectory_builders"]["art_builder"]["num_generation"] = 3
        expected = "unknown key 'num_generation' (did you mean 'num_generations'?)"
    elif case == "missing dataset":
        expected = f"the dataset file data/training_data.json does not exist (in {tmp_path})"
    else:
        (tmp_path / "empty.json").write_text("[]")
        extra = ["--dataset", str(tmp_path / "empty.json")]
        expected = f"the dataset file {tmp_path / 'empty.json'} has no rows (--dataset)"
    (tmp_path / "config.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([NAT, "finetune", "--config_file", str(tmp_path / "config.yml"), *extra],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
