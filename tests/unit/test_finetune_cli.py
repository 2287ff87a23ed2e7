"""``rlstream finetune`` options: NAT's option names, ``-o KEY VALUE`` over the whole config, explicit options
over overrides, and a config that cannot run refused before anything starts."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlstream.cli.app import app
from rlstream.finetune.run import FinetuneOptions, compose_config, validation_config
from rlstream.schemas.config import ConfigError


def write_config(tmp_path: Path, **finetuning: object) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"run_id": "nat-run", "finetuning": {"num_epochs": 1, **finetuning},
                                    "rollout": {"temperature": 1.0}}))
    return path


def test_overrides_reach_every_section_and_explicit_options_win(tmp_path: Path) -> None:
    opts = FinetuneOptions(
        config_file=write_config(tmp_path),
        overrides=[("finetuning.num_epochs", "4"), ("finetuning.curriculum_learning.expansion_interval", "1"),
                   ("learner.lora.r", "16"), ("finetuning.validation_interval", "3"), ("policy", "007")],
        dataset=tmp_path / "train.jsonl", validation_dataset=tmp_path / "val.jsonl", validation_interval=2,
        inference_url="http://127.0.0.1:9000")
    cfg = compose_config(opts)
    assert cfg.finetuning.num_epochs == 4 and cfg.finetuning.curriculum_learning.expansion_interval == 1
    assert cfg.learner.lora.r == 16 and cfg.policy == "007"
    assert cfg.finetuning.validation_interval == 2  # --validation_interval over -o
    assert cfg.rollout.dataset == tmp_path / "train.jsonl"
    assert cfg.finetuning.validation_dataset == tmp_path / "val.jsonl"
    assert cfg.rollout.base_url == "http://127.0.0.1:9000/v1"
    assert cfg.run_id == "nat-run"


def test_default_run_id_is_replaced_by_a_fresh_one(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("finetuning: {num_epochs: 2}\n")
    first, second = compose_config(FinetuneOptions(path)), compose_config(FinetuneOptions(path))
    assert first.run_id.startswith("finetune-") and first.run_id != second.run_id


def test_validation_config_file_is_merged_over_the_run_config(tmp_path: Path) -> None:
    val = tmp_path / "val.yaml"
    val.write_text("rollout: {temperature: 0.0, max_tokens: 5}\n")
    cfg = compose_config(FinetuneOptions(write_config(tmp_path), validation_config_file=val))
    merged = validation_config(cfg)
    assert merged is not None
    assert merged.rollout.temperature == 0.0 and merged.rollout.max_tokens == 5
    assert merged.run_id == cfg.run_id and cfg.rollout.temperature == 1.0
    assert validation_config(compose_config(FinetuneOptions(write_config(tmp_path)))) is None


def test_component_sections_in_an_rlstream_config_name_the_nat_path(tmp_path: Path) -> None:
    """The NAT component keys (``_type`` sections, plugins) belong to NAT configs; rlstream's own config refuses
    them with the path to take."""
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"finetuning": {"num_epochs": 1, "trainer_adapter": "mine", "plugins": ["pkg"],
                                                   "trainer_adapters": {"mine": {"_type": "my_adapter"}}}}))
    with pytest.raises(ConfigError) as refused:
        compose_config(FinetuneOptions(path))
    said = " ".join(str(refused.value).split())
    assert "plugins, trainer_adapter, trainer_adapters: rlstream's own config has no pluggable components" in said
    assert "nat finetune or rlstream finetune" in said
    assert compose_config(FinetuneOptions(write_config(tmp_path))).finetuning.num_epochs == 1  # without them: fine


def test_cli_refuses_a_config_that_cannot_run_before_starting_anything(tmp_path: Path) -> None:
    runner = CliRunner()
    config = write_config(tmp_path)
    component = runner.invoke(app, ["finetune", "--config_file", str(config), "-o", "finetuning.trainer", "nope"])
    assert component.exit_code == 2
    said = " ".join(component.output.split())
    assert "trainer: rlstream's own config has no pluggable components" in said and "docs/nat.md" in said
    invalid = runner.invoke(app, ["finetune", "--config_file", str(config), "-o", "finetuning.num_epochs", "0"])
    assert invalid.exit_code == 2 and "finetuning.num_epochs" in invalid.output and "from -o" in invalid.output
    missing = runner.invoke(app, ["finetune", "--dataset", "x.jsonl"])
    assert missing.exit_code == 2 and "config_file" in missing.output
