"""``rlstream finetune`` on a NAT config: the same run as ``nat finetune`` (NAT's runtime, NAT's meanings)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class NatFinetuneOptions:
    """``nat finetune``'s options, with NAT's meanings."""

    config_file: Path
    overrides: list[tuple[str, str]] = field(default_factory=list)
    dataset: Path | None = None
    result_json_path: str = "$"  # a JSONPath into the workflow's output
    endpoint: str | None = None  # a remote workflow endpoint (NAT's `nat serve`), not a model server
    endpoint_timeout_s: float = 300.0
    validation_dataset: Path | None = None
    validation_interval: int | None = None
    validation_config_file: Path | None = None


def run_nat_finetune(opts: NatFinetuneOptions) -> None:
    """Load the NAT config with the overrides applied (as ``nat finetune`` does) and run NAT's finetuning
    runtime; NAT finds rlstream's components through their entry point."""
    from nat.cli.cli_utils.config_override import load_and_override_config
    from nat.data_models.config import Config
    from nat.data_models.finetuning import FinetuneRunConfig
    from nat.finetuning.finetuning_runtime import run_finetuning_sync
    from nat.runtime.loader import PluginTypes, discover_and_register_plugins
    from nat.utils.data_models.schema_validator import validate_schema

    overrides = tuple(opts.overrides)
    discover_and_register_plugins(PluginTypes.CONFIG_OBJECT)
    config = validate_schema(load_and_override_config(opts.config_file, overrides), Config)
    run_finetuning_sync(FinetuneRunConfig(
        config_file=config, dataset=opts.dataset, result_json_path=opts.result_json_path, endpoint=opts.endpoint,
        endpoint_timeout=int(opts.endpoint_timeout_s), override=overrides,
        validation_dataset=opts.validation_dataset,
        validation_interval=opts.validation_interval if opts.validation_interval is not None else 5,
        validation_config_file=opts.validation_config_file))
