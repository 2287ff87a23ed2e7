"""The three extension points of ``rlstream finetune``, with the NAT harness's names and roles.

* :class:`TrajectoryBuilder`: run the workflow on the dataset, collect episodes with rewards, group them
  by example (``start_run`` / ``finalize``).
* :class:`TrainerAdapter`: validate trajectories and submit them to a training backend, report the job's
  status (``is_healthy`` / ``submit`` / ``status`` / ``wait_until_complete``).
* :class:`Trainer`: the epoch loop, the curriculum, validation and logging (``run_epoch`` / ``run``).

A component ported from NAT keeps its methods; its config class inherits from
:class:`TrajectoryBuilderConfig` / :class:`TrainerAdapterConfig` / :class:`TrainerConfig` with
``name="my_type"`` and is registered with the decorators of :mod:`rlstream.finetune.registry`.
``run_config`` is the ``finetuning:`` section (same field names as NAT's FinetuneConfig).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from rlstream.schemas.config import FinetuningConfig
from rlstream.schemas.models import Message, ToolCall, TrajectoryEvent, TrajectoryGroup, TrajectorySource, Turn


# --- the trajectory model (NAT's names) --------------------------------------------------------------------
class EpisodeItemRole(str, Enum):
    USER = "user"
    ASSISTANT = "assistant"
    SYSTEM = "system"
    FUNCTION = "function"
    TOOL = "tool"
    ENVIRONMENT = "environment"
    OTHER = "other"


@dataclass
class EpisodeItem:
    """One message of an episode; assistant items carry the logprobs of their tokens when recorded."""

    role: EpisodeItemRole
    content: str
    logprobs: list[float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One generation: its episode, its reward, and (for rlstream's builder) the event it came from."""

    episode: list[EpisodeItem]
    reward: float
    metadata: dict[str, Any] = field(default_factory=dict)
    event: TrajectoryEvent | None = None

    @classmethod
    def from_event(cls, event: TrajectoryEvent) -> "Trajectory":
        """The episode view of a TrajectoryEvent (tool calls kept in the item's metadata, not flattened)."""
        logprobs_by_message = {t.message_index: t.completion_logprobs for t in event.turns
                               if t.message_index is not None and t.completion_logprobs}
        episode = []
        for i, m in enumerate(event.messages):
            role = EpisodeItemRole(m.role) if m.role in EpisodeItemRole._value2member_map_ else EpisodeItemRole.OTHER
            meta: dict[str, Any] = {}
            if m.tool_calls:
                meta["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id:
                meta["tool_call_id"] = m.tool_call_id
            if m.name:
                meta["name"] = m.name
            episode.append(EpisodeItem(role, m.content or "", logprobs_by_message.get(i), meta))
        return cls(episode=episode, reward=float(event.reward if event.reward is not None else 0.0),
                   metadata={"trajectory_id": event.trajectory_id, "example_id": event.example_id,
                             "group_id": event.group_id, "policy_version": event.policy_version,
                             "generation_index": event.generation_index},
                   event=event)

    def to_event(self, *, run_id: str, policy: str, group_id: str, example_id: str, group_size: int,
                 generation_index: int) -> TrajectoryEvent:
        """The TrajectoryEvent to train on: the original one, else one built from the episode (no token data:
        the learner rebuilds tokens with the chat template and trains on-policy)."""
        if self.event is not None:
            return self.event.model_copy(update={"reward": self.reward})
        messages = []
        for item in self.episode:
            calls = [ToolCall(**c) for c in item.metadata.get("tool_calls", [])] or None
            messages.append(Message(role=item.role.value if item.role != EpisodeItemRole.OTHER else "user",
                                    content=item.content, tool_calls=calls,
                                    tool_call_id=item.metadata.get("tool_call_id"), name=item.metadata.get("name")))
        turns = [Turn(message_index=i) for i, item in enumerate(self.episode) if item.role == EpisodeItemRole.ASSISTANT]
        return TrajectoryEvent(run_id=run_id, example_id=example_id, group_id=group_id, group_size=group_size,
                               generation_index=generation_index, policy=policy,
                               policy_version=int(self.metadata.get("policy_version", 0)),
                               source=TrajectorySource.rollout, messages=messages, turns=turns, reward=self.reward)


@dataclass
class TrajectoryCollection:
    """Trajectories grouped by example (one inner list = one GRPO group), as NAT's; ``groups`` holds the
    assembled TrajectoryGroups they came from when the builder is rlstream's (same order)."""

    trajectories: list[list[Trajectory]]
    run_id: str
    groups: list[TrajectoryGroup] = field(default_factory=list)

    @classmethod
    def from_groups(cls, groups: list[TrajectoryGroup], run_id: str) -> "TrajectoryCollection":
        return cls([[Trajectory.from_event(t) for t in g.trajectories] for g in groups], run_id, list(groups))

    def group_id(self, index: int) -> str:
        if index < len(self.groups):
            return self.groups[index].group_id
        members = self.trajectories[index]
        return str(members[0].metadata.get("group_id", index)) if members else str(index)

    def rewards(self) -> list[float]:
        return [t.reward for group in self.trajectories for t in group]

    def select(self, indices: list[int]) -> "TrajectoryCollection":
        """The sub-collection of these group indices (in this order)."""
        groups = [self.groups[i] for i in indices] if self.groups else []
        return TrajectoryCollection([self.trajectories[i] for i in indices], self.run_id, groups)


class TrainingStatusEnum(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"


FINISHED = (TrainingStatusEnum.COMPLETED, TrainingStatusEnum.FAILED, TrainingStatusEnum.CANCELED)


@dataclass
class TrainingJobRef:
    """Handle of a submitted training job."""

    run_id: str
    backend: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainingJobStatus:
    """Where a training job stands: status, progress 0-100 and a message."""

    run_id: str
    backend: str
    status: TrainingStatusEnum
    progress: float = 0.0
    message: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    updated_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    def __post_init__(self) -> None:
        if not (0.0 <= self.progress <= 100.0) or math.isnan(self.progress):
            raise ValueError(f"progress must be within 0-100, got {self.progress}")

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


# --- component configs: `name=` gives the `_type` --------------------------------------------------------
class ComponentConfig(BaseModel):
    """Base of component configs. ``class MyConfig(TrajectoryBuilderConfig, name="my_type")`` makes
    ``_type: my_type`` select it in YAML."""

    model_config = ConfigDict(extra="forbid")
    type_name: ClassVar[str | None] = None

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.type_name = name


class TrajectoryBuilderConfig(ComponentConfig):
    pass


class TrainerAdapterConfig(ComponentConfig):
    pass


class TrainerConfig(ComponentConfig):
    pass


# --- the interfaces -------------------------------------------------------------------------------------
class TrajectoryBuilder(ABC):
    """Generates training data: runs the workflow, collects episodes with rewards, groups them by example."""

    def __init__(self, trajectory_builder_config: TrajectoryBuilderConfig) -> None:
        self.trajectory_builder_config = trajectory_builder_config
        self.run_config: FinetuningConfig | None = None

    async def initialize(self, run_config: FinetuningConfig) -> None:
        """Prepare resources for building trajectories."""
        self.run_config = run_config

    @abstractmethod
    async def start_run(self, run_id: str, meta: dict[str, Any] | None = None) -> None:
        """Start generating the trajectories of ``run_id`` (one epoch: ``meta["epoch"]``)."""

    @abstractmethod
    async def finalize(self, run_id: str, meta: dict[str, Any] | None = None) -> TrajectoryCollection:
        """Wait for ``run_id``'s trajectories and return them grouped by example."""

    async def compute_reward(self, output_item: Any, meta: dict[str, Any] | None = None) -> float:
        """Reward of one evaluated output (its ``score``; 0 when it has none)."""
        score = getattr(output_item, "score", None)
        return float(score) if score is not None else 0.0

    async def run_validation(self, epoch: int, meta: dict[str, Any] | None = None) -> list[float]:
        """One pass over the validation set with the current policy; returns one reward per scored example.
        Validation trajectories are never trained on."""
        raise NotImplementedError(f"{type(self).__name__} does not run validation passes")

    @abstractmethod
    def log_progress(self, run_id: str, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        """Log trajectory building progress."""


class TrainerAdapter(ABC):
    """Bridges trajectories to a training backend and reports the training job's status."""

    def __init__(self, adapter_config: TrainerAdapterConfig) -> None:
        self.adapter_config = adapter_config
        self.run_config: FinetuningConfig | None = None

    async def initialize(self, run_config: FinetuningConfig) -> None:
        self.run_config = run_config

    @abstractmethod
    async def is_healthy(self) -> bool:
        """Whether the training backend can take jobs."""

    @abstractmethod
    async def submit(self, trajectories: TrajectoryCollection) -> TrainingJobRef:
        """Validate and submit trajectories; returns the job's reference."""

    @abstractmethod
    async def status(self, ref: TrainingJobRef) -> TrainingJobStatus:
        """The job's current status."""

    async def wait_until_complete(self, ref: TrainingJobRef, poll_interval: float = 10.0) -> TrainingJobStatus:
        """Poll :meth:`status` until the job has finished (completed, failed or canceled)."""
        import asyncio

        while True:
            current = await self.status(ref)
            if current.finished:
                return current
            await asyncio.sleep(poll_interval)

    @abstractmethod
    def log_progress(self, ref: TrainingJobRef, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        """Log training progress."""


class Trainer(ABC):
    """Orchestrates the finetuning loop over epochs with a builder and an adapter."""

    def __init__(self, trainer_config: TrainerConfig, **kwargs: Any) -> None:
        self.trainer_config = trainer_config
        self.run_config: FinetuningConfig | None = None
        self.curriculum_config: Any = None
        self.trajectory_builder: TrajectoryBuilder | None = None
        self.trainer_adapter: TrainerAdapter | None = None

    async def bind_components(self, trajectory_builder: TrajectoryBuilder, trainer_adapter: TrainerAdapter) -> None:
        self.trajectory_builder = trajectory_builder
        self.trainer_adapter = trainer_adapter

    async def initialize(self, run_config: FinetuningConfig) -> None:
        """Initialize the trainer and its bound components."""
        self.run_config = run_config
        self.curriculum_config = run_config.curriculum_learning
        if self.trajectory_builder is None or self.trainer_adapter is None:
            raise RuntimeError("bind_components() must come before initialize()")
        await self.trajectory_builder.initialize(run_config)
        await self.trainer_adapter.initialize(run_config)

    @abstractmethod
    async def run_epoch(self, epoch: int, run_id: str) -> TrainingJobRef | None:
        """One epoch: build trajectories, apply the curriculum, submit (None when nothing was trained)."""

    @abstractmethod
    async def run(self, num_epochs: int) -> list[TrainingJobStatus]:
        """The whole finetuning run."""

    @abstractmethod
    async def get_metrics(self, run_id: str) -> dict[str, Any]:
        """Training metrics of a run."""

    @abstractmethod
    async def cleanup(self) -> None:
        """Release resources."""

    @abstractmethod
    def log_progress(self, epoch: int, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        """Log training progress."""

    async def run_validation_evaluation(self, epoch: int, run_id: str) -> dict[str, Any]:
        """One validation pass; returns {epoch, timestamp, avg_reward, min_reward, max_reward, num_examples}."""
        assert self.trajectory_builder is not None
        rewards = await self.trajectory_builder.run_validation(epoch, {"run_id": run_id})
        return validation_record(epoch, rewards)

    def apply_curriculum_learning(self, trajectory_collection: TrajectoryCollection,
                                  epoch: int) -> TrajectoryCollection:
        raise NotImplementedError("override to implement curriculum learning")

    def get_curriculum_state(self) -> dict[str, Any]:
        raise NotImplementedError("override to report the curriculum state")


def _stats(rewards: list[float]) -> tuple[float, float, float]:
    if not rewards:
        return 0.0, 0.0, 0.0
    return sum(rewards) / len(rewards), min(rewards), max(rewards)


def validation_record(epoch: int, rewards: list[float]) -> dict[str, Any]:
    """A validation_history.json entry."""
    avg, lo, hi = _stats(rewards)
    return {"epoch": epoch, "timestamp": now_iso(), "avg_reward": avg, "min_reward": lo, "max_reward": hi,
            "num_examples": len(rewards)}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def reward_stats(rewards: list[float]) -> tuple[float, float, float]:
    """(mean, min, max); zeros when there is no reward."""
    return _stats(rewards)


__all__ = [
    "EpisodeItem", "EpisodeItemRole", "Trajectory", "TrajectoryCollection", "TrainingStatusEnum", "TrainingJobRef",
    "TrainingJobStatus", "TrajectoryBuilderConfig", "TrainerAdapterConfig", "TrainerConfig", "TrajectoryBuilder",
    "TrainerAdapter", "Trainer", "validation_record", "reward_stats", "now_iso",
]
