"""One ``rlstream finetune`` run: compose the config, prepare what it stands on, build the three components,
run the epochs, stop everything it started."""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.finetune.interfaces import TrainingStatusEnum
from rlstream.finetune.outputs import (CURRICULUM_STATE, REWARD_HISTORY, REWARD_PLOT, TRAINING_METRICS,
                                  VALIDATION_HISTORY)
from rlstream.finetune.registry import build_component, resolve
from rlstream.finetune.runtime import FinetuneContext, Infrastructure, fresh_run_id, prepare
from rlstream.transport.log import get_logger
from rlstream.ops.up import deep_merge
from rlstream.schemas.config import ConfigError, RlstreamConfig, load_config, read_yaml
from rlstream.schemas.masking import REVEAL

log = get_logger(__name__)


@dataclass
class FinetuneOptions:
    """What ``rlstream finetune`` was asked for (the options of ``nat finetune``)."""

    config_file: Path
    overrides: list[tuple[str, str]] = field(default_factory=list)
    dataset: Path | None = None
    validation_dataset: Path | None = None
    validation_interval: int | None = None
    validation_config_file: Path | None = None
    inference_url: str | None = None  # the vLLM server (None: start one on learner.model)
    endpoint_timeout_s: float = 300.0
    summary_json: Path | None = None


def option_pairs(opts: FinetuneOptions) -> list[tuple[str, str]]:
    """The explicit options as dotted overrides (applied after ``-o``, so a flag wins)."""
    pairs: list[tuple[str, str]] = []
    if opts.dataset is not None:
        pairs.append(("rollout.dataset", str(opts.dataset)))
    if opts.validation_dataset is not None:
        pairs.append(("finetuning.validation_dataset", str(opts.validation_dataset)))
    if opts.validation_interval is not None:
        pairs.append(("finetuning.validation_interval", str(opts.validation_interval)))
    if opts.validation_config_file is not None:
        pairs.append(("finetuning.validation_config_file", str(opts.validation_config_file)))
    if opts.inference_url:
        url = opts.inference_url.rstrip("/")
        pairs.append(("rollout.base_url", url if url.endswith("/v1") else url + "/v1"))
    return pairs


def compose_config(opts: FinetuneOptions) -> RlstreamConfig:
    """The run's config: file < environment < ``-o`` overrides < explicit options; a fresh run id unless set.
    Raises :class:`ConfigError` for a config that cannot run (including unknown component types)."""
    cfg = fresh_run_id(load_config(opts.config_file, [*opts.overrides, *option_pairs(opts)]))
    for kind in ("trajectory_builder", "trainer_adapter", "trainer"):
        try:
            resolve(kind, cfg.finetuning)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return cfg


def validation_config(cfg: RlstreamConfig) -> RlstreamConfig | None:
    """``finetuning.validation_config_file`` merged over the run's config (None without one)."""
    path = cfg.finetuning.validation_config_file
    if path is None:
        return None
    merged = deep_merge(cfg.model_dump(mode="json", context=REVEAL), read_yaml(Path(path)))  # secrets kept (in memory)
    try:
        return RlstreamConfig.model_validate(merged)
    except ValueError as exc:
        raise ConfigError(f"{path}: invalid validation config: {exc}") from None


async def run_components(cfg: RlstreamConfig, infra: Infrastructure, val_cfg: RlstreamConfig | None) -> dict[str, Any]:
    """Open the run's context, build builder/adapter/trainer by ``_type`` and run ``num_epochs`` epochs."""
    ft = cfg.finetuning
    ctx = FinetuneContext(cfg, infra.server_url, val_cfg)
    ctx.supervisor = infra.supervisor
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(ctx.close)
        await ctx.open()
        builder = await build_component("trajectory_builder", ft, ctx, stack)
        adapter = await build_component("trainer_adapter", ft, ctx, stack)
        trainer = await build_component("trainer", ft, ctx, stack)
        stack.push_async_callback(trainer.cleanup)
        await trainer.bind_components(builder, adapter)
        await trainer.initialize(ft)
        if not await adapter.is_healthy():
            log.warning("the training backend reports unhealthy before the first epoch")
        statuses = await trainer.run(ft.num_epochs)
        metrics = await trainer.get_metrics(cfg.run_id)
    failed = [s for s in statuses if s.status != TrainingStatusEnum.COMPLETED]
    return {"run_id": cfg.run_id, "policy": cfg.policy, "output_dir": str(ctx.output_dir),
            "files": {name: str(ctx.output_dir / name) for name in (TRAINING_METRICS, REWARD_HISTORY,
                                                                     VALIDATION_HISTORY, CURRICULUM_STATE,
                                                                     REWARD_PLOT)},
            "epochs": len(metrics["epochs"]), "jobs": metrics["jobs"], "failed_jobs": len(failed),
            "final_validation": metrics["validations"][-1] if metrics["validations"] else None}


async def _main(cfg: RlstreamConfig, infra: Infrastructure, val_cfg: RlstreamConfig | None) -> dict[str, Any]:
    task = asyncio.create_task(run_components(cfg, infra, val_cfg))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    return await task


def run_finetune(opts: FinetuneOptions) -> dict[str, Any]:
    """The whole run; returns (and with ``summary_json`` writes) its summary."""
    cfg = compose_config(opts)
    val_cfg = validation_config(cfg)
    log.info("finetune starting", run_id=cfg.run_id, policy=cfg.policy, epochs=cfg.finetuning.num_epochs,
             output_dir=str(cfg.finetuning.output_dir))
    infra = prepare(cfg, opts.inference_url, opts.endpoint_timeout_s)
    try:
        if val_cfg is not None:  # same services as the run
            val_cfg = val_cfg.model_copy(update={"kafka": infra.cfg.kafka, "redis": infra.cfg.redis,
                                                 "topics": infra.cfg.topics, "run_id": infra.cfg.run_id,
                                                 "policy": infra.cfg.policy})
        summary = asyncio.run(_main(infra.cfg, infra, val_cfg))
    finally:
        infra.stop()
    if opts.summary_json is not None:
        Path(opts.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.summary_json).write_text(json.dumps(summary, indent=2, default=str))
    return summary
