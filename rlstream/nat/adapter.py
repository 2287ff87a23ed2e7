"""``rlstream_trainer_adapter``: NAT's trajectories into rlstream's epoch engine (:mod:`rlstream.finetune`).

``initialize`` stands up the run's side of rlstream (:func:`rlstream.finetune.prepare`): broker and Redis (the
configured ones, else local ones), topics, the streams worker, an inference sync worker on the vLLM server the
workflow calls, and the engine's learner (in this process, LoRA or full weights, fenced by its lease).

``submit`` converts each NAT trajectory to a TrajectoryEvent (:func:`to_event`) and hands the groups to
:meth:`EpochEngine.submit <rlstream.finetune.EpochEngine.submit>`: a trajectory that cannot be trained on is
dead-lettered with the reason (the rest of the submission goes on), the others are published, assembled by the
streams worker, trained and published as a version. The job is ``running`` until vLLM has loaded that version;
``failed`` (with the reason) when no group came through the streams worker or training failed.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from nat.data_models.finetuning import (EpisodeItemRole, FinetuneConfig, TrainingJobRef, TrainingJobStatus,
                                        TrainingStatusEnum, Trajectory, TrajectoryCollection)
from nat.finetuning.interfaces.trainer_adapter import TrainerAdapter

from rlstream.finetune import (CandidateGroup, EngineSettings, EpochEngine, FinetuneContext, Generation,
                               Infrastructure, TrainingOutcome, fresh_run_id, prepare, server_root, wait_endpoint)
from rlstream.nat.base_model import resolve_base_model
from rlstream.nat.builder import CONVERSATION_KEY
from rlstream.nat.config import RlstreamTrainerAdapterConfig
from rlstream.nat.nat_config import NatConfigError, llm_field, resolved_config, target_llm_name
from rlstream.schemas.config import CurriculumConfig, RlstreamConfig, load_config
from rlstream.schemas.models import Message, ToolCall, TrajectoryEvent, TrajectorySource, Turn
from rlstream.transport.log import get_logger

log = get_logger(__name__)
BACKEND = "rlstream"
#: the ``service`` of the dead letters of trajectories the adapter could not train on
DEAD_LETTER_SERVICE = "nat-adapter"


@dataclass
class Job:
    status: TrainingJobStatus
    task: asyncio.Task[Any] | None = None


def _setting_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def episode_messages(trajectory: Trajectory) -> tuple[list[Message], list[Turn]]:
    """The messages of a NAT episode (tool calls and tool_call_id kept from the items' metadata; ``other`` items
    become user messages) and one turn per assistant item (no token data: the learner renders it and trains
    on-policy)."""
    messages: list[Message] = []
    turns: list[Turn] = []
    for index, item in enumerate(trajectory.episode):
        meta = item.metadata or {}  # type: ignore[union-attr]
        role = item.role.value if item.role != EpisodeItemRole.OTHER else "user"  # type: ignore[union-attr]
        calls = [ToolCall.model_validate(c) for c in meta.get("tool_calls", [])] or None
        messages.append(Message(role=role, content=item.content, tool_calls=calls,  # type: ignore[union-attr]
                                tool_call_id=meta.get("tool_call_id"), name=meta.get("name")))
        if role == "assistant":
            turns.append(Turn(message_index=index))
    return messages, turns


def to_event(trajectory: Trajectory, *, run_id: str, policy: str, group_id: str, example_id: str, size: int,
             index: int) -> TrajectoryEvent:
    """A NAT trajectory as a TrajectoryEvent: the conversation rlstream's builder recorded (token data
    included), else the episode's messages."""
    meta = trajectory.metadata or {}
    version = int(meta.get("policy_version", 0) or 0)
    conversation = meta.get(CONVERSATION_KEY)
    if conversation is not None:
        messages = [Message.model_validate(m) for m in conversation["messages"]]
        turns = [Turn.model_validate(t) for t in conversation["turns"]]
    else:
        messages, turns = episode_messages(trajectory)
    return TrajectoryEvent(
        run_id=run_id, example_id=example_id, group_id=group_id, group_size=size, generation_index=index,
        policy=policy, policy_version=version, source=TrajectorySource.rollout, reward=float(trajectory.reward),
        producer_id="nat", messages=messages, turns=turns,
        metadata={"nat_run_id": str(meta.get("run_id", "")), "served_model": str(meta.get("model") or "")})


def job_status(run_id: str, outcome: TrainingOutcome) -> TrainingJobStatus:
    """The NAT job status of a finished engine submission."""
    return TrainingJobStatus(run_id=run_id, backend=BACKEND, status=TrainingStatusEnum(outcome.status.value),
                             progress=100.0, message=outcome.message, metadata=outcome.metadata())


class RlstreamTrainerAdapter(TrainerAdapter):
    """NAT TrainerAdapter over rlstream's epoch engine; status = the submission's progress through it."""

    def __init__(self, adapter_config: RlstreamTrainerAdapterConfig) -> None:
        super().__init__(adapter_config=adapter_config)
        self.config = adapter_config
        self.cfg: RlstreamConfig | None = None
        self.infra: Infrastructure | None = None
        self.context: FinetuneContext | None = None
        self.engine: EpochEngine | None = None
        self.curriculum_seed = 0  # set by rlstream_trainer before initialize
        self.jobs: dict[str, Job] = {}
        #: makes the default policy (and so the LoRA names vLLM keeps) unique to this run
        self.run_tag = uuid.uuid4().hex[:6]

    def policy_name(self) -> str | None:
        """``backend.policy``; else ``<project>-<run tag>`` when the rlstream config file does not name one."""
        backend = self.config.backend
        if backend.policy:
            return backend.policy
        if backend.config_file is not None and not backend.project:
            return None  # the file's policy
        return f"{backend.project or 'policy'}-{self.run_tag}"

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
        file_model = load_config(backend.config_file, []).learner.model if backend.config_file else ""
        chosen = backend.base_model or backend.settings.get("learner.model") or file_model or None
        if chosen is None:  # the model vLLM serves: ask it once it answers
            wait_endpoint(server_root(url), self.config.start_timeout_s)
        model = resolve_base_model(chosen, server_root(url))
        pairs: list[tuple[str, str]] = []
        for key, value in (("kafka.bootstrap_servers", backend.bootstrap_servers), ("redis.url", backend.redis_url),
                           ("policy", self.policy_name()),
                           ("run_id", f"{backend.name}-{self.run_tag}" if backend.name else None), ("learner.model", model),
                           ("learner.learning_rate", backend.learning_rate),
                           ("learner.micro_batch_size", backend.batch_size),
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
        cfg, url = await asyncio.to_thread(self.rlstream_config, run_config)
        self.infra = await asyncio.to_thread(prepare, cfg, url, self.config.start_timeout_s)
        self.cfg = self.infra.cfg
        self.context = FinetuneContext(self.cfg, self.infra.server_url)
        self.context.supervisor = self.infra.supervisor
        await self.context.open()
        curriculum = CurriculumConfig.model_validate(run_config.curriculum_learning.model_dump())
        self.engine = EpochEngine(self.context, curriculum, EngineSettings(
            collect_grace_s=self.config.collect_timeout_s, first_submission_grace_s=0.0,
            wait_for_load=self.config.wait_for_load, dead_letter_service=DEAD_LETTER_SERVICE,
            curriculum_seed=self.curriculum_seed, plot_title="rlstream (NAT)",
            stop_on_failure=not self.config.continue_on_failure))
        await self.engine.open()
        log.info("rlstream backend ready", run_id=self.cfg.run_id, policy=self.cfg.policy, vllm=self.infra.server_url)

    async def route(self) -> tuple[str, int]:
        """The model name serving the newest loaded version, and that version (for the builder)."""
        assert self.engine is not None, "initialize() first"
        return await self.engine.route()

    async def is_healthy(self) -> bool:
        return self.engine is not None and await self.engine.healthy()

    # -- submission --
    def candidate_groups(self, collection: TrajectoryCollection) -> list[CandidateGroup]:
        """The engine's view of a NAT collection: one group per example (``metadata.id``), every trajectory
        converted; one that does not convert carries the reason (the engine dead-letters it)."""
        assert self.cfg is not None, "initialize() first"
        groups = []
        for position, members in enumerate(collection.trajectories):
            example_id = str((members[0].metadata or {}).get("id", position)) if members else str(position)
            group_id = f"{self.cfg.run_id}:{collection.run_id}:{example_id}"
            generations = []
            for index, trajectory in enumerate(members):
                raw = trajectory.model_dump_json().encode() if isinstance(trajectory, Trajectory) else b""
                try:
                    event = to_event(trajectory, run_id=self.cfg.run_id, policy=self.cfg.policy, group_id=group_id,
                                     example_id=example_id, size=len(members), index=index)
                    generations.append(Generation(event, float(trajectory.reward), raw))
                except Exception as exc:  # any malformed field: this trajectory only
                    generations.append(Generation(None, float("nan"), raw, f"{type(exc).__name__}: {exc}"))
            groups.append(CandidateGroup(group_id, generations))
        return groups

    def _set(self, job: Job, status: TrainingStatusEnum, progress: float, message: str) -> None:
        job.status = TrainingJobStatus(run_id=job.status.run_id, backend=BACKEND, status=status,
                                       progress=min(100.0, max(0.0, progress)), message=message,
                                       metadata=job.status.metadata)

    def record(self, run_id: str, outcome: TrainingOutcome) -> TrainingJobRef:
        """A finished submission as a job NAT can ask about."""
        job_id = uuid.uuid4().hex[:12]
        self.jobs[job_id] = Job(job_status(run_id, outcome))
        return TrainingJobRef(run_id=run_id, backend=BACKEND, metadata={"job_id": job_id})

    async def submit(self, trajectories: TrajectoryCollection) -> TrainingJobRef:
        if self.engine is None:
            raise RuntimeError("rlstream_trainer_adapter: initialize() was not called")
        job_id = uuid.uuid4().hex[:12]
        job = Job(TrainingJobStatus(run_id=trajectories.run_id, backend=BACKEND, status=TrainingStatusEnum.PENDING,
                                    progress=0.0, message="queued", metadata={}))
        self.jobs[job_id] = job
        job.task = asyncio.create_task(self._run(job, trajectories))
        return TrainingJobRef(run_id=trajectories.run_id, backend=BACKEND, metadata={"job_id": job_id})

    async def _run(self, job: Job, collection: TrajectoryCollection) -> None:
        assert self.engine is not None
        try:
            outcome = await self.engine.submit(self.candidate_groups(collection), progress=lambda p, m: self._set(
                job, TrainingStatusEnum.RUNNING, p, m))
        except asyncio.CancelledError:
            self._set(job, TrainingStatusEnum.CANCELED, job.status.progress or 0.0, "canceled")
            raise
        job.status = job_status(collection.run_id, outcome)

    async def status(self, ref: TrainingJobRef) -> TrainingJobStatus:
        job = self.jobs.get((ref.metadata or {}).get("job_id", ""))
        if job is None:
            raise KeyError(f"unknown training job {ref.metadata!r}")
        return job.status

    async def wait_until_complete(self, ref: TrainingJobRef, poll_interval: float = 0.5) -> TrainingJobStatus:
        while True:
            status = await self.status(ref)
            if status.status in (TrainingStatusEnum.COMPLETED, TrainingStatusEnum.FAILED, TrainingStatusEnum.CANCELED):
                return status
            await asyncio.sleep(poll_interval)

    def log_progress(self, ref: TrainingJobRef, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        log.info("training progress", job=(ref.metadata or {}).get("job_id"), **metrics)

    async def close(self) -> None:
        """Stop jobs, the engine, the context and every process this run started."""
        for job in self.jobs.values():
            if job.task is not None and not job.task.done():
                job.task.cancel()
        await asyncio.gather(*(j.task for j in self.jobs.values() if j.task is not None), return_exceptions=True)
        if self.engine is not None:
            await self.engine.close()
        if self.context is not None:
            await self.context.close()
        if self.infra is not None:
            await asyncio.to_thread(self.infra.stop)
            self.infra = None
