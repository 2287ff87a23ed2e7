"""rlstream's NAT components, found by NAT through the ``nat.components`` entry point (pyproject.toml)."""
from __future__ import annotations

from typing import Any, AsyncIterator

from nat.builder.builder import Builder
from nat.cli.register_workflow import register_trainer, register_trainer_adapter, register_trajectory_builder

from rlstream.nat import examples as _examples  # noqa: F401  (registers the toy workflow and evaluator)
from rlstream.nat import gateway_llm as _gateway_llm  # noqa: F401  (registers the rlstream_gateway LLM)
from rlstream.nat import token_capture as _token_capture  # noqa: F401  (registers rlstream_token_capture)
from rlstream.nat.adapter import RlstreamTrainerAdapter
from rlstream.nat.builder import RlstreamTrajectoryBuilder
from rlstream.nat.config import (RlstreamTrainerAdapterConfig, RlstreamTrainerConfig,
                                 RlstreamTrajectoryBuilderConfig)
from rlstream.nat.trainer import RlstreamTrainer


@register_trajectory_builder(config_type=RlstreamTrajectoryBuilderConfig)
async def rlstream_traj_builder(config: RlstreamTrajectoryBuilderConfig, builder: Builder) -> AsyncIterator[Any]:
    yield RlstreamTrajectoryBuilder(trajectory_builder_config=config)


@register_trainer_adapter(config_type=RlstreamTrainerAdapterConfig)
async def rlstream_trainer_adapter(config: RlstreamTrainerAdapterConfig, builder: Builder) -> AsyncIterator[Any]:
    # NAT closes its builder before the epochs run: the adapter's resources are released by the trainer's
    # cleanup (RlstreamTrainer.cleanup), not here
    yield RlstreamTrainerAdapter(adapter_config=config)


@register_trainer(config_type=RlstreamTrainerConfig)
async def rlstream_trainer(config: RlstreamTrainerConfig, builder: Builder) -> AsyncIterator[Any]:
    yield RlstreamTrainer(trainer_config=config)
