"""``rlstream_trainer``: NAT's epoch loop over rlstream's builder and adapter.

Per epoch: validation when ``epoch % validation_interval == 0`` (epoch 0 is the baseline), the builder's
generations, NAT's curriculum (:func:`rlstream.streams.curriculum.select_groups`, the exact rule), one training
job, and NAT's output files in ``finetuning.output_dir`` (:class:`rlstream.finetune.outputs.FinetuneOutputs`:
``training_metrics.jsonl``, ``reward_history.json``, ``validation_history.json``, ``curriculum_state.json``,
``reward_plot.png``). The final model is validated too (NAT never does).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from nat.data_models.finetuning import FinetuneConfig, TrainingJobRef, TrainingJobStatus, TrajectoryCollection
from nat.finetuning.interfaces.finetuning_runner import Trainer

from rlstream.finetune.epoch_curriculum import EpochCurriculum
from rlstream.finetune.interfaces import validation_record
from rlstream.finetune.outputs import FinetuneOutputs, epoch_record
from rlstream.nat.adapter import RlstreamTrainerAdapter
from rlstream.nat.builder import RlstreamTrajectoryBuilder
from rlstream.nat.config import RlstreamTrainerConfig
from rlstream.schemas.config import CurriculumConfig
from rlstream.transport.log import get_logger

log = get_logger(__name__)


def finite_rewards(collection: TrajectoryCollection) -> list[list[float]]:
    """Each group's finite rewards (an evaluator failure scores NaN: it counts in no statistic)."""
    return [[t.reward for t in group if math.isfinite(t.reward)] for group in collection.trajectories]


class RlstreamTrainer(Trainer):
    """NAT Trainer: epochs, curriculum, validation, outputs; jobs go to the bound TrainerAdapter."""

    def __init__(self, trainer_config: RlstreamTrainerConfig, **kwargs: Any) -> None:
        super().__init__(trainer_config, **kwargs)
        self.config = trainer_config
        self.curriculum: EpochCurriculum | None = None
        self.outputs: FinetuneOutputs | None = None
        self.statuses: list[TrainingJobStatus] = []
        self.run_id = ""

    async def initialize(self, run_config: FinetuneConfig) -> None:
        await super().initialize(run_config)
        self.curriculum = EpochCurriculum(CurriculumConfig.model_validate(run_config.curriculum_learning.model_dump()),
                                          seed=self.config.seed)
        self.outputs = FinetuneOutputs(Path(run_config.output_dir).resolve())
        adapter, builder = self.trainer_adapter, self.trajectory_builder
        if isinstance(adapter, RlstreamTrainerAdapter) and adapter.cfg is not None:
            self.run_id = adapter.cfg.run_id
            if isinstance(builder, RlstreamTrajectoryBuilder):
                builder.route = adapter.route
        self.run_id = self.run_id or f"nat-{time.strftime('%Y%m%d-%H%M%S')}"
        self.outputs.set_curriculum(self.get_curriculum_state())

    @property
    def validation_dataset(self) -> Any:
        rc = self.run_config.run_configuration
        return rc.validation_dataset if rc is not None else None

    async def run(self, num_epochs: int) -> list[TrainingJobStatus]:
        assert self.outputs is not None and self.trainer_adapter is not None
        interval = self.run_config.run_configuration.validation_interval if self.run_config.run_configuration else 5
        for epoch in range(num_epochs):
            if self.validation_dataset and epoch % interval == 0:
                await self._validate(epoch)
            ref = await self.run_epoch(epoch, self.run_id)
            if ref is None:
                continue
            status = await self.trainer_adapter.wait_until_complete(ref, self.config.poll_interval_s)
            self.statuses.append(status)
            self.trainer_adapter.log_progress(ref, {"epoch": epoch, "status": status.status.value,
                                                    "message": status.message})
        if self.validation_dataset:
            await self._validate(num_epochs)  # the final model
        self.outputs.plot(f"rlstream (NAT) — {self.run_id}")
        return self.statuses

    async def _validate(self, epoch: int) -> None:
        assert self.outputs is not None and self.trajectory_builder is not None
        rc = self.run_config.run_configuration
        try:
            if isinstance(self.trajectory_builder, RlstreamTrajectoryBuilder):
                rewards = await self.trajectory_builder.validation_rewards(rc.validation_dataset,
                                                                           rc.validation_config_file)
            else:
                metrics = await self.run_validation_evaluation(epoch, self.run_id)
                rewards = [metrics["avg_reward"]] * int(metrics.get("num_examples", 0))
        except Exception as exc:
            log.error("validation pass failed", epoch=epoch, error=f"{type(exc).__name__}: {exc}")
            rewards = []
        record = validation_record(epoch, rewards)
        self.outputs.add_validation(record)
        log.info("validation", epoch=epoch, avg_reward=round(record["avg_reward"], 4), examples=len(rewards))

    async def run_epoch(self, epoch: int, run_id: str) -> TrainingJobRef | None:
        assert self.trajectory_builder is not None and self.trainer_adapter is not None and self.outputs is not None
        builder_run = f"{run_id}_epoch_{epoch}"
        started = time.monotonic()
        await self.trajectory_builder.start_run(builder_run, {"epoch": epoch})
        collection = await self.trajectory_builder.finalize(builder_run, {"epoch": epoch})
        kept = self.apply_curriculum_learning(collection, epoch)
        assert self.curriculum is not None
        record = epoch_record(epoch, run_id, finite_rewards(collection), finite_rewards(kept),
                              self.curriculum.percentile, self.curriculum.summary())
        self.outputs.add_epoch(record)
        self.outputs.set_curriculum(self.get_curriculum_state())
        self.log_progress(epoch, {**record, "seconds": round(time.monotonic() - started, 1)})
        if not kept.trajectories:
            log.warning("nothing to train this epoch", epoch=epoch, groups=len(collection.trajectories))
            return None
        return await self.trainer_adapter.submit(kept)

    @staticmethod
    def group_id(collection: TrajectoryCollection, index: int) -> str:
        members = collection.trajectories[index]
        example = (members[0].metadata or {}).get("id") if members else None
        return str(example if example is not None else index)

    def apply_curriculum_learning(self, trajectory_collection: TrajectoryCollection,
                                  epoch: int) -> TrajectoryCollection:
        """NAT's curriculum on this epoch's groups (keyed by example id)."""
        assert self.curriculum is not None
        rewards = finite_rewards(trajectory_collection)
        ids = [self.group_id(trajectory_collection, i) for i in range(len(rewards))]
        chosen = self.curriculum.select(ids, rewards, epoch)
        # a group without one finite reward goes to the adapter as it is: it dead-letters it with the reason
        chosen += [i for i, r in enumerate(rewards) if not r]
        return TrajectoryCollection(trajectories=[trajectory_collection.trajectories[i] for i in chosen],
                                    run_id=trajectory_collection.run_id)

    def get_curriculum_state(self) -> dict[str, Any]:
        assert self.curriculum is not None
        return self.curriculum.document()

    async def get_metrics(self, run_id: str) -> dict[str, Any]:
        assert self.outputs is not None
        return {"run_id": run_id, "epochs": self.outputs.epochs, "validations": self.outputs.validations,
                "jobs": [{"status": s.status.value, "message": s.message, **(s.metadata or {})}
                         for s in self.statuses]}

    def log_progress(self, epoch: int, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        log.info("epoch done", epoch=epoch, avg_reward=round(metrics["avg_reward"], 4), groups=metrics["num_groups"],
                 kept=metrics["filtered_groups"], percentile=metrics["curriculum_percentile"],
                 seconds=metrics.get("seconds"))

    async def cleanup(self) -> None:
        """Write the plot, then stop what the adapter started (NAT calls this once, after the run)."""
        if self.outputs is not None and self.outputs.epochs:
            try:
                self.outputs.plot(f"rlstream (NAT) — {self.run_id}")
            except Exception as exc:
                log.warning("reward plot not written", error=str(exc))
        if isinstance(self.trainer_adapter, RlstreamTrainerAdapter):
            await self.trainer_adapter.close()
