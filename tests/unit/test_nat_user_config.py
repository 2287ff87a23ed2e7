"""The three rlstream NAT blocks as NAT users write them: ART's and the extending guide's keys, typos, base_model,
datasets and ``--endpoint`` (NAT's own config loading; no services)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from nat.data_models.config import Config
from nat.data_models.finetuning import FinetuneConfig, FinetuneRunConfig
from nat.runtime.loader import PluginTypes, discover_and_register_plugins
from nat.utils.data_models.schema_validator import validate_schema

from rlstream.nat import keys
from rlstream.nat.adapter import RlstreamTrainerAdapter
from rlstream.nat.base_model import resolve_base_model
from rlstream.nat.config import RlstreamTrainerAdapterConfig
from rlstream.nat.nat_config import NatConfigError
from rlstream.nat.trainer import check_run

pytestmark = pytest.mark.unit
discover_and_register_plugins(PluginTypes.CONFIG_OBJECT)

ART_ADAPTER = {"_type": "rlstream_trainer_adapter",
               "backend": {"ip": "localhost", "port": 7623, "name": "my_training_run", "project": "my_project",
                           "base_model": "Qwen/Qwen2.5-3B-Instruct", "api_key": "default"},
               "training": {"learning_rate": "1e-6"}}


def nat_config(builder: dict[str, Any] | None = None, adapter: dict[str, Any] | None = None,
               trainer: dict[str, Any] | None = None, dataset: str = "data/train.json") -> dict[str, Any]:
    return {
        "llms": {"training_llm": {"_type": "openai", "model_name": "m", "base_url": "http://127.0.0.1:9/v1"}},
        "workflow": {"_type": "rlstream_toy_letters", "llm": "training_llm"},
        "eval": {"general": {"dataset": {"_type": "json", "file_path": dataset}},
                 "evaluators": {"my_reward": {"_type": "rlstream_toy_reward"}}},
        "trajectory_builders": {"b": builder or {"_type": "rlstream_traj_builder"}},
        "trainer_adapters": {"a": adapter or {"_type": "rlstream_trainer_adapter"}},
        "trainers": {"t": trainer or {"_type": "rlstream_trainer"}},
        "finetuning": {"enabled": True, "trainer": "t", "trajectory_builder": "b", "trainer_adapter": "a",
                       "reward_function": {"name": "my_reward"}},
    }


def validation_error(data: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as caught:  # NAT's validate_schema: a ValueError listing pydantic's errors
        validate_schema(data, Config)
    return str(caught.value)


def test_art_backend_keys_are_accepted_mapped_and_the_unused_ones_warned_about() -> None:
    keys._warned.clear()
    with structlog.testing.capture_logs() as logs:
        config = validate_schema(nat_config(adapter=ART_ADAPTER), Config)
    adapter = config.trainer_adapters["a"]
    assert isinstance(adapter, RlstreamTrainerAdapterConfig)
    assert adapter.backend.name == "my_training_run" and adapter.backend.project == "my_project"
    assert adapter.backend.base_model == "Qwen/Qwen2.5-3B-Instruct"
    assert adapter.training is not None and adapter.training.learning_rate == 1e-6
    warned = {entry["key"]: entry["reason"] for entry in logs if entry.get("event", "").startswith("key has no")}
    assert set(warned) == {"backend.ip", "backend.port", "backend.api_key"}
    assert "base_url" in warned["backend.ip"] and "inference.api_key" in warned["backend.api_key"]
    # the policy (and so every LoRA name) is the project plus an id of this run: two runs never share names
    first, second = RlstreamTrainerAdapter(adapter), RlstreamTrainerAdapter(adapter)
    assert first.policy_name().startswith("my_project-") and first.policy_name() != second.policy_name()


def test_extending_guide_generic_keys_are_accepted() -> None:
    keys._warned.clear()
    adapter = {"_type": "rlstream_trainer_adapter", "validate_trajectories": True,
               "backend": {"endpoint": "http://training-server:8080", "api_key": "k", "learning_rate": "1e-5",
                           "batch_size": 8}}
    builder = {"_type": "rlstream_traj_builder", "num_generations": 4, "include_tool_calls": True,
               "min_episode_length": 3}
    with structlog.testing.capture_logs() as logs:
        config = validate_schema(nat_config(builder=builder, adapter=adapter), Config)
    backend = config.trainer_adapters["a"].backend
    assert backend.learning_rate == 1e-5 and backend.batch_size == 8
    assert config.trajectory_builders["b"].min_episode_length == 3
    assert {e["key"] for e in logs if e.get("event", "").startswith("key has no")} == {"backend.endpoint",
                                                                                       "backend.api_key"}


@pytest.mark.parametrize("block, value, expected", [
    ("b", {"_type": "rlstream_traj_builder", "num_generation": 3},
     "unknown key 'num_generation' (did you mean 'num_generations'?) in trajectory_builders"),
    ("a", {**ART_ADAPTER, "backend": {"bas_model": "x"}},
     "unknown key 'backend.bas_model' (did you mean 'base_model'?) in trainer_adapters"),
    ("a", {**ART_ADAPTER, "training": {"betta": 0.1}},
     "unknown key 'training.betta' (did you mean 'beta'?) in trainer_adapters"),
    ("a", {**ART_ADAPTER, "continue_on_falure": True},
     "unknown key 'continue_on_falure' (did you mean 'continue_on_failure'?) in trainer_adapters"),
    ("t", {"_type": "rlstream_trainer", "sed": 1}, "unknown key 'sed' (did you mean 'seed'?) in trainers"),
])
def test_a_typo_in_any_block_is_an_error_naming_the_key_and_a_suggestion(block: str, value: dict[str, Any],
                                                                          expected: str) -> None:
    parts = {{"b": "builder", "a": "adapter", "t": "trainer"}[block]: value}
    assert expected in validation_error(nat_config(**parts))


def test_base_model_local_directory_relative_or_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "Qwen" / "Qwen2.5-3B-Instruct"
    model.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_base_model("Qwen/Qwen2.5-3B-Instruct", None) == model
    assert resolve_base_model(str(model), None) == model


def test_base_model_id_from_the_hugging_face_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hf_constants

    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert resolve_base_model("acme/tiny", None) == snapshot
    with pytest.raises(NatConfigError) as caught:
        resolve_base_model("acme/absent", None)
    text = str(caught.value)
    assert "backend.base_model 'acme/absent'" in text and "Hugging Face cache (HF_HUB_OFFLINE is set)" in text
    assert "learner.model" not in text


def test_missing_base_model_without_a_server_speaks_the_users_key() -> None:
    with pytest.raises(NatConfigError, match=r"backend\.base_model is not set") as caught:
        resolve_base_model(None, None)
    assert "learner.model" not in str(caught.value)


def finetune_config(tmp_path: Path, config_dataset: str, **run: Any) -> FinetuneConfig:
    config = validate_schema(nat_config(dataset=config_dataset), Config)
    run_config = FinetuneRunConfig(config_file=config, **run)
    return config.finetuning.model_copy(update={"run_configuration": run_config})


@pytest.mark.parametrize("content, expected", [(None, "does not exist"), ("", "is empty"), ("[]", "has no rows")])
def test_a_missing_or_empty_dataset_stops_at_once_naming_the_file(tmp_path: Path, content: str | None,
                                                                 expected: str) -> None:
    path = tmp_path / "train.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(NatConfigError) as caught:
        check_run(finetune_config(tmp_path, str(path)))
    assert f"the dataset file {path} {expected}" in str(caught.value)
    assert "eval.general.dataset.file_path" in str(caught.value)


def test_dataset_option_wins_and_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"id": 1, "question": "q", "answer": "a"}]))
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    check_run(finetune_config(tmp_path, str(empty), dataset=str(good)))  # --dataset replaces the config's
    with pytest.raises(NatConfigError, match=r"has no rows \(--dataset\)"):
        check_run(finetune_config(tmp_path, str(good), dataset=str(empty)))


def test_endpoint_is_refused_with_the_reason(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"id": 1, "question": "q", "answer": "a"}]))
    with pytest.raises(NatConfigError, match="does not send back") as caught:
        check_run(finetune_config(tmp_path, str(good), endpoint="http://127.0.0.1:8000/generate"))
    assert "--endpoint http://127.0.0.1:8000/generate" in str(caught.value)


def test_doc_yaml_round_trip_keeps_learning_rate_text() -> None:
    # PyYAML reads 1e-6 (no dot) as a string: the field still takes it as a number
    block = yaml.safe_load("training: {learning_rate: 1e-6}")
    assert block["training"]["learning_rate"] == "1e-6"
    config = RlstreamTrainerAdapterConfig.model_validate({"training": block["training"]})
    assert config.training is not None and config.training.learning_rate == 1e-6


class ListingServer:
    """What a vLLM server answers to ``/v1/models`` (the one call the check makes)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    async def models(self) -> list[str]:
        return self.names


@pytest.mark.parametrize("latest, refused", [(0, True), (2, False)])
def test_adapters_of_the_policy_that_redis_does_not_know_are_refused_at_start(latest: int, refused: bool) -> None:
    from rlstream.finetune import FinetuneContext, FinetuneError
    from rlstream.schemas.config import RlstreamConfig

    context = FinetuneContext(RlstreamConfig(policy="my_project"), "http://127.0.0.1:9")
    context._sync_backend = ListingServer(["base", "my_project-v1", "my_project-v2", "other-v7"])
    check = context._refuse_foreign_adapters(latest)
    if refused:  # a fresh Redis (latest 0) on a server holding my_project-v1..: vLLM would refuse those names
        with pytest.raises(FinetuneError, match=r"already serves adapters my_project-v1\.\. of policy 'my_project'"):
            asyncio.run(check)
    else:  # the same control plane published them: the run continues their numbering
        asyncio.run(check)
