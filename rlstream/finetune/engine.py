"""The epoch engine under ``rlstream finetune`` and the NAT plugin (:mod:`rlstream.nat`).

One epoch: generate (an :class:`EpochGenerator`: rlstream's rollout runner, or NAT's evaluation through the NAT
plugin) -> check every trajectory (a bad one is dead-lettered with its reason, never the epoch) -> publish to
``trajectories`` -> collect the groups the streams worker assembles on ``groups`` -> NAT's curriculum -> train
and publish one policy version -> wait until the run's vLLM has loaded it -> NAT's output files and MetricEvents.
Validation passes run every ``validation_interval`` epochs and after the last one.

Everything here is plain typed dataclasses over rlstream's :class:`~rlstream.schemas.models.TrajectoryEvent`;
the NAT plugin converts NAT's types to and from them.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Protocol, Sequence

from rlstream.finetune.epoch_curriculum import EpochCurriculum
from rlstream.finetune.outputs import FinetuneOutputs, epoch_record, validation_record
from rlstream.finetune.runtime import CollectedGroup, FinetuneContext, FinetuneError
from rlstream.finetune.training import EpochLearner, TrainingGroup
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.routing import VersionRouter
from rlstream.schemas.config import CurriculumConfig
from rlstream.schemas.models import TrajectoryEvent
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.log import get_logger
from rlstream.transport.metric_names import (CURRICULUM_PERCENTILE, LEARNER_LOSS, REWARD_MEAN, REWARD_MEAN_FILTERED,
                                             STEP_EPOCH, STEP_TAG, VALIDATION_REWARD_MEAN)
from rlstream.transport.topic_reader import SourceRecord

log = get_logger(__name__)
EPOCH_TAGS = {STEP_TAG: STEP_EPOCH}
#: the pseudo-topic of dead letters for trajectories rejected before they reached Kafka
SUBMISSION_SOURCE = "finetune-submission"
#: called with (progress 0-100, message) as a submission goes through its stages
ProgressFn = Callable[[float, str], None]


# --- what a generator hands over ------------------------------------------------------------------------
@dataclass
class Generation:
    """One generated trajectory: the event to train on (None when the generator could not convert it: then
    ``problem`` says why), its reward, and the raw form a dead letter carries."""

    event: TrajectoryEvent | None
    reward: float
    raw: bytes = b""
    problem: str | None = None


@dataclass
class CandidateGroup:
    """The generations of one example in one epoch (one GRPO group once assembled)."""

    group_id: str
    members: list[Generation]

    def finite_rewards(self) -> list[float]:
        """The members' finite rewards (a failed evaluator's NaN counts in no statistic)."""
        return [m.reward for m in self.members if math.isfinite(m.reward)]


class EpochGenerator(Protocol):
    """Produces one epoch's groups and runs validation passes with the policy vLLM serves now."""

    @property
    def validates(self) -> bool:
        """Whether a validation set is configured."""

    async def generate(self, epoch: int) -> list[CandidateGroup]:
        """The epoch's generations, grouped by example; a failed generation loses itself, never the epoch."""

    async def validate(self, epoch: int) -> list[float]:
        """One pass over the validation set (never trained on): one reward per scored example."""


# --- what a submission gives back -------------------------------------------------------------------------
class OutcomeStatus(str, Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"


@dataclass
class Rejection:
    group_id: str
    reason: str


@dataclass
class TrainingOutcome:
    """How one submission ended: its status and message, the version it published and the training figures."""

    status: OutcomeStatus
    message: str
    version: int | None = None
    figures: dict[str, float] = field(default_factory=dict)
    groups_trained: int = 0
    missing_groups: list[str] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)

    def metadata(self) -> dict[str, object]:
        """The outcome's figures as one flat mapping (a job status's metadata, the run summary's jobs)."""
        meta: dict[str, object] = {**self.figures, "groups_trained": self.groups_trained,
                                   "rejected_trajectories": len(self.rejected)}
        if self.version is not None:
            meta["version"] = self.version
        if self.missing_groups:
            meta["missing_groups"] = list(self.missing_groups)
        return meta


@dataclass(frozen=True)
class EngineSettings:
    """How long the engine waits and where its dead letters say they come from."""

    collect_grace_s: float = 60.0  # wait for the streams worker's groups beyond the group timeout
    first_submission_grace_s: float = 120.0  # extra wait on the first submission (the streams worker starts)
    wait_for_load: bool = True  # a submission completes only once vLLM serves its version
    dead_letter_service: str = "finetune"
    curriculum_seed: int = 0
    plot_title: str = "rlstream finetune"
    stop_on_failure: bool = False  # a failed epoch (its version not trained or not served) ends the run


def trajectory_problem(event: TrajectoryEvent) -> str | None:
    """Why an event cannot be trained on (None when it can): NAT's episode rules (non-empty, first message user
    or system, no two consecutive assistant messages), a finite reward, a trainable turn on an assistant message."""
    if not event.messages:
        return "empty episode"
    if event.messages[0].role not in ("user", "system"):
        return f"episode starts with {event.messages[0].role}, not user or system"
    for prev, item in zip(event.messages, event.messages[1:]):
        if prev.role == item.role == "assistant":
            return "two consecutive assistant messages"
    if event.reward is None or not math.isfinite(event.reward):
        return f"non-finite reward {event.reward}"
    if not any(t.trainable for t in event.turns):
        return "no trainable turn"
    for turn in event.turns:
        index = turn.message_index
        if index is None or not 0 < index < len(event.messages) or event.messages[index].role != "assistant":
            return f"turn points at message {index}, which is not an assistant message"
    return None


def checked_groups(candidates: Sequence[CandidateGroup], min_group_size: int,
                   rejected: list[Rejection]) -> tuple[list[list[TrajectoryEvent]], list[tuple[str, Generation, str]]]:
    """Each group's trainable events, and the (group_id, generation, reason) of every member left out.

    A group that lost members is renumbered (group_size = its survivors); one left with fewer than
    ``min_group_size`` survivors loses them too. A group that lost nothing keeps its group_size, so a failed
    generation still makes the streams worker wait for it until the group timeout."""
    groups: list[list[TrajectoryEvent]] = []
    dropped: list[tuple[str, Generation, str]] = []
    for candidate in candidates:
        kept: list[Generation] = []
        for member in candidate.members:
            problem = member.problem or (trajectory_problem(member.event) if member.event is not None
                                         else "not converted")
            if problem is None:
                kept.append(member)
            else:
                dropped.append((candidate.group_id, member, problem))
        if kept and len(kept) < min_group_size:
            reason = f"group has {len(kept)} trainable generations, fewer than streams.min_group_size {min_group_size}"
            dropped += [(candidate.group_id, m, reason) for m in kept]
            continue
        good = [m.event for m in kept if m.event is not None]
        if good and len(good) < len(candidate.members):
            good = [e.model_copy(update={"group_size": len(good), "generation_index": i}) for i, e in enumerate(good)]
        if good:
            groups.append(good)
    rejected += [Rejection(group_id, reason) for group_id, _, reason in dropped]
    return groups, dropped


def finite_rewards(collected: CollectedGroup) -> list[float]:
    """The finite rewards of an assembled group's members."""
    return [t.reward for t in collected.group.trajectories if t.reward is not None and math.isfinite(t.reward)]


# --- the engine -------------------------------------------------------------------------------------------
class EpochEngine:
    """Runs epochs (or single submissions) on an opened :class:`FinetuneContext`."""

    def __init__(self, context: FinetuneContext, curriculum: CurriculumConfig,
                 settings: EngineSettings = EngineSettings()) -> None:
        self.context = context
        self.cfg = context.cfg
        self.settings = settings
        self.learner = EpochLearner(context)
        self.curriculum = EpochCurriculum(curriculum, seed=settings.curriculum_seed)
        self.outputs = FinetuneOutputs(context.output_dir)
        self.outcomes: list[TrainingOutcome] = []
        self.router: VersionRouter | None = None
        self._dead_letters: DeadLetterSink | None = None
        self._publisher: TrajectoryPublisher | None = None
        self._submissions = 0

    # -- set-up --
    async def open(self) -> None:
        """Load the policy to train, start the trajectory publisher; the context must be open."""
        ctx = self.context
        assert ctx.producer is not None and ctx.control is not None, "open the FinetuneContext first"
        await self.learner.open()
        topics = ctx.topics
        publisher = TrajectoryPublisher.from_config(self.cfg.kafka, topics.trajectories, topics.rewards,
                                                    max_in_flight=self.cfg.rollout.max_in_flight)
        await publisher.start()
        self._publisher = publisher
        self._dead_letters = DeadLetterSink(ctx.producer, ctx.codec, topics.dlq, self.settings.dead_letter_service,
                                            best_effort=True)
        self.router = VersionRouter(ctx.control, self.cfg.policy, self.cfg.rollout.model, ctx.worker_id)
        self.outputs.set_curriculum(self.curriculum.document())

    async def route(self) -> tuple[str, int]:
        """The model name serving the newest version this run's vLLM has loaded, and that version."""
        assert self.router is not None, "open() first"
        current = await self.router.current()
        return current.model, current.version

    async def healthy(self) -> bool:
        """Whether the engine can train: its lease is held and the run's vLLM answers ``/health``."""
        import httpx

        if self.context.lease_lost:
            return False
        try:
            async with httpx.AsyncClient(timeout=5.0) as http:
                return (await http.get(f"{self.context.server_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        """Stop the trajectory publisher (the context is closed by its owner)."""
        if self._publisher is not None:
            try:
                await self._publisher.close()
            except Exception as exc:
                log.warning("trajectory publisher closed with errors", error=str(exc))
            self._publisher = None

    # -- the epoch loop --
    async def run(self, generator: EpochGenerator, num_epochs: int, validation_interval: int) -> list[TrainingOutcome]:
        """``num_epochs`` epochs; validation when ``epoch % validation_interval == 0`` and after the last epoch
        (the final model, which NAT never validates). Writes the plot at the end."""
        for epoch in range(num_epochs):
            self.context.check_alive()
            if generator.validates and epoch % validation_interval == 0:
                await self.validate(generator, epoch)
            outcome = await self.run_epoch(generator, epoch)
            if outcome is not None:
                self.outcomes.append(outcome)
                if "loss" in outcome.figures:
                    await self._emit(LEARNER_LOSS, outcome.figures["loss"], epoch)
                if outcome.status == OutcomeStatus.FAILED and self.settings.stop_on_failure:
                    self.plot()
                    raise FinetuneError(f"epoch {epoch} failed: {outcome.message} (the run stops at a failed "
                                        "epoch; continue_on_failure: true goes on)")
            if self.context.lease_lost:
                raise FinetuneError(f"learner lease lost: {self.context.lease_lost}")
        if generator.validates:
            await self.validate(generator, num_epochs)
        self.plot()
        return self.outcomes

    async def validate(self, generator: EpochGenerator, epoch: int) -> None:
        """One validation pass; a pass that fails is recorded empty and logged, never failing the run."""
        try:
            rewards = await generator.validate(epoch)
        except Exception as exc:
            log.error("validation pass failed", epoch=epoch, error=f"{type(exc).__name__}: {exc}")
            rewards = []
        record = validation_record(epoch, rewards)
        self.outputs.add_validation(record)
        if record["num_examples"]:
            await self._emit(VALIDATION_REWARD_MEAN, record["avg_reward"], epoch)
        log.info("validation", epoch=epoch, avg_reward=round(record["avg_reward"], 4), examples=len(rewards))

    async def run_epoch(self, generator: EpochGenerator, epoch: int) -> TrainingOutcome | None:
        """Generate, publish, collect, curriculum, record; train and publish a version (None: nothing to train)."""
        started = time.monotonic()
        candidates = await generator.generate(epoch)
        rejected: list[Rejection] = []
        collected, missing = await self.publish_and_collect(candidates, rejected)
        kept_ids = self.curriculum.select([c.group.group_id for c in collected],
                                          [finite_rewards(c) for c in collected], epoch)
        kept = [collected[i] for i in kept_ids]
        record = epoch_record(epoch, self.cfg.run_id, [c.finite_rewards() for c in candidates],
                              [finite_rewards(c) for c in kept],
                              self.curriculum.percentile, self.curriculum.summary())
        self.outputs.add_epoch(record)
        self.outputs.set_curriculum(self.curriculum.document())
        log.info("epoch done", epoch=epoch, avg_reward=round(record["avg_reward"], 4), groups=record["num_groups"],
                 kept=record["filtered_groups"], percentile=record["curriculum_percentile"],
                 rejected=len(rejected), seconds=round(time.monotonic() - started, 1))
        await self._emit(REWARD_MEAN, record["avg_reward"], epoch)
        if record["filtered_groups"]:
            await self._emit(REWARD_MEAN_FILTERED, record["filtered_avg_reward"], epoch)
        await self._emit(CURRICULUM_PERCENTILE, self.curriculum.percentile, epoch)
        await self._status(epoch, record)
        if not kept:
            log.warning("nothing to train this epoch", epoch=epoch, groups=len(candidates))
            return None
        outcome = await self.train_and_serve(kept)
        outcome.rejected, outcome.missing_groups = rejected, missing
        return outcome

    # -- one submission: the stages after generation --
    async def submit(self, candidates: Sequence[CandidateGroup],
                     progress: ProgressFn | None = None) -> TrainingOutcome:
        """Check, publish, collect, then train every collected group into one version and wait until it is served
        (no curriculum: the caller chose the groups). A bad trajectory is dead-lettered, never the submission."""
        rejected: list[Rejection] = []
        report = progress or (lambda _p, _m: None)
        try:
            report(5.0, f"publishing {sum(len(c.members) for c in candidates)} trajectories")
            collected, missing = await self.publish_and_collect(candidates, rejected)
            if not collected:
                reasons = "; ".join(sorted({r.reason for r in rejected})[:3]) or "none"
                message = (f"no trainable group in the submission ({len(rejected)} trajectories rejected: {reasons})"
                           if not missing else f"none of the {len(missing)} groups came out of the streams worker "
                           "within the wait (dead-lettered or filtered: see the dlq topic)")
                return TrainingOutcome(OutcomeStatus.FAILED, message, missing_groups=missing, rejected=rejected)
            outcome = await self.train_and_serve(collected, progress=report)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("submission failed", error=str(exc))
            outcome = TrainingOutcome(OutcomeStatus.FAILED, f"{type(exc).__name__}: {exc}")
        outcome.rejected, outcome.missing_groups = rejected, outcome.missing_groups or []
        return outcome

    async def publish_and_collect(self, candidates: Sequence[CandidateGroup],
                                  rejected: list[Rejection]) -> tuple[list[CollectedGroup], list[str]]:
        """Check and publish the candidates, then collect the groups the streams worker assembles from them;
        returns the collected groups (in candidate order) and the ids of expected groups that did not come."""
        ctx = self.context
        assert self._publisher is not None and ctx.collector is not None, "open() first"
        min_size = min(self.cfg.streams.min_group_size, max((len(c.members) for c in candidates), default=1))
        groups, dropped = checked_groups(candidates, max(1, min_size), rejected)
        for group_id, member, reason in dropped:
            await self._dead_letter(group_id, member, reason)
        for events in groups:
            for event in events:
                await self._publisher.publish_trajectory(event)
        await self._publisher.flush()
        expected = {events[0].group_id for events in groups}
        partial = any(len(events) < events[0].group_size for events in groups)
        wait = self.settings.collect_grace_s + (self.cfg.finetuning.group_timeout_s if partial else 0.0)
        if self._submissions == 0:
            wait += self.settings.first_submission_grace_s
        self._submissions += 1
        arrived = await ctx.collector.collect(expected, expected, wait, ctx.check_alive)
        order = {c.group_id: i for i, c in enumerate(candidates)}
        arrived.sort(key=lambda c: order.get(c.group.group_id, len(order)))
        missing = sorted(expected - {c.group.group_id for c in arrived})
        log.info("groups collected", published=sum(map(len, groups)), expected=len(expected), collected=len(arrived),
                 rejected=len(dropped))
        return arrived, missing

    async def train_and_serve(self, groups: Sequence[CollectedGroup],
                              progress: ProgressFn | None = None) -> TrainingOutcome:
        """Train ``groups`` into one version, publish it and (with ``wait_for_load``) wait until vLLM serves it."""
        report = progress or (lambda _p, _m: None)
        try:
            report(10.0, f"training {len(groups)} groups")
            trained = await self.learner.train_and_publish(
                [TrainingGroup(c.group.trajectories, c.partition, c.offset) for c in groups],
                lambda done, total: report(10.0 + 70.0 * done / max(1, total), f"step {done}/{total}"))
            if trained.version is None:
                return TrainingOutcome(OutcomeStatus.COMPLETED, "no trainable samples; no new version",
                                       figures=trained.figures, groups_trained=len(groups))
            version = trained.version
            report(90.0, f"version {version} published; vLLM loading it")
            if self.settings.wait_for_load and not await self.context.wait_loaded(
                    version, self.cfg.finetuning.load_timeout_s):
                failure = self.context.load_failure(version)
                why = f": {failure}" if failure else f" within {self.cfg.finetuning.load_timeout_s:.0f} s"
                return TrainingOutcome(OutcomeStatus.FAILED, f"version {version} published but vLLM did not load it"
                                       f"{why}", version=version,
                                       figures=trained.figures, groups_trained=len(groups))
            return TrainingOutcome(OutcomeStatus.COMPLETED, f"version {version} trained and served", version=version,
                                   figures=trained.figures, groups_trained=len(groups))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("training failed", error=str(exc))
            return TrainingOutcome(OutcomeStatus.FAILED, f"{type(exc).__name__}: {exc}", groups_trained=0)

    # -- outputs --
    def plot(self) -> None:
        """Write reward_plot.png (a plot that cannot be drawn is logged, never failing the run)."""
        if not self.outputs.epochs:
            return
        try:
            self.outputs.plot(f"{self.settings.plot_title} — {self.cfg.run_id}")
        except Exception as exc:
            log.warning("reward plot not written", error=str(exc))

    def summary(self) -> dict[str, object]:
        """The run's figures: epochs, validations, curriculum and one entry per submission."""
        return {"run_id": self.cfg.run_id, "epochs": self.outputs.epochs, "validations": self.outputs.validations,
                "curriculum": self.outputs.curriculum,
                "jobs": [{"status": o.status.value, "message": o.message, **o.metadata()} for o in self.outcomes]}

    async def _dead_letter(self, group_id: str, member: Generation, reason: str) -> None:
        log.warning("trajectory not trained on", group_id=group_id, reason=reason)
        if self._dead_letters is None:
            return
        value = member.raw or (member.event.model_dump_json().encode() if member.event is not None else b"")
        await self._dead_letters.send(SourceRecord(SUBMISSION_SOURCE, -1, -1, group_id.encode(), value), reason)

    async def _emit(self, name: str, value: float, epoch: int) -> None:
        if self.context.metrics is not None:
            await self.context.metrics.emit(name, value, step=epoch, tags=EPOCH_TAGS)

    async def _status(self, epoch: int, record: dict[str, object]) -> None:
        if self.context.control is None:
            return
        try:
            await self.context.control.set_status(self.cfg.run_id, {
                "kind": "finetune", "epoch": epoch, "avg_reward": record["avg_reward"],
                "filtered_avg_reward": record["filtered_avg_reward"],
                "curriculum_percentile": record["curriculum_percentile"], "updated_at": time.time()})
        except Exception as exc:
            log.warning("run status not written", error=str(exc))
