"""One ``rlstream finetune`` run: compose the config, prepare what it stands on, run the epoch engine with the
rollout generator, stop everything it started."""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.finetune.engine import EngineSettings, EpochEngine, OutcomeStatus
from rlstream.finetune.outputs import (CURRICULUM_STATE, REWARD_HISTORY, REWARD_PLOT, TRAINING_METRICS,
                                       VALIDATION_HISTORY)
from rlstream.finetune.rollout_generator import RolloutGenerator
from rlstream.finetune.runtime import FinetuneContext, Infrastructure, fresh_run_id, prepare
from rlstream.transport.log import get_logger
from rlstream.ops.up_config import deep_merge
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
    Raises :class:`ConfigError` for a config that cannot run."""
    return fresh_run_id(load_config(opts.config_file, [*opts.overrides, *option_pairs(opts)]))


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


async def run_engine(cfg: RlstreamConfig, infra: Infrastructure, val_cfg: RlstreamConfig | None) -> dict[str, Any]:
    """Open the run's context, run ``num_epochs`` epochs of the engine with the rollout generator."""
    ft = cfg.finetuning
    ctx = FinetuneContext(cfg, infra.server_url)
    ctx.supervisor = infra.supervisor
    engine = EpochEngine(ctx, ft.curriculum_learning, EngineSettings(curriculum_seed=cfg.learner.seed))
    generator = RolloutGenerator(ctx, val_cfg)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(ctx.close)
        await ctx.open()
        stack.push_async_callback(engine.close)
        await engine.open()
        stack.push_async_callback(generator.close)
        await generator.open()
        try:
            outcomes = await engine.run(generator, ft.num_epochs, ft.validation_interval)
        finally:
            engine.plot()
        summary = engine.summary()
    failed = [o for o in outcomes if o.status != OutcomeStatus.COMPLETED]
    validations = summary["validations"]
    assert isinstance(validations, list)
    return {"run_id": cfg.run_id, "policy": cfg.policy, "output_dir": str(ctx.output_dir),
            "files": {name: str(ctx.output_dir / name) for name in (TRAINING_METRICS, REWARD_HISTORY,
                                                                     VALIDATION_HISTORY, CURRICULUM_STATE,
                                                                     REWARD_PLOT)},
            "epochs": len(engine.outputs.epochs), "jobs": summary["jobs"], "failed_jobs": len(failed),
            "final_validation": validations[-1] if validations else None}


async def _main(cfg: RlstreamConfig, infra: Infrastructure, val_cfg: RlstreamConfig | None) -> dict[str, Any]:
    task = asyncio.create_task(run_engine(cfg, infra, val_cfg))
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
