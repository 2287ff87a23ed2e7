"""rlstream: continuous GRPO training of LLM agents from their own traffic, over Kafka.

The public API of the core install (the capture SDK; no torch, Faust or broker needed)::

    import rlstream

    config = rlstream.load_config("rlstream.yaml")
    names = rlstream.TopicNames.from_config(config.topics)
    publisher = rlstream.TrajectoryPublisher.from_config(config.kafka, names.trajectories, names.rewards)
    client = rlstream.instrument(openai.AsyncOpenAI(...))

Names resolve lazily, so ``import rlstream`` stays cheap; the services live in the subpackages
(``rlstream.streams``, ``rlstream.learner``, ``rlstream.inference``) behind their extras.
"""
from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("rlstream")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

_PUBLIC: dict[str, str] = {
    "instrument": "rlstream.rollout.capture",
    "target_function": "rlstream.rollout.capture",
    "routing": "rlstream.rollout.capture",
    "Recording": "rlstream.rollout.capture",
    "TrajectoryPublisher": "rlstream.rollout.publisher",
    "SyncTrajectoryPublisher": "rlstream.rollout.publisher",
    "PublishError": "rlstream.rollout.publisher",
    "load_config": "rlstream.schemas.config",
    "RlstreamConfig": "rlstream.schemas.config",
    "ConfigError": "rlstream.schemas.config",
    "TrajectoryEvent": "rlstream.schemas.models",
    "RewardEvent": "rlstream.schemas.models",
    "Message": "rlstream.schemas.models",
    "Turn": "rlstream.schemas.models",
    "TopicNames": "rlstream.schemas.topics",
}

__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on first use
    from rlstream.rollout.capture import Recording, instrument, routing, target_function  # noqa: F401
    from rlstream.rollout.publisher import PublishError, SyncTrajectoryPublisher, TrajectoryPublisher  # noqa: F401
    from rlstream.schemas.config import ConfigError, RlstreamConfig, load_config  # noqa: F401
    from rlstream.schemas.models import Message, RewardEvent, TrajectoryEvent, Turn  # noqa: F401
    from rlstream.schemas.topics import TopicNames  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rlstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
