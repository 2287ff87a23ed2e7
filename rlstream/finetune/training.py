"""The engine's learner: the groups of one submission trained in this process and published as one version."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from rlstream.finetune.runtime import FinetuneContext, FinetuneError
from rlstream.schemas.models import TrajectoryEvent
from rlstream.transport.log import get_logger

log = get_logger(__name__)
#: called with (optimizer steps done, steps in the submission)
StepProgress = Callable[[int, int], None]


@dataclass
class TrainedVersion:
    """What one submission's training produced: the version published (None: nothing was trainable)."""

    version: int | None
    figures: dict[str, float] = field(default_factory=dict)


class EpochLearner:
    """Loads the policy once; trains each submission in ``learner.groups_per_step`` chunks and publishes it."""

    def __init__(self, context: FinetuneContext) -> None:
        self.context = context
        self.cfg = context.cfg
        self.policy: Any = None
        self.trainer_step: Any = None
        self.version = 0
        self.step = 0
        self.skipped: list[tuple[str, str]] = []  # (group_id, reason) of trajectories without usable tokens

    async def open(self) -> None:
        from rlstream.learner.policy import load_policy
        from rlstream.learner.step import GRPOTrainerStep

        assert self.context.control is not None
        self.policy = await asyncio.to_thread(load_policy, self.cfg.learner)
        self.trainer_step = GRPOTrainerStep(self.policy, self.cfg.learner)
        self.version = max(0, await self.context.control.latest_version(self.cfg.policy))

    def _train(self, groups: Sequence[Sequence[TrajectoryEvent]], progress: StepProgress) -> dict[str, float]:
        """Optimizer steps over ``groups`` in chunks of ``learner.groups_per_step`` (runs in a thread)."""
        from rlstream.learner.batch import BatchError, samples_from_trajectory

        lcfg, ft = self.cfg.learner, self.cfg.finetuning
        chunks = [groups[i:i + lcfg.groups_per_step] for i in range(0, len(groups), lcfg.groups_per_step)]
        losses: list[float] = []
        skipped = steps = 0
        for n, chunk in enumerate(chunks):
            samples = []
            for index, events in enumerate(chunk):
                for event in events:
                    try:
                        samples.extend(samples_from_trajectory(event, index, self.policy.tokenizer,
                                                               ft.target_functions, ft.target_model))
                    except BatchError as exc:
                        skipped += 1
                        self.skipped.append((event.group_id, str(exc)))
                        log.warning("trajectory not trained on", trajectory_id=event.trajectory_id, reason=str(exc))
            if samples:
                stats = self.trainer_step.step(samples)
                losses.append(stats.loss)
                steps += 1
                self.step += 1
            progress(n + 1, len(chunks))
        return {"loss": sum(losses) / len(losses) if losses else 0.0, "steps": float(steps),
                "skipped_trajectories": float(skipped)}

    async def train_and_publish(self, groups: Sequence[Sequence[TrajectoryEvent]],
                                offsets: Mapping[int, Sequence[int]],
                                progress: StepProgress = lambda _d, _t: None) -> TrainedVersion:
        """Train ``groups``; publish the next version unless no sample was trainable. ``offsets`` (per ``groups``
        partition) are the records trained: the version's exact lineage."""
        from rlstream.learner.publish import announce, write_version
        from rlstream.schemas.models import WeightsKind

        ctx = self.context
        figures = await asyncio.to_thread(self._train, groups, progress)
        if figures["steps"] == 0:
            return TrainedVersion(None, figures)
        if ctx.lease_lost:
            raise FinetuneError(f"learner lease lost: {ctx.lease_lost}")
        version = self.version + 1
        directory, manifest = await asyncio.to_thread(write_version, self.policy, ctx.output_dir / "versions",
                                                      self.cfg.policy, version)
        assert ctx.announcer is not None and ctx.control is not None and ctx.lease is not None
        await announce(producer=ctx.announcer, codec=ctx.codec, control=ctx.control, lease=ctx.lease,
                       topic=ctx.topics.policy_versions, groups_topic=ctx.topics.groups, policy_name=self.cfg.policy,
                       run_id=self.cfg.run_id, directory=directory, manifest=manifest, version=version,
                       step=self.step, kind=WeightsKind.lora if self.policy.lora else WeightsKind.full,
                       base_model=self.policy.base_model, offsets=offsets, group_count=len(groups), metrics=figures,
                       lease_ttl_s=self.cfg.learner.lease_ttl_s)
        self.version = version
        return TrainedVersion(version, figures)
