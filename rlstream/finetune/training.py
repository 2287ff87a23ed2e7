"""The engine's learner: each submission's groups trained in this process through the learner's train-and-publish
loop (:class:`rlstream.learner.loop.TrainPublishLoop`) and published as one version."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlstream.finetune.runtime import FinetuneContext, FinetuneError
from rlstream.schemas.models import TrajectoryEvent
from rlstream.transport.control import Lease, LeaseLost
from rlstream.transport.log import get_logger

log = get_logger(__name__)
#: called with (learner steps done, learner steps in the submission)
StepProgress = Callable[[int, int], None]


@dataclass
class TrainedVersion:
    """What one submission's training produced: the version published (None: nothing was trainable)."""

    version: int | None
    figures: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainingGroup:
    """One assembled group to train: its members and where it sits on ``groups`` (the version's lineage)."""

    events: Sequence[TrajectoryEvent]
    partition: int
    offset: int


class ContextLease:
    """The run's learner lease as the train-and-publish loop sees it (renewed in the background by the context)."""

    def __init__(self, context: FinetuneContext) -> None:
        self.context = context

    @property
    def lease(self) -> Lease:
        assert self.context.lease is not None, "open the context first"
        return self.context.lease

    async def confirm(self) -> bool:
        ctx = self.context
        if ctx.lease_lost or ctx.control is None:
            return False
        try:
            await ctx.control.renew_lease(ctx.cfg.policy, self.lease, ctx.cfg.learner.lease_ttl_s)
            return True
        except LeaseLost as exc:
            self.lost(exc)
        except Exception as exc:
            log.warning("lease not confirmed (Redis unreachable?); no version this time", error=str(exc))
        return False

    def lost(self, exc: BaseException) -> None:
        self.context.lease_lost = str(exc)
        log.error("learner lease lost or announcement fenced; this run will not publish again", error=str(exc))


class EpochLearner:
    """Loads the policy once; trains each submission in ``learner.groups_per_step`` chunks and publishes it."""

    def __init__(self, context: FinetuneContext) -> None:
        self.context = context
        self.cfg = context.cfg
        self.loop: Any = None  # rlstream.learner.loop.TrainPublishLoop, once open
        self.skipped: list[tuple[str, str]] = []  # (group_id, reason) of trajectories without usable tokens

    async def open(self) -> None:
        from rlstream.learner.checkpoint import LearnerState
        from rlstream.learner.loop import PublicationTarget, TrainPublishLoop
        from rlstream.learner.policy import load_policy
        from rlstream.learner.step import GRPOTrainerStep

        ctx = self.context
        assert ctx.control is not None and ctx.announcer is not None, "open the context first"
        policy = await asyncio.to_thread(load_policy, self.cfg.learner)
        state = LearnerState(version=max(0, await ctx.control.latest_version(self.cfg.policy)))
        self.loop = TrainPublishLoop(
            policy=policy, trainer=GRPOTrainerStep(policy, self.cfg.learner), state=state, announcer=ctx.announcer,
            control=ctx.control, codec=ctx.codec, guard=ContextLease(ctx),
            target=PublicationTarget(self.cfg.policy, self.cfg.run_id, ctx.topics, ctx.output_dir / "versions",
                                     self.cfg.learner.lease_ttl_s))

    def _train(self, groups: Sequence[TrainingGroup], progress: StepProgress) -> dict[str, float]:
        """Learner steps over ``groups`` in chunks of ``learner.groups_per_step``, ``learner.num_iterations``
        optimizer steps each (runs in a thread)."""
        from rlstream.learner.batch import BatchError, samples_from_trajectory

        lcfg, ft = self.cfg.learner, self.cfg.finetuning
        chunks = [groups[i:i + lcfg.groups_per_step] for i in range(0, len(groups), lcfg.groups_per_step)]
        losses: list[float] = []
        skipped = steps = optimizer_steps = 0
        for n, chunk in enumerate(chunks):
            samples, sampled = [], []
            for index, group in enumerate(chunk):
                before = len(samples)
                for event in group.events:
                    try:
                        samples.extend(samples_from_trajectory(event, index, self.loop.policy.tokenizer,
                                                               ft.target_functions, ft.target_model))
                    except BatchError as exc:
                        skipped += 1
                        self.skipped.append((event.group_id, str(exc)))
                        log.warning("trajectory not trained on", trajectory_id=event.trajectory_id, reason=str(exc))
                if len(samples) > before:
                    sampled.append(group)
            if samples:
                stats = self.loop.train(samples)
                steps += 1
                if stats is not None:
                    losses.append(stats.loss)
                    optimizer_steps += stats.optimizer_steps
                    if stats.trained:  # exact lineage: the groups of applied optimizer steps
                        self.loop.record_trained([(g.partition, g.offset) for g in sampled])
            progress(n + 1, len(chunks))
        return {"loss": sum(losses) / len(losses) if losses else 0.0, "steps": float(steps),
                "optimizer_steps": float(optimizer_steps), "skipped_trajectories": float(skipped)}

    async def train_and_publish(self, groups: Sequence[TrainingGroup],
                                progress: StepProgress = lambda _d, _t: None) -> TrainedVersion:
        """Train ``groups``; publish the next version unless no sample was trainable."""
        ctx = self.context
        figures = await asyncio.to_thread(self._train, groups, progress)
        if figures["steps"] == 0:
            return TrainedVersion(None, figures)
        if ctx.lease_lost:
            raise FinetuneError(f"learner lease lost: {ctx.lease_lost}")
        saved = await self.loop.save(checkpoint=False, publish=True, figures=figures)
        if saved.version is None:
            raise FinetuneError(f"no version published ({saved.refused}"
                                f"{': ' + ctx.lease_lost if ctx.lease_lost else ''})")
        return TrainedVersion(saved.version.version, figures)
