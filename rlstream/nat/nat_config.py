"""Reading the NAT config a finetuning run was started with: the Config object, and its target LLM."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from nat.data_models.config import Config
from nat.data_models.finetuning import FinetuneConfig, FinetuneRunConfig
from pydantic import BaseModel


class NatConfigError(ValueError):
    """The NAT config does not say what rlstream needs (which LLM to train, where it is served)."""


def resolved_config(run: FinetuneRunConfig | None, config_file: Any = None,
                    overrides: tuple[tuple[str, str], ...] = ()) -> Config:
    """The validated NAT Config of a run: ``nat finetune`` passes the object (overrides applied); a path is
    loaded, with ``overrides`` applied as NAT does."""
    source = config_file if config_file is not None else (run.config_file if run is not None else None)
    if isinstance(source, BaseModel):
        return detached(source)  # type: ignore[arg-type]
    if source is None:
        raise NatConfigError("the finetuning run has no config_file")
    from nat.cli.cli_utils.config_override import load_and_override_config
    from nat.runtime.loader import PluginTypes, discover_and_register_plugins
    from nat.utils.data_models.schema_validator import validate_schema

    discover_and_register_plugins(PluginTypes.CONFIG_OBJECT)
    return validate_schema(load_and_override_config(Path(source), tuple(overrides or ())), Config)


def detached(config: Config) -> Config:
    """A copy of ``config`` without ``finetuning.run_configuration``: ``nat finetune`` stores the run's
    FinetuneRunConfig there, whose ``config_file`` is this Config again (a cycle that deep copies and NAT's
    evaluation, which dumps its config, cannot walk)."""
    finetuning = config.finetuning.model_copy(update={"run_configuration": None})
    return config.model_copy(update={"finetuning": finetuning})


def target_llm_name(config: Config, finetune: FinetuneConfig) -> str | None:
    """The NAT LLM (a key of ``llms``) whose calls are trained: ``target_model``, else the only LLM."""
    if finetune.target_model:
        if finetune.target_model not in config.llms:
            raise NatConfigError(f"finetuning.target_model {finetune.target_model!r} is not an LLM of this config "
                                 f"(llms: {sorted(config.llms)}); target_model names a NAT LLM, as in NAT")
        return finetune.target_model
    return next(iter(config.llms)) if len(config.llms) == 1 else None


def llm_field(config: Config, llm_name: str, field: str) -> Any:
    """A field of one LLM's config (``model_name``, ``base_url``); None when that LLM type has no such field."""
    return getattr(config.llms[llm_name], field, None)
