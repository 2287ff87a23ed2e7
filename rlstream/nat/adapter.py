"""``rlstream_trainer_adapter``: NAT's trajectories into rlstream's pipeline, and a job status that follows it.

``initialize`` stands up the run's side of rlstream (:func:`rlstream.finetune.runtime.prepare`): broker and
Redis (the configured ones, else local ones), topics, the streams worker, an inference sync worker on the vLLM
server the workflow calls, and the learner (in this process, LoRA or full weights, fenced by its lease).

``submit`` turns each trajectory into a TrajectoryEvent, dead-letters the ones that cannot be trained on (with
the reason; the rest of the submission goes on), publishes the others to ``trajectories``, waits for the
streams worker to emit their groups on ``groups``, trains on them and publishes a version. The job is
``running`` until the inference workers have loaded that version; ``failed`` (with the reason) when no group
came through the streams worker or training failed.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nat.data_models.finetuning import (FinetuneConfig, TrainingJobRef, TrainingJobStatus, TrainingStatusEnum,
                                        Trajectory, TrajectoryCollection)
from nat.finetuning.interfaces.trainer_adapter import TrainerAdapter

from rlstream.finetune.components import GRPOTrainerAdapter, GRPOTrainerAdapterConfig
from rlstream.finetune.interfaces import EpisodeItem as RlEpisodeItem
from rlstream.finetune.interfaces import EpisodeItemRole as RlRole
from rlstream.finetune.interfaces import Trajectory as RlTrajectory
from rlstream.finetune.interfaces import TrajectoryCollection as RlCollection
from rlstream.finetune.runtime import FinetuneContext, Infrastructure, fresh_run_id, prepare
from rlstream.nat.builder import CONVERSATION_KEY
from rlstream.nat.config import RlstreamTrainerAdapterConfig
from rlstream.nat.nat_config import NatConfigError, llm_field, resolved_config, target_llm_name
from rlstream.rollout.routing import VersionRouter
from rlstream.schemas.config import RlstreamConfig, load_config
from rlstream.schemas.models import Message, TrajectoryEvent, TrajectorySource, Turn
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.log import get_logger
from rlstream.transport.topic_reader import SourceRecord

log = get_logger(__name__)
BACKEND = "rlstream"
#: the pseudo-topic of dead letters for trajectories rejected before they reached Kafka
SUBMISSION_SOURCE = "nat-submission"


@dataclass
class Rejected:
    group_id: str
    reason: str


@dataclass
class Job:
    status: TrainingJobStatus
    task: asyncio.Task[Any] | None = None
    rejected: list[Rejected] = field(default_factory=list)


def _setting_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def trajectory_problem(event: TrajectoryEvent) -> str | None:
    """Why an event cannot be trained on (None when it can): NAT's episode rules, a finite reward, a turn."""
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


class RlstreamTrainerAdapter(TrainerAdapter):
    """NAT TrainerAdapter publishing to rlstream's Kafka topics; status = the pipeline's progress."""

    def __init__(self, adapter_config: RlstreamTrainerAdapterConfig) -> None:
        super().__init__(adapter_config=adapter_config)
        self.config = adapter_config
        self.cfg: RlstreamConfig | None = None
        self.infra: Infrastructure | None = None
        self.context: FinetuneContext | None = None
        self.learner: GRPOTrainerAdapter | None = None
        self.router: VersionRouter | None = None
        self.dead_letters: DeadLetterSink | None = None
        self.jobs: dict[str, Job] = {}
        self._publisher: Any = None

    # -- set-up --
    def rlstream_config(self, run_config: FinetuneConfig) -> tuple[RlstreamConfig, str]:
        """The rlstream config of this run (backend file < backend fields < settings < training) and the URL of
        the vLLM server the workflow calls."""
        backend = self.config.backend
        nat_config = resolved_config(run_config.run_configuration) if run_config.run_configuration else None
        llm = target_llm_name(nat_config, run_config) if nat_config is not None else None
        served = llm_field(nat_config, llm, "model_name") if llm else None
        url = backend.inference_url or (llm_field(nat_config, llm, "base_url") if llm else None)
        if not url:
            raise NatConfigError("rlstream_trainer_adapter: no vLLM server: set backend.inference_url, or "
                                 "finetuning.target_model to an LLM with a base_url")
        pairs: list[tuple[str, str]] = []
        for key, value in (("kafka.bootstrap_servers", backend.bootstrap_servers), ("redis.url", backend.redis_url),
                           ("policy", backend.policy), ("run_id", backend.name), ("learner.model", backend.base_model),
                           ("rollout.model", served), ("inference.served_model", served)):
            if value:
                pairs.append((key, str(value)))
        pairs += [(key, _setting_text(value)) for key, value in backend.settings.items()]
        if self.config.training is not None:
            pairs += self.config.training.overrides()
        # the NAT builder already chose the target functions and model: every turn it sent is trained
        pairs += [("finetuning.output_dir", str(run_config.output_dir)), ("finetuning.target_functions", '["<workflow>"]')]
        cfg = fresh_run_id(load_config(backend.config_file, pairs))
        ft = cfg.finetuning.model_copy(update={"target_model": None})
        return cfg.model_copy(update={"finetuning": ft}), url

    async def initialize(self, run_config: FinetuneConfig) -> None:
        await super().initialize(run_config)
        from rlstream.rollout.publisher import TrajectoryPublisher

        cfg, url = self.rlstream_config(run_config)
        self.infra = await asyncio.to_thread(prepare, cfg, url, self.config.start_timeout_s)
        self.cfg = self.infra.cfg
        self.context = FinetuneContext(self.cfg, self.infra.server_url)
        self.context.supervisor = self.infra.supervisor
        await self.context.open()
        self.learner = GRPOTrainerAdapter(GRPOTrainerAdapterConfig(wait_for_load=self.config.wait_for_load),
                                          self.context)
        await self.learner.initialize(self.cfg.finetuning)
        topics = self.context.topics
        self._publisher = TrajectoryPublisher.from_config(self.cfg.kafka, topics.trajectories, topics.rewards,
                                                          max_in_flight=self.cfg.rollout.max_in_flight)
        await self._publisher.start()
        assert self.context.producer is not None and self.context.control is not None
        self.dead_letters = DeadLetterSink(self.context.producer, self.context.codec, topics.dlq, "nat-adapter",
                                           best_effort=True)
        self.router = VersionRouter(self.context.control, self.cfg.policy, self.cfg.rollout.model,
                                    self.context.worker_id)
        log.info("rlstream backend ready", run_id=self.cfg.run_id, policy=self.cfg.policy, vllm=self.infra.server_url)

    async def route(self) -> tuple[str, int]:
        """The model name serving the newest loaded version, and that version (for the builder)."""
        assert self.router is not None, "initialize() first"
        current = await self.router.current()
        return current.model, current.version

    async def is_healthy(self) -> bool:
        return self.learner is not None and await self.learner.is_healthy()

    # -- submission --
    def to_event(self, trajectory: Trajectory, group_id: str, example_id: str, size: int,
                 index: int) -> TrajectoryEvent:
        """A NAT trajectory as a TrajectoryEvent (rlstream's builder's conversation, else the episode)."""
        assert self.cfg is not None
        meta = trajectory.metadata or {}
        version = int(meta.get("policy_version", 0) or 0)
        conversation = meta.get(CONVERSATION_KEY)
        if conversation is not None:
            return TrajectoryEvent(
                run_id=self.cfg.run_id, example_id=example_id, group_id=group_id, group_size=size,
                generation_index=index, policy=self.cfg.policy, policy_version=version,
                source=TrajectorySource.rollout, reward=float(trajectory.reward), producer_id="nat",
                messages=[Message.model_validate(m) for m in conversation["messages"]],
                turns=[Turn.model_validate(t) for t in conversation["turns"]],
                metadata={"nat_run_id": str(meta.get("run_id", "")), "served_model": str(meta.get("model") or "")})
        episode = [RlEpisodeItem(RlRole(item.role.value), item.content,
                                 item.logprobs if isinstance(item.logprobs, list) else None,
                                 dict(item.metadata or {})) for item in trajectory.episode]  # type: ignore[union-attr]
        foreign = RlTrajectory(episode=episode, reward=float(trajectory.reward), metadata={"policy_version": version})
        return foreign.to_event(run_id=self.cfg.run_id, policy=self.cfg.policy, group_id=group_id,
                                example_id=example_id, group_size=size, generation_index=index)

    async def _reject(self, job: Job, group_id: str, trajectory: Trajectory, reason: str) -> None:
        job.rejected.append(Rejected(group_id, reason))
        log.warning("trajectory not trained on", group_id=group_id, reason=reason)
        if self.dead_letters is not None:
            value = trajectory.model_dump_json().encode() if isinstance(trajectory, Trajectory) else b""
            await self.dead_letters.send(SourceRecord(SUBMISSION_SOURCE, -1, -1, group_id.encode(), value), reason)

    async def _events(self, job: Job, collection: TrajectoryCollection) -> list[list[TrajectoryEvent]]:
        """The trainable events of each group; a bad trajectory is dead-lettered, never the submission."""
        assert self.cfg is not None
        min_size = min(self.cfg.streams.min_group_size, max(1, max((len(g) for g in collection.trajectories),
                                                                    default=1)))
        groups: list[list[TrajectoryEvent]] = []
        for position, members in enumerate(collection.trajectories):
            example_id = str((members[0].metadata or {}).get("id", position)) if members else str(position)
            group_id = f"{self.cfg.run_id}:{collection.run_id}:{example_id}"
            good: list[tuple[Trajectory, TrajectoryEvent]] = []
            for index, trajectory in enumerate(members):
                try:
                    event = self.to_event(trajectory, group_id, example_id, len(members), index)
                    problem = trajectory_problem(event)
                except Exception as exc:  # any malformed field: this trajectory only
                    problem = f"{type(exc).__name__}: {exc}"
                if problem:
                    await self._reject(job, group_id, trajectory, problem)
                else:
                    good.append((trajectory, event))
            if good and len(good) < min_size:
                for trajectory, _ in good:
                    await self._reject(job, group_id, trajectory, f"group has {len(good)} trainable generations, "
                                       f"fewer than streams.min_group_size {min_size}")
                continue
            if good:
                groups.append([e.model_copy(update={"group_size": len(good), "generation_index": i})
                               for i, (_, e) in enumerate(good)])
        return groups

    def _set(self, job: Job, status: TrainingStatusEnum, progress: float, message: str, **meta: Any) -> None:
        merged = {**(job.status.metadata or {}), **meta, "rejected_trajectories": len(job.rejected)}
        job.status = TrainingJobStatus(run_id=job.status.run_id, backend=BACKEND, status=status,
                                       progress=min(100.0, max(0.0, progress)), message=message, metadata=merged)

    async def submit(self, trajectories: TrajectoryCollection) -> TrainingJobRef:
        if self.learner is None:
            raise RuntimeError("rlstream_trainer_adapter: initialize() was not called")
        job_id = uuid.uuid4().hex[:12]
        job = Job(TrainingJobStatus(run_id=trajectories.run_id, backend=BACKEND, status=TrainingStatusEnum.PENDING,
                                    progress=0.0, message="queued", metadata={}))
        self.jobs[job_id] = job
        job.task = asyncio.create_task(self._run(job, trajectories))
        return TrainingJobRef(run_id=trajectories.run_id, backend=BACKEND, metadata={"job_id": job_id})

    async def _run(self, job: Job, collection: TrajectoryCollection) -> None:
        assert self.context is not None and self.context.collector is not None and self.learner is not None
        try:
            groups = await self._events(job, collection)
            if not groups:
                self._set(job, TrainingStatusEnum.FAILED, 100.0, "no trainable group in the submission "
                          f"({len(job.rejected)} trajectories rejected: {self._reasons(job)})")
                return
            self._set(job, TrainingStatusEnum.RUNNING, 5.0, f"publishing {sum(map(len, groups))} trajectories")
            for events in groups:
                for event in events:
                    await self._publisher.publish_trajectory(event)
            await self._publisher.flush()
            expected = {events[0].group_id for events in groups}
            self._set(job, TrainingStatusEnum.RUNNING, 10.0, f"waiting for {len(expected)} groups from the streams "
                      "worker")
            collected = await self.context.collector.collect(expected, expected, self.config.collect_timeout_s,
                                                             self.context.check_alive)
            missing = sorted(expected - {c.group.group_id for c in collected})
            if not collected:
                self._set(job, TrainingStatusEnum.FAILED, 100.0, f"none of the {len(expected)} groups came out of the "
                          "streams worker within the wait (dead-lettered or filtered: see the dlq topic)",
                          missing_groups=missing)
                return
            ref = await self.learner.submit(RlCollection.from_groups([c.group for c in collected], self.cfg.run_id))
            while True:
                inner = await self.learner.status(ref)
                self._set(job, TrainingStatusEnum(inner.status.value), 10.0 + 0.9 * inner.progress, inner.message,
                          missing_groups=missing, groups_trained=len(collected), **inner.metadata)
                if inner.finished:
                    return
                await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            self._set(job, TrainingStatusEnum.CANCELED, job.status.progress or 0.0, "canceled")
            raise
        except Exception as exc:
            log.exception("submission failed", error=str(exc))
            self._set(job, TrainingStatusEnum.FAILED, job.status.progress or 0.0, f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _reasons(job: Job) -> str:
        reasons = sorted({r.reason for r in job.rejected})
        return "; ".join(reasons[:3]) or "none"

    async def status(self, ref: TrainingJobRef) -> TrainingJobStatus:
        job = self.jobs.get((ref.metadata or {}).get("job_id", ""))
        if job is None:
            raise KeyError(f"unknown training job {ref.metadata!r}")
        return job.status

    async def wait_until_complete(self, ref: TrainingJobRef, poll_interval: float = 0.5) -> TrainingJobStatus:
        deadline_log = time.monotonic() + 30.0
        while True:
            status = await self.status(ref)
            if status.status in (TrainingStatusEnum.COMPLETED, TrainingStatusEnum.FAILED, TrainingStatusEnum.CANCELED):
                return status
            if time.monotonic() > deadline_log:
                log.info("training job", status=status.status.value, progress=status.progress, message=status.message)
                deadline_log = time.monotonic() + 30.0
            await asyncio.sleep(poll_interval)

    def log_progress(self, ref: TrainingJobRef, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        log.info("training progress", job=(ref.metadata or {}).get("job_id"), **metrics)

    async def close(self) -> None:
        """Stop jobs, the learner, the context and every process this run started."""
        for job in self.jobs.values():
            if job.task is not None and not job.task.done():
                job.task.cancel()
        await asyncio.gather(*(j.task for j in self.jobs.values() if j.task is not None), return_exceptions=True)
        if self._publisher is not None:
            try:
                await self._publisher.close()
            except Exception as exc:
                log.warning("trajectory publisher closed with errors", error=str(exc))
        if self.learner is not None:
            await self.learner.close()
        if self.context is not None:
            await self.context.close()
        if self.infra is not None:
            await asyncio.to_thread(self.infra.stop)
            self.infra = None
