"""rlstream's implementations of the three components, registered by ``_type``:

* ``rlstream_kafka`` TrajectoryBuilder: per epoch, ``num_generations`` generations per example with the
  reference :class:`~rollout.runner.RolloutRunner` (epoch mode, source ``rollout``) -> ``trajectories``;
  the streams worker assembles groups -> collected from ``groups``. Validation passes publish
  ``source=validation`` trajectories, which are never trained on.
* ``rlstream_kafka`` TrainerAdapter: validates trajectories (a bad one is dropped and counted, never failing
  the submission), trains them in-process with the learner's GRPO step, publishes a version (the learner's
  publication code) and waits until the run's vLLM has loaded it.
* ``rlstream_grpo`` Trainer: NAT's epoch loop with the exact curriculum of :mod:`streams.curriculum`,
  validation every ``validation_interval`` epochs and after the last one, the output files and MetricEvents.
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pydantic import Field

from rlstream.finetune.interfaces import (EpisodeItemRole, Trainer, TrainerAdapter, TrainerAdapterConfig, TrainerConfig,
                                     TrainingJobRef, TrainingJobStatus, TrainingStatusEnum, Trajectory,
                                     TrajectoryBuilder, TrajectoryBuilderConfig, TrajectoryCollection)
from rlstream.finetune.epoch_curriculum import EpochCurriculum
from rlstream.finetune.outputs import FinetuneOutputs, epoch_record
from rlstream.schemas.masking import PLACEHOLDER_API_KEY, secret_value
from rlstream.finetune.registry import register_trainer, register_trainer_adapter, register_trajectory_builder
from rlstream.finetune.runtime import FinetuneContext, FinetuneError, with_section
from rlstream.transport.log import get_logger
from rlstream.transport.metric_names import (CURRICULUM_PERCENTILE, LEARNER_LOSS, REWARD_MEAN, REWARD_MEAN_FILTERED, STEP_EPOCH,
                              STEP_TAG, VALIDATION_REWARD_MEAN)
from rlstream.schemas.config import FinetuningConfig, RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent, TrajectorySource

log = get_logger(__name__)
EPOCH_TAGS = {STEP_TAG: STEP_EPOCH}


# --- TrajectoryBuilder ----------------------------------------------------------------------------------
class KafkaTrajectoryBuilderConfig(TrajectoryBuilderConfig, name="rlstream_kafka"):
    num_generations: int | None = Field(None, ge=1, description="default: finetuning.num_generations")
    validation_generations: int = Field(1, ge=1, description="generations per validation example")
    collect_grace_s: float = Field(60.0, gt=0, description="extra wait for groups beyond the group timeout")
    first_epoch_grace_s: float = Field(120.0, ge=0, description="extra wait in epoch 0 (the streams worker starts)")


class RecordingPublisher:
    """Publishes through the run's TrajectoryPublisher, stamps ``source`` and keeps what was written."""

    def __init__(self, inner: Any, source: TrajectorySource) -> None:
        self.inner = inner
        self.source = source
        self.events: list[TrajectoryEvent] = []

    async def publish_trajectory(self, event: TrajectoryEvent) -> Any:
        if event.source != self.source:
            event = event.model_copy(update={"source": self.source})
        meta = await self.inner.publish_trajectory(event)
        self.events.append(event)
        return meta

    async def flush(self, timeout_s: float | None = None) -> None:
        await self.inner.flush(timeout_s)


async def _one_pass(examples: list[dict[str, Any]], label: Any) -> AsyncIterator[tuple[dict[str, Any], Any]]:
    for example in examples:
        yield example, label


def group_id_of(run_id: str, example_id: str, label: Any) -> str:
    """The group id the rollout runner gives one example's group in one pass."""
    return f"{run_id}:{example_id}:{label}"


@dataclass
class EpochGeneration:
    task: asyncio.Task[Any]
    publisher: RecordingPublisher
    epoch: int


class KafkaTrajectoryBuilder(TrajectoryBuilder):
    """Generates with the rollout runner through vLLM and collects the assembled groups from Kafka."""

    def __init__(self, trajectory_builder_config: KafkaTrajectoryBuilderConfig, context: FinetuneContext) -> None:
        super().__init__(trajectory_builder_config)
        self.config = trajectory_builder_config
        self.context = context
        self.cfg = context.cfg
        self.examples: list[dict[str, Any]] = []
        self.validation_examples: list[dict[str, Any]] = []
        self._runs: dict[str, EpochGeneration] = {}
        self._publisher: Any = None
        self._client: Any = None
        self._workflow: Any = None
        self._reward: Any = None
        self.generation_failures = 0

    @property
    def num_generations(self) -> int:
        return self.config.num_generations or self.cfg.finetuning.num_generations

    async def initialize(self, run_config: FinetuningConfig) -> None:
        from openai import AsyncOpenAI

        from rlstream.rollout.loading import load_callable, load_examples
        from rlstream.rollout.publisher import TrajectoryPublisher
        from rlstream.rollout.workflows import check_workflow

        await super().initialize(run_config)
        rcfg = self.cfg.rollout
        if rcfg.dataset is None:
            raise FinetuneError("no training dataset: give --dataset or set rollout.dataset")
        self.examples = load_examples(rcfg.dataset, rcfg.example_id_field)
        val_cfg = self.context.validation_cfg or self.cfg
        val_path = run_config.validation_dataset or val_cfg.finetuning.validation_dataset
        if val_path is not None:
            self.validation_examples = load_examples(val_path, val_cfg.rollout.example_id_field)
        self._workflow = check_workflow(load_callable(rcfg.workflow or "rlstream.rollout.workflows:single_turn"))
        reward_ref = rcfg.reward_function or run_config.reward_function.function
        if not reward_ref:
            raise FinetuneError("finetune needs a reward: set rollout.reward_function or "
                                "finetuning.reward_function.function (module:function)")
        self._reward = load_callable(reward_ref)
        topics = self.context.topics
        self._publisher = TrajectoryPublisher.from_config(self.cfg.kafka, topics.trajectories, topics.rewards,
                                                          max_in_flight=rcfg.max_in_flight)
        await self._publisher.start()
        self._client = AsyncOpenAI(base_url=self.context.base_url, api_key=secret_value(rcfg.api_key) or PLACEHOLDER_API_KEY,
                                   timeout=self.cfg.inference.request_timeout_s)

    def _pass_config(self, base: RlstreamConfig, group_size: int, n_examples: int) -> RlstreamConfig:
        return with_section(base, "rollout", group_size=group_size, mode="epoch", epochs=1, max_groups=None,
                            groups_per_version=max(1, n_examples), route_worker_id=self.context.worker_id,
                            base_url=self.context.base_url, prompts_topic=None)

    def _runner(self, cfg: RlstreamConfig, publisher: RecordingPublisher, workflow: Any, reward: Any) -> Any:
        from rlstream.rollout.runner import RolloutRunner

        assert self.context.control is not None
        return RolloutRunner(cfg, workflow, self._client, publisher,  # type: ignore[arg-type]
                             self.context.control, reward, self.context.rollout_metrics)

    async def start_run(self, run_id: str, meta: dict[str, Any] | None = None) -> None:
        epoch = int((meta or {}).get("epoch", len(self._runs)))
        cfg = self._pass_config(self.cfg, self.num_generations, len(self.examples))
        publisher = RecordingPublisher(self._publisher, TrajectorySource.rollout)
        runner = self._runner(cfg, publisher, self._workflow, self._reward)
        task = asyncio.create_task(runner.run(_one_pass(self.examples, epoch)))
        self._runs[run_id] = EpochGeneration(task, publisher, epoch)
        log.info("epoch generation started", epoch=epoch, examples=len(self.examples),
                 generations=self.num_generations)

    async def finalize(self, run_id: str, meta: dict[str, Any] | None = None) -> TrajectoryCollection:
        gen = self._runs.pop(run_id)
        try:
            stats = await gen.task
            failed = stats.generations_failed
        except Exception as exc:  # the runner itself broke: keep what it published
            log.error("epoch generation stopped early; going on with what was published", epoch=gen.epoch,
                      error=str(exc))
            failed = -1
        self.generation_failures += max(0, failed)
        kafka_run = self.cfg.run_id
        candidates = {group_id_of(kafka_run, str(e["id"]), gen.epoch) for e in self.examples}
        published: dict[str, int] = {}
        for event in gen.publisher.events:
            published[event.group_id] = published.get(event.group_id, 0) + 1
        min_size = min(self.cfg.streams.min_group_size, self.num_generations)
        expected = {g for g, n in published.items() if n >= min_size}
        partial = any(n < self.num_generations for g, n in published.items() if g in expected)
        wait = self.config.collect_grace_s + (self.cfg.finetuning.group_timeout_s if partial else 0.0)
        if gen.epoch == 0:
            wait += self.config.first_epoch_grace_s
        assert self.context.collector is not None
        collected = await self.context.collector.collect(candidates, expected, wait, self.context.check_alive)
        groups = [c.group for c in collected]
        self.log_progress(run_id, {"epoch": gen.epoch, "published": len(gen.publisher.events),
                                   "generation_failures": failed, "groups_expected": len(expected),
                                   "groups": len(groups)})
        return TrajectoryCollection.from_groups(groups, kafka_run)

    async def run_validation(self, epoch: int, meta: dict[str, Any] | None = None) -> list[float]:
        from rlstream.rollout.loading import load_callable
        from rlstream.rollout.workflows import check_workflow

        if not self.validation_examples:
            return []
        base = self.context.validation_cfg or self.cfg
        cfg = self._pass_config(base, self.config.validation_generations, len(self.validation_examples))
        workflow = check_workflow(load_callable(base.rollout.workflow)) if base.rollout.workflow else self._workflow
        reward_ref = base.rollout.reward_function or base.finetuning.reward_function.function
        reward = load_callable(reward_ref) if reward_ref else self._reward
        publisher = RecordingPublisher(self._publisher, TrajectorySource.validation)
        runner = self._runner(cfg, publisher, workflow, reward)
        await runner.run(_one_pass(self.validation_examples, f"validation-{epoch}"))
        rewards = [float(e.reward) for e in publisher.events if e.reward is not None]
        log.info("validation pass", epoch=epoch, examples=len(self.validation_examples), scored=len(rewards))
        return rewards

    def log_progress(self, run_id: str, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        log.info("trajectories collected", run_id=run_id, **metrics)

    async def close(self) -> None:
        for gen in self._runs.values():
            gen.task.cancel()
        if self._publisher is not None:
            try:
                await self._publisher.close()
            except Exception as exc:
                log.warning("trajectory publisher closed with errors", error=str(exc))
        if self._client is not None:
            await self._client.close()


@register_trajectory_builder(config_type=KafkaTrajectoryBuilderConfig)
async def kafka_trajectory_builder(config: KafkaTrajectoryBuilderConfig,
                                   builder: FinetuneContext) -> AsyncIterator[Any]:
    component = KafkaTrajectoryBuilder(config, builder)
    try:
        yield component
    finally:
        await component.close()


# --- TrainerAdapter -------------------------------------------------------------------------------------
class GRPOTrainerAdapterConfig(TrainerAdapterConfig, name="rlstream_kafka"):
    validate_trajectories: bool = True
    wait_for_load: bool = Field(True, description="complete a job only when vLLM serves its version")


def episode_problem(trajectory: Trajectory) -> str | None:
    """Why a trajectory cannot be trained on (None when it can): empty episode, first item not user/system,
    two consecutive assistant items, a non-finite reward."""
    episode = trajectory.episode
    if not episode:
        return "empty episode"
    if episode[0].role not in (EpisodeItemRole.USER, EpisodeItemRole.SYSTEM):
        return f"episode starts with {episode[0].role.value}, not user or system"
    for prev, item in zip(episode, episode[1:]):
        if prev.role == item.role == EpisodeItemRole.ASSISTANT:
            return "two consecutive assistant messages"
    if not math.isfinite(trajectory.reward):
        return f"non-finite reward {trajectory.reward}"
    return None


@dataclass
class _Job:
    status: TrainingJobStatus
    task: asyncio.Task[Any] | None = None
    figures: dict[str, float] = field(default_factory=dict)


class GRPOTrainerAdapter(TrainerAdapter):
    """Trains in this process with the learner library and publishes one policy version per job."""

    backend = "rlstream-grpo"

    def __init__(self, adapter_config: GRPOTrainerAdapterConfig, context: FinetuneContext) -> None:
        super().__init__(adapter_config)
        self.config = adapter_config
        self.context = context
        self.cfg = context.cfg
        self.policy: Any = None
        self.trainer_step: Any = None
        self.version = 0
        self.learner_step = 0
        self.rejected: list[tuple[str, str]] = []
        self.jobs: dict[str, _Job] = {}

    async def initialize(self, run_config: FinetuningConfig) -> None:
        from rlstream.learner.policy import load_policy
        from rlstream.learner.step import GRPOTrainerStep

        await super().initialize(run_config)
        self.policy = await asyncio.to_thread(load_policy, self.cfg.learner)
        self.trainer_step = GRPOTrainerStep(self.policy, self.cfg.learner)
        assert self.context.control is not None
        self.version = max(0, await self.context.control.latest_version(self.cfg.policy))

    async def is_healthy(self) -> bool:
        import httpx

        if self.context.lease_lost:
            return False
        try:
            async with httpx.AsyncClient(timeout=5.0) as http:
                return (await http.get(f"{self.context.server_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    def _valid_groups(self, trajectories: TrajectoryCollection) -> list[list[TrajectoryEvent]]:
        """Each group's trainable events; a bad trajectory is dropped (and counted), never the submission."""
        out: list[list[TrajectoryEvent]] = []
        for index, members in enumerate(trajectories.trajectories):
            group_id = trajectories.group_id(index)
            events = []
            for position, trajectory in enumerate(members):
                problem = episode_problem(trajectory) if self.config.validate_trajectories else None
                if problem:
                    self.rejected.append((group_id, problem))
                    log.warning("trajectory not trained on", group_id=group_id, reason=problem)
                    continue
                events.append(trajectory.to_event(run_id=trajectories.run_id, policy=self.cfg.policy,
                                                  group_id=group_id, example_id=str(
                                                      trajectory.metadata.get("example_id", group_id)),
                                                  group_size=len(members), generation_index=position))
            if events:
                out.append(events)
        return out

    async def submit(self, trajectories: TrajectoryCollection) -> TrainingJobRef:
        group_ids = [trajectories.group_id(i) for i in range(len(trajectories.trajectories))]
        ref = TrainingJobRef(run_id=trajectories.run_id, backend=self.backend,
                             metadata={"job_id": uuid.uuid4().hex[:12], "group_ids": group_ids})
        job = _Job(TrainingJobStatus(trajectories.run_id, self.backend, TrainingStatusEnum.PENDING, 0.0, "queued"))
        self.jobs[ref.metadata["job_id"]] = job
        job.task = asyncio.create_task(self._run_job(ref, job, self._valid_groups(trajectories)))
        return ref

    def _set(self, job: _Job, status: TrainingStatusEnum, progress: float, message: str, **meta: Any) -> None:
        job.status = TrainingJobStatus(job.status.run_id, self.backend, status, min(100.0, max(0.0, progress)),
                                       message, {**job.status.metadata, **meta})

    def _train(self, job: _Job, groups: list[list[TrajectoryEvent]]) -> dict[str, float]:
        """Optimizer steps over ``groups`` in chunks of ``learner.groups_per_step`` (runs in a thread)."""
        from rlstream.learner.batch import BatchError, samples_from_trajectory

        lcfg, ft = self.cfg.learner, self.cfg.finetuning
        chunks = [groups[i:i + lcfg.groups_per_step] for i in range(0, len(groups), lcfg.groups_per_step)]
        losses, skipped, steps = [], 0, 0
        tokenizer = self.policy.tokenizer
        for n, chunk in enumerate(chunks):
            samples = []
            for g, events in enumerate(chunk):
                for event in events:
                    try:
                        samples.extend(samples_from_trajectory(event, g, tokenizer, ft.target_functions,
                                                               ft.target_model))
                    except BatchError as exc:
                        skipped += 1
                        self.rejected.append((event.group_id, str(exc)))
                        log.warning("trajectory not trained on", trajectory_id=event.trajectory_id, reason=str(exc))
            if samples:
                stats = self.trainer_step.step(samples)
                losses.append(stats.loss)
                steps += 1
                self.learner_step += 1
            self._set(job, TrainingStatusEnum.RUNNING, 80.0 * (n + 1) / len(chunks), f"step {n + 1}/{len(chunks)}")
        return {"loss": sum(losses) / len(losses) if losses else 0.0, "steps": float(steps),
                "skipped_trajectories": float(skipped)}

    def _offsets(self, group_ids: list[str]) -> dict[int, list[int]]:
        """Per ``groups`` partition, the offsets of the submitted groups (the version's exact lineage)."""
        offsets: dict[int, list[int]] = {}
        collector = self.context.collector
        for gid in group_ids:
            where = collector.positions.get(gid) if collector is not None else None
            if where is not None:
                partition, offset = where
                offsets.setdefault(partition, []).append(offset)
        return offsets

    async def _run_job(self, ref: TrainingJobRef, job: _Job, groups: list[list[TrajectoryEvent]]) -> None:
        from rlstream.learner.publish import announce, write_version
        from rlstream.schemas.models import WeightsKind

        ctx = self.context
        try:
            if not groups:
                self._set(job, TrainingStatusEnum.COMPLETED, 100.0, "nothing to train (every trajectory rejected)")
                return
            self._set(job, TrainingStatusEnum.RUNNING, 0.0, f"training {len(groups)} groups")
            job.figures = await asyncio.to_thread(self._train, job, groups)
            if job.figures["steps"] == 0:
                self._set(job, TrainingStatusEnum.COMPLETED, 100.0, "no trainable samples; no new version",
                          **job.figures)
                return
            if ctx.lease_lost:
                raise FinetuneError(f"learner lease lost: {ctx.lease_lost}")
            version = self.version + 1
            directory, manifest = await asyncio.to_thread(write_version, self.policy, ctx.output_dir / "versions",
                                                          self.cfg.policy, version)
            assert ctx.announcer is not None and ctx.control is not None and ctx.lease is not None
            await announce(producer=ctx.announcer, codec=ctx.codec, control=ctx.control, lease=ctx.lease,
                           topic=ctx.topics.policy_versions, groups_topic=ctx.topics.groups,
                           policy_name=self.cfg.policy, run_id=self.cfg.run_id, directory=directory,
                           manifest=manifest, version=version, step=self.learner_step,
                           kind=WeightsKind.lora if self.policy.lora else WeightsKind.full,
                           base_model=self.policy.base_model, offsets=self._offsets(ref.metadata["group_ids"]),
                           group_count=len(groups), metrics=job.figures, lease_ttl_s=self.cfg.learner.lease_ttl_s)
            self.version = version
            self._set(job, TrainingStatusEnum.RUNNING, 90.0, f"version {version} published; vLLM loading it",
                      version=version, **job.figures)
            if self.config.wait_for_load and not await ctx.wait_loaded(version, self.cfg.finetuning.load_timeout_s):
                self._set(job, TrainingStatusEnum.FAILED, 100.0, f"version {version} published but vLLM did not "
                          f"load it within {self.cfg.finetuning.load_timeout_s:.0f} s")
                return
            self._set(job, TrainingStatusEnum.COMPLETED, 100.0, f"version {version} trained and served")
        except asyncio.CancelledError:
            self._set(job, TrainingStatusEnum.CANCELED, job.status.progress, "canceled")
            raise
        except Exception as exc:
            log.exception("training job failed", error=str(exc))
            self._set(job, TrainingStatusEnum.FAILED, job.status.progress, f"{type(exc).__name__}: {exc}")

    async def status(self, ref: TrainingJobRef) -> TrainingJobStatus:
        job = self.jobs.get(ref.metadata.get("job_id", ""))
        if job is None:
            raise KeyError(f"unknown training job {ref.metadata!r}")
        return job.status

    async def wait_until_complete(self, ref: TrainingJobRef, poll_interval: float = 0.2) -> TrainingJobStatus:
        return await super().wait_until_complete(ref, poll_interval)

    def log_progress(self, ref: TrainingJobRef, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        log.info("training progress", job=ref.metadata.get("job_id"), **metrics)

    async def close(self) -> None:
        for job in self.jobs.values():
            if job.task is not None and not job.task.done():
                job.task.cancel()
        await asyncio.gather(*(j.task for j in self.jobs.values() if j.task is not None), return_exceptions=True)


@register_trainer_adapter(config_type=GRPOTrainerAdapterConfig)
async def grpo_trainer_adapter(config: GRPOTrainerAdapterConfig, builder: FinetuneContext) -> AsyncIterator[Any]:
    component = GRPOTrainerAdapter(config, builder)
    try:
        yield component
    finally:
        await component.close()


# --- Trainer --------------------------------------------------------------------------------------------
class EpochTrainerConfig(TrainerConfig, name="rlstream_grpo"):
    poll_interval_s: float = Field(0.2, gt=0)


class EpochTrainer(Trainer):
    """NAT's epoch loop: validate (every k epochs), generate, curriculum, train, publish; outputs per epoch."""

    def __init__(self, trainer_config: EpochTrainerConfig, context: FinetuneContext) -> None:
        super().__init__(trainer_config)
        self.config = trainer_config
        self.context = context
        self.cfg = context.cfg
        self.curriculum: EpochCurriculum | None = None
        self.outputs: FinetuneOutputs | None = None
        self.statuses: list[TrainingJobStatus] = []

    async def initialize(self, run_config: FinetuningConfig) -> None:
        await super().initialize(run_config)
        self.curriculum = EpochCurriculum(run_config.curriculum_learning, seed=self.cfg.learner.seed)
        self.outputs = FinetuneOutputs(self.context.output_dir)
        self.outputs.set_curriculum(self.get_curriculum_state())

    @property
    def validating(self) -> bool:
        """Validation runs when a validation set is configured (or the builder loaded one)."""
        assert self.run_config is not None
        return bool(self.run_config.validation_dataset or getattr(self.trajectory_builder, "validation_examples", None))

    async def run(self, num_epochs: int) -> list[TrainingJobStatus]:
        assert self.run_config is not None and self.outputs is not None
        interval = self.run_config.validation_interval
        run_id = self.cfg.run_id
        for epoch in range(num_epochs):
            self.context.check_alive()
            if self.validating and epoch % interval == 0:
                await self._validate(epoch, run_id)
            ref = await self.run_epoch(epoch, run_id)
            if ref is not None:
                assert self.trainer_adapter is not None
                status = await self.trainer_adapter.wait_until_complete(ref, self.config.poll_interval_s)
                self.statuses.append(status)
                self.trainer_adapter.log_progress(ref, {"epoch": epoch, "status": status.status.value,
                                                        "message": status.message})
                if "loss" in status.metadata:
                    await self._emit(LEARNER_LOSS, float(status.metadata["loss"]), epoch)
                if self.context.lease_lost:
                    raise FinetuneError(f"learner lease lost: {self.context.lease_lost}")
        if self.validating:
            await self._validate(num_epochs, run_id)  # the final model (NAT never validates it)
        self.outputs.plot(f"rlstream finetune — {run_id}")
        return self.statuses

    async def _validate(self, epoch: int, run_id: str) -> None:
        assert self.outputs is not None
        record = await self.run_validation_evaluation(epoch, run_id)
        self.outputs.add_validation(record)
        if record["num_examples"]:
            await self._emit(VALIDATION_REWARD_MEAN, record["avg_reward"], epoch)
        log.info("validation", epoch=epoch, avg_reward=round(record["avg_reward"], 4), examples=record["num_examples"])

    async def run_epoch(self, epoch: int, run_id: str) -> TrainingJobRef | None:
        assert self.trajectory_builder is not None and self.trainer_adapter is not None and self.outputs is not None
        builder_run = f"{run_id}_epoch_{epoch}"
        started = time.monotonic()
        await self.trajectory_builder.start_run(builder_run, {"epoch": epoch})
        collection = await self.trajectory_builder.finalize(builder_run, {"epoch": epoch})
        kept = self.apply_curriculum_learning(collection, epoch)
        assert self.curriculum is not None
        record = epoch_record(epoch, run_id, [[t.reward for t in g] for g in collection.trajectories],
                              [[t.reward for t in g] for g in kept.trajectories], self.curriculum.percentile,
                              self.curriculum.summary())
        self.outputs.add_epoch(record)
        self.outputs.set_curriculum(self.get_curriculum_state())
        self.log_progress(epoch, {**record, "seconds": round(time.monotonic() - started, 1)})
        await self._emit(REWARD_MEAN, record["avg_reward"], epoch)
        if record["filtered_groups"]:
            await self._emit(REWARD_MEAN_FILTERED, record["filtered_avg_reward"], epoch)
        await self._emit(CURRICULUM_PERCENTILE, self.curriculum.percentile, epoch)
        await self._status(epoch, record)
        if not kept.trajectories:
            log.warning("nothing to train this epoch", epoch=epoch, groups=len(collection.trajectories))
            return None
        return await self.trainer_adapter.submit(kept)

    def apply_curriculum_learning(self, trajectory_collection: TrajectoryCollection,
                                  epoch: int) -> TrajectoryCollection:
        """The NAT curriculum on this epoch's groups (streams.curriculum.select_groups)."""
        assert self.curriculum is not None
        groups = trajectory_collection.trajectories
        kept = self.curriculum.select([trajectory_collection.group_id(i) for i in range(len(groups))],
                                      [[t.reward for t in members] for members in groups], epoch)
        return trajectory_collection.select(kept)

    def get_curriculum_state(self) -> dict[str, Any]:
        assert self.curriculum is not None
        return self.curriculum.document()

    async def _emit(self, name: str, value: float, epoch: int) -> None:
        if self.context.metrics is not None:
            await self.context.metrics.emit(name, value, step=epoch, tags=EPOCH_TAGS)

    async def _status(self, epoch: int, record: dict[str, Any]) -> None:
        if self.context.control is None:
            return
        try:
            await self.context.control.set_status(self.cfg.run_id, {
                "kind": "finetune", "epoch": epoch, "avg_reward": record["avg_reward"],
                "filtered_avg_reward": record["filtered_avg_reward"],
                "curriculum_percentile": record["curriculum_percentile"], "updated_at": time.time()})
        except Exception as exc:
            log.warning("run status not written", error=str(exc))

    async def get_metrics(self, run_id: str) -> dict[str, Any]:
        assert self.outputs is not None
        return {"run_id": run_id, "epochs": self.outputs.epochs, "validations": self.outputs.validations,
                "curriculum": self.outputs.curriculum,
                "jobs": [{"status": s.status.value, "message": s.message, **s.metadata} for s in self.statuses]}

    def log_progress(self, epoch: int, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        log.info("epoch done", epoch=epoch, avg_reward=round(metrics["avg_reward"], 4),
                 groups=metrics["num_groups"], kept=metrics["filtered_groups"],
                 percentile=metrics["curriculum_percentile"], seconds=metrics.get("seconds"))

    async def cleanup(self) -> None:
        if self.outputs is not None and self.outputs.epochs:
            try:
                self.outputs.plot(f"rlstream finetune — {self.cfg.run_id}")
            except Exception as exc:
                log.warning("reward plot not written", error=str(exc))


@register_trainer(config_type=EpochTrainerConfig)
async def epoch_trainer(config: EpochTrainerConfig, builder: FinetuneContext) -> AsyncIterator[Any]:
    yield EpochTrainer(config, builder)
