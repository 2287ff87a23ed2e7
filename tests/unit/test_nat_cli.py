"""``rlstream finetune`` tells a NAT config from an rlstream one, gives NAT's options NAT's meanings, and says
what to install when NAT is missing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from rlstream.cli.app import app
from rlstream.cli.finetune import is_nat_config

#: the seed's Basic Configuration (rl_with_openpipe.md), with rlstream's three _types and backend
SEED_BASIC = {
    "llms": {"training_llm": {"_type": "openai", "model_name": "Qwen/Qwen2.5-3B-Instruct",
                              "base_url": "http://localhost:8000/v1", "api_key": "default", "temperature": 0.4}},
    "workflow": {"_type": "my_workflow", "llm": "training_llm"},
    "eval": {"general": {"max_concurrency": 16, "output_dir": ".tmp/nat/finetuning/eval",
                         "dataset": {"_type": "json", "file_path": "data/training_data.json"}},
             "evaluators": {"my_reward": {"_type": "my_custom_evaluator"}}},
    "trajectory_builders": {"rl_builder": {"_type": "rlstream_traj_builder", "num_generations": 2}},
    "trainer_adapters": {"rl_adapter": {"_type": "rlstream_trainer_adapter",
                                        "backend": {"bootstrap_servers": "localhost:9092"}}},
    "trainers": {"rl_trainer": {"_type": "rlstream_trainer"}},
    "finetuning": {"enabled": True, "trainer": "rl_trainer", "trajectory_builder": "rl_builder",
                   "trainer_adapter": "rl_adapter", "reward_function": {"name": "my_reward"}, "num_epochs": 20,
                   "output_dir": ".tmp/nat/finetuning/output"},
}


def write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_nat_and_rlstream_configs_are_told_apart(tmp_path: Path) -> None:
    assert is_nat_config(write(tmp_path, "nat.yml", SEED_BASIC))
    assert not is_nat_config(write(tmp_path, "rl.yml", {"finetuning": {"num_epochs": 2}, "learner": {"model": "m"}}))
    assert not is_nat_config(write(tmp_path, "plain.yml", {"finetuning": {"num_epochs": 2}}))
    assert not is_nat_config(tmp_path / "missing.yml")


def test_nat_options_are_refused_on_an_rlstream_config(tmp_path: Path) -> None:
    config = write(tmp_path, "rl.yml", {"finetuning": {"num_epochs": 1}})
    runner = CliRunner()
    endpoint = runner.invoke(app, ["finetune", "--config_file", str(config), "--endpoint", "http://x:8000"])
    assert endpoint.exit_code == 2 and "--inference_url" in endpoint.output
    jsonpath = runner.invoke(app, ["finetune", "--config_file", str(config), "--result_json_path", "$.answer"])
    assert jsonpath.exit_code == 2 and "--summary_json" in jsonpath.output


def test_a_nat_config_without_nat_installed_names_the_extra(tmp_path: Path) -> None:
    config = write(tmp_path, "nat.yml", SEED_BASIC)
    hide_nat = ("import sys; sys.modules['nat'] = None; sys.argv = ['rlstream', 'finetune', '--config_file', "
                f"{str(config)!r}]; from rlstream.cli.app import main; main()")
    proc = subprocess.run([sys.executable, "-c", hide_nat], capture_output=True, text=True, timeout=120)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2
    assert "is a NeMo Agent Toolkit config" in said and "pip install 'rlstream[nat]'" in said


def test_the_seed_config_with_rlstream_types_validates_in_nat() -> None:
    """NAT itself accepts the config: rlstream's three _types are registered through the entry point (the
    workflow and evaluator are swapped for rlstream's examples, which are registered too)."""
    from nat.data_models.config import Config
    from nat.runtime.loader import PluginTypes, discover_and_register_plugins
    from nat.utils.data_models.schema_validator import validate_schema

    discover_and_register_plugins(PluginTypes.CONFIG_OBJECT)
    data = {**SEED_BASIC, "workflow": {"_type": "rlstream_toy_letters", "llm": "training_llm"},
            "eval": {**SEED_BASIC["eval"], "evaluators": {"my_reward": {"_type": "rlstream_toy_reward"}}}}
    config = validate_schema(data, Config)
    adapter = config.trainer_adapters["rl_adapter"]
    assert type(adapter).__name__ == "RlstreamTrainerAdapterConfig"
    assert adapter.backend.bootstrap_servers == "localhost:9092"
    assert type(config.trajectory_builders["rl_builder"]).__name__ == "RlstreamTrajectoryBuilderConfig"
