"""``rlstream finetune``: the NAT harness's epoch loop over rlstream's Kafka pipeline.

Extension points (NAT's names and roles): :class:`TrajectoryBuilder`, :class:`TrainerAdapter`,
:class:`Trainer`, registered by ``_type`` with :func:`register_trajectory_builder`,
:func:`register_trainer_adapter` and :func:`register_trainer`.
"""
from rlstream.finetune.interfaces import (EpisodeItem, EpisodeItemRole, Trainer, TrainerAdapter, TrainerAdapterConfig,
                                     TrainerConfig, TrainingJobRef, TrainingJobStatus, TrainingStatusEnum, Trajectory,
                                     TrajectoryBuilder, TrajectoryBuilderConfig, TrajectoryCollection)
from rlstream.finetune.registry import register_trainer, register_trainer_adapter, register_trajectory_builder

__all__ = [
    "EpisodeItem", "EpisodeItemRole", "Trainer", "TrainerAdapter", "TrainerAdapterConfig", "TrainerConfig",
    "TrainingJobRef", "TrainingJobStatus", "TrainingStatusEnum", "Trajectory", "TrajectoryBuilder",
    "TrajectoryBuilderConfig", "TrajectoryCollection", "register_trainer", "register_trainer_adapter",
    "register_trajectory_builder",
]
