"""The one train-and-publish loop: train a batch, checkpoint, write a version, announce it.

The learner service (:mod:`rlstream.learner.service`) and the finetune epoch engine (:mod:`rlstream.finetune`)
both train through :class:`TrainPublishLoop`, so its safety rules live here once:

* no checkpoint and no version from weights that are not finite (:data:`REFUSED_NONFINITE`);
* the learner lease is confirmed (renewed) right before every checkpoint and every version; without it nothing is
  written (:data:`REFUSED_LEASE`): a zombie learner writes neither;
* a version's checkpoint is written before the version is announced (a crash between the two is repaired by
  :meth:`TrainPublishLoop.announce_pending` on restart);
* the announcement goes through the caller's :class:`~rlstream.learner.publish.Announcer` (transactional, one id
  per policy: Kafka fences a zombie) and a fenced or lease-less announcement stops publication
  (:data:`REFUSED_FENCED`, :meth:`LeaseGuard.lost`);
* the base weights are version 0, announced like any version before the first one is trained
  (:meth:`TrainPublishLoop.announce_base`): the promotion gate serves it first, so nothing unevaluated serves and
  ``rlstream rollback --to 0`` has a version to go back to.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from rlstream.learner.batch import Sample
from rlstream.learner.checkpoint import CheckpointStore, LearnerState
from rlstream.learner.policy import Policy
from rlstream.learner.publish import Announcer, PublicationFenced, announce, store_version, write_version
from rlstream.learner.step import GRPOTrainerStep, StepStats
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import PolicyVersion, WeightsKind
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane, Lease, LeaseLost
from rlstream.transport.log import get_logger

log = get_logger(__name__)
#: why a due checkpoint or version was not written (:attr:`Saved.refused`)
REFUSED_NONFINITE, REFUSED_LEASE, REFUSED_FENCED = "nonfinite_weights", "lease_not_confirmed", "fenced"


class LeaseGuard(Protocol):
    """The caller's hold on the learner lease."""

    @property
    def lease(self) -> Lease:
        """The lease held now (a guard that takes an expired lease back may hand out a new one)."""

    async def confirm(self) -> bool:
        """Renew the lease now: True when it is held (False: nothing may be written this time)."""

    def lost(self, exc: BaseException) -> None:
        """The lease is gone or the announcement was fenced: this learner must not publish again."""


@dataclass
class Saved:
    """What :meth:`TrainPublishLoop.save` wrote: a checkpoint, a version, or why neither."""

    checkpointed: bool = False
    version: PolicyVersion | None = None
    refused: str | None = None


@dataclass(frozen=True)
class PublicationTarget:
    """Where versions go: the policy, the run that trains it, the topics and the versions' root directory."""

    policy: str
    run_id: str
    topics: TopicNames
    versions_root: Path
    lease_ttl_s: float
    weight_store: str | None = None  # a URL: versions are uploaded there and announced by URL (publish.store_version)
    weight_store_options: Mapping[str, Any] = field(default_factory=dict)


class TrainPublishLoop:
    """Train a batch, checkpoint, write a version, announce it (see the module docstring)."""

    def __init__(self, *, policy: Policy, trainer: GRPOTrainerStep, state: LearnerState, target: PublicationTarget,
                 announcer: Announcer, control: ControlPlane, codec: AvroCodec, guard: LeaseGuard,
                 store: CheckpointStore | None = None,
                 before_step: Callable[[list[Sample]], None] | None = None) -> None:
        self.policy = policy
        self.trainer = trainer
        self.state = state
        self.target = target
        self.announcer = announcer
        self.control = control
        self.codec = codec
        self.guard = guard
        self.store = store  # None: no checkpoints (a run that never resumes)
        self.before_step = before_step  # e.g. hand the batch to the other data-parallel ranks

    def train(self, samples: list[Sample]) -> StepStats | None:
        """One learner step on ``samples`` (``learner.num_iterations`` optimizer steps; runs in the caller's
        thread; None when there is no sample). The learner step counts up either way."""
        stats = None
        if samples:
            if self.before_step is not None:
                self.before_step(samples)
            stats = self.trainer.step(samples)
        self.state.step += 1
        return stats

    async def train_batch(self, samples: list[Sample]) -> StepStats | None:
        """:meth:`train` in a worker thread."""
        return await asyncio.to_thread(self.train, samples)

    def record_trained(self, positions: Sequence[tuple[int, int]]) -> None:
        """The ``groups`` records (partition, offset) trained into the weights since the last version."""
        for partition, offset in positions:
            self.state.record_trained(partition, offset)

    async def save(self, *, checkpoint: bool, publish: bool, figures: dict[str, float],
                   before_commit: Callable[[], None] | None = None) -> Saved:
        """Write what is due: a checkpoint (with ``checkpoint`` or ``publish``) and a version (with ``publish``),
        each only from finite weights and with the lease confirmed right before."""
        checkpoint = checkpoint or publish
        if not checkpoint:
            return Saved()
        bad = await asyncio.to_thread(self.policy.nonfinite_parameters)
        if bad:
            log.error("weights are not finite: no checkpoint and no version", step=self.state.step,
                      parameters=bad[:5], count=len(bad))
            return Saved(refused=REFUSED_NONFINITE)
        if not await self.guard.confirm():
            return Saved(refused=REFUSED_LEASE)  # a zombie writes no checkpoint nor version
        if publish:
            self.state.version += 1
            self.state.start_publication()
        saved = Saved()
        if self.store is not None:
            await asyncio.to_thread(self.store.save, self.state, self.policy.model, self.trainer.optimizer,
                                    self.trainer.scheduler)
            saved.checkpointed = True
        if publish:
            saved.version = await self.announce_pending(figures, before_commit)
            if saved.version is None:
                saved.refused = REFUSED_FENCED
        return saved

    async def announce_base(self) -> PolicyVersion | None:
        """Announce the untrained weights as version 0 when nothing of the policy was announced yet (the Redis
        latest pointer is unset) and this learner starts from them; None when it did nothing (a restart, a resumed
        learner) or the lease is gone or Kafka fenced the announcer (the guard is told)."""
        if self.state.version != 0 or await self.control.latest_version(self.target.policy) >= 0:
            return None
        if not await self.guard.confirm():
            return None
        event = await self.announce_pending({})
        if event is not None:
            log.info("base weights announced as version 0", policy=self.target.policy, uri=event.uri)
        return event

    async def announce_pending(self, figures: dict[str, float],
                               before_commit: Callable[[], None] | None = None) -> PolicyVersion | None:
        """Write and announce ``state.version`` with the lineage in ``state.publishing_offsets``; None (and the
        guard is told) when the lease is gone or Kafka fenced the announcer."""
        state, target = self.state, self.target
        directory, manifest = await asyncio.to_thread(write_version, self.policy, target.versions_root, target.policy,
                                                      state.version)
        uri = await asyncio.to_thread(store_version, directory, target.weight_store, state.version,
                                      target.weight_store_options)
        try:
            event = await announce(
                announcer=self.announcer, codec=self.codec, control=self.control, lease=self.guard.lease,
                topic=target.topics.policy_versions, groups_topic=target.topics.groups, policy_name=target.policy,
                run_id=target.run_id, directory=directory, manifest=manifest, version=state.version,
                step=state.step, kind=WeightsKind(manifest["kind"]),
                base_model=self.policy.base_model, offsets=state.publishing_offsets,
                group_count=state.publishing_groups, metrics=figures, lease_ttl_s=target.lease_ttl_s,
                before_commit=before_commit, uri=uri)
        except (PublicationFenced, LeaseLost) as exc:
            self.guard.lost(exc)
            return None
        state.publishing_offsets, state.publishing_groups = {}, 0
        return event
