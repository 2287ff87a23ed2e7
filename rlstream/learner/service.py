"""The learner service: lease -> resume -> consume ``groups`` -> GRPO steps -> checkpoints -> publications.

Exactly-once: the checkpoint holds the next offset to read per partition of ``groups``; on start the
learner seeks there (Kafka's committed offsets are written for lag monitoring only). Every publication step is
also a checkpoint step, written *before* the version is announced, so a published version's lineage
(``trained_on``) is always backed by a checkpoint and no group is trained twice into a published lineage;
a crash between the checkpoint and the announcement is repaired on restart (the version is announced then).
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition

from rlstream.learner.batch import BatchError, Sample, samples_from_groups
from rlstream.learner.checkpoint import CheckpointStore, LearnerState
from rlstream.learner.policy import Policy, load_policy
from rlstream.learner.publish import announce, write_version
from rlstream.learner.step import GRPOTrainerStep, StepStats, step_figures
from rlstream.transport import metric_names
from rlstream.transport.control import ControlPlane, Lease, LeaseLost
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.kafka import make_consumer, make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.metrics import MetricsPublisher
from rlstream.transport.topic_reader import TopicReader, fetch_batch, wait_for_partitions
from rlstream.schemas.codec import AvroCodec, CodecError
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryGroup, TrajectorySource, WeightsKind
from rlstream.schemas.topics import TopicNames

log = get_logger(__name__)
SERVICE = "learner"


@dataclass
class TakenGroup:
    """One record of ``groups`` read for the next step (with its samples when it is usable)."""

    partition: int
    offset: int
    group: TrajectoryGroup | None
    samples: list[Sample]


class Learner:
    """One learner process for one policy."""

    def __init__(self, cfg: RlstreamConfig, *, holder: str | None = None, kill_after_step: int | None = None) -> None:
        self.cfg = cfg
        self.lcfg = cfg.learner
        self.topics = TopicNames.from_config(cfg.topics)
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self.kill_after_step = kill_after_step  # fault injection for tests: SIGKILL self after this step
        self.codec = AvroCodec()
        self.output_dir = Path(self.lcfg.output_dir)
        self.store = CheckpointStore(self.output_dir / "checkpoints", keep=self.lcfg.keep_checkpoints)
        self.versions_root = self.output_dir / "versions"
        self._buffer: deque[ConsumerRecord] = deque()
        self._stop = asyncio.Event()
        self.lease: Lease | None = None
        self.lease_lost = False
        self.policy: Policy | None = None  # the trained model, once loaded

    def request_stop(self) -> None:
        self._stop.set()

    # -- main ------------------------------------------------------------------------------------------
    async def run(self) -> LearnerState:
        """Run until ``learner.total_steps`` or a stop request; returns the final state."""
        control = ControlPlane(self.cfg.redis.url, self.cfg.redis.retry_max_s)
        producer = make_producer(self.cfg.kafka)
        consumer = make_consumer(self.cfg.kafka, group_id=f"{self.cfg.policy}-learner",
                                 isolation_level="read_committed")
        renew_task: asyncio.Task[None] | None = None
        try:
            self.lease = await self._acquire(control)
            if self.lease is None:
                return LearnerState()
            renew_task = asyncio.create_task(self._renew_loop(control))
            policy = self.policy = await asyncio.to_thread(load_policy, self.lcfg)
            trainer = GRPOTrainerStep(policy, self.lcfg)
            state = await asyncio.to_thread(self.store.load_latest, policy.model, trainer.optimizer,
                                            trainer.scheduler) or LearnerState()
            await producer.start()
            metrics = MetricsPublisher(producer, self.codec, self.topics.metrics, SERVICE, self.cfg.run_id,
                                       prometheus_port=self.lcfg.prometheus_port)
            await self._finish_interrupted_publication(state, policy, producer, control)
            await consumer.start()
            await self._assign_and_seek(consumer, state)
            # records that do not decode (or that no step can use, see _decode) go to dlq with the reason
            reader = TopicReader(consumer, self.codec, TrajectoryGroup, errors=(CodecError, ValueError),
                                 dead_letters=DeadLetterSink(producer, self.codec, self.topics.dlq, SERVICE))
            log.info("learner started", policy=self.cfg.policy, step=state.step, version=state.version,
                     offsets=state.offsets, holder=self.holder)
            while state.step < self.lcfg.total_steps and not self._stop.is_set() and not self.lease_lost:
                taken = await self._take_groups(reader, self.lcfg.groups_per_step)
                if taken is None:
                    break
                await self._train_step(state, taken, policy, trainer, producer, control, metrics, consumer)
            return state
        finally:
            if renew_task:
                renew_task.cancel()
            await consumer.stop()
            await producer.stop()
            if self.lease and not self.lease_lost:
                try:
                    await control.release_lease(self.cfg.policy, self.lease)
                except Exception as exc:  # noqa: BLE001 - the lease expires by itself anyway
                    log.warning("lease release failed", error=str(exc))
            await control.close()

    async def _acquire(self, control: ControlPlane) -> Lease | None:
        waiter = asyncio.create_task(control.wait_for_lease(self.cfg.policy, self.holder, self.lcfg.lease_ttl_s,
                                                            poll_s=min(1.0, self.lcfg.lease_ttl_s / 4)))
        stopper = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if waiter in done:
            return waiter.result()
        waiter.cancel()
        return None

    async def _renew_loop(self, control: ControlPlane) -> None:
        assert self.lease is not None
        while True:
            await asyncio.sleep(self.lcfg.lease_ttl_s / 3)
            try:
                await control.renew_lease(self.cfg.policy, self.lease, self.lcfg.lease_ttl_s)
            except LeaseLost as exc:
                log.error("learner lease lost; stopping without publishing", error=str(exc))
                self.lease_lost = True
                self._stop.set()
                return

    # -- consuming ---------------------------------------------------------------------------------------
    async def _assign_and_seek(self, consumer: Any, state: LearnerState) -> None:
        tps = await wait_for_partitions(consumer, self.topics.groups, timeout_s=10.0)
        consumer.assign(tps)
        for tp in tps:
            if tp.partition in state.offsets:
                consumer.seek(tp, state.offsets[tp.partition])
            else:
                await consumer.seek_to_beginning(tp)

    async def _take_groups(self, reader: TopicReader[TrajectoryGroup], n: int) -> list[TakenGroup] | None:
        """The next ``n`` usable groups (bad records are dead-lettered and skipped but still consumed)."""
        taken: list[TakenGroup] = []
        usable = 0
        while usable < n:
            if self._stop.is_set() or self.lease_lost:
                return None
            if not self._buffer:
                # decoded one at a time below: a record left in the buffer at a stop is not dead-lettered yet
                self._buffer.extend(await fetch_batch(reader.consumer, timeout_ms=500, max_records=256))
                continue
            record = self._buffer.popleft()
            item = await self._decode(reader, record)
            taken.append(item)
            usable += item.group is not None
        return taken

    async def _decode(self, reader: TopicReader[TrajectoryGroup], record: ConsumerRecord) -> TakenGroup:
        skipped = TakenGroup(record.partition, record.offset, None, [])
        decoded = await reader.decode(record)
        if decoded is None:  # already dead-lettered by the reader
            return skipped
        group = decoded.event
        try:
            if group.policy != self.cfg.policy:
                raise BatchError(f"group of policy {group.policy!r}, this learner trains {self.cfg.policy!r}")
            if any(t.source == TrajectorySource.validation for t in group.trajectories):
                # held-out evaluation traffic: consumed, never trained on (not an error, so no dead letter)
                self.validation_groups_skipped += 1
                return skipped
            samples = samples_from_groups([group], self._tokenizer, self.cfg.finetuning.target_functions,
                                          self.cfg.finetuning.target_model)
            return TakenGroup(record.partition, record.offset, group, samples)
        except (BatchError, ValueError) as exc:  # decoded, but no step can use it
            await reader.reject(decoded.source, exc)
        return skipped

    _tokenizer: Any = None
    validation_groups_skipped: int = 0

    # -- training ----------------------------------------------------------------------------------------
    async def _train_step(self, state: LearnerState, taken: list[TakenGroup], policy: Policy,
                          trainer: GRPOTrainerStep, producer: Any, control: ControlPlane,
                          metrics: MetricsPublisher, consumer: Any) -> None:
        samples: list[Sample] = []
        groups = [t for t in taken if t.group is not None]
        for index, t in enumerate(groups):
            for s in t.samples:
                s.group = index
                samples.append(s)
        stats = await asyncio.to_thread(trainer.step, samples) if samples else None
        state.step += 1
        for t in taken:
            state.offsets[t.partition] = t.offset + 1
            first_last = state.pending_ranges.setdefault(t.partition, [t.offset, t.offset])
            first_last[1] = t.offset
        state.pending_groups += len(groups)
        state.groups_trained += len(groups)
        lag = [state.version - g.group.max_policy_version for g in groups if g.group is not None]
        await self._report(state, stats, lag, metrics, control, len(groups))
        if self.kill_after_step is not None and state.step == self.kill_after_step:
            log.warning("fault injection: SIGKILL after step", step=state.step)
            os.kill(os.getpid(), signal.SIGKILL)
        publish_due = state.step % self.lcfg.publish_every == 0
        if publish_due:
            state.version += 1
            state.publishing_ranges = dict(state.pending_ranges)
            state.publishing_groups = state.pending_groups
            state.pending_ranges, state.pending_groups = {}, 0
        if publish_due or state.step % self.lcfg.checkpoint_every == 0:
            await asyncio.to_thread(self.store.save, state, policy.model, trainer.optimizer, trainer.scheduler)
        if publish_due:
            await self._publish(state, policy, producer, control, stats.figures() if stats else {})
        await self._commit_for_monitoring(consumer, state)

    async def _report(self, state: LearnerState, stats: StepStats | None, lag: list[int],
                      metrics: MetricsPublisher, control: ControlPlane, n_groups: int) -> None:
        tags = {metric_names.STEP_TAG: metric_names.STEP_LEARNER, "policy": self.cfg.policy}
        await metrics.emit_many(step_figures(stats, n_groups, lag), step=state.step, tags=tags)
        if stats is not None:
            await metrics.emit(metric_names.REWARD_MEAN, stats.reward_mean, step=state.version,
                               tags={metric_names.STEP_TAG: metric_names.STEP_VERSION, "policy": self.cfg.policy})
        await control.set_status(self.cfg.run_id, {"learner_step": state.step, "learner_version": state.version,
                                                   "learner_groups_trained": state.groups_trained,
                                                   "learner_loss": stats.loss if stats else 0.0})
        log.info("learner step", step=state.step, groups=n_groups,
                 loss=round(stats.loss, 5) if stats else None, reward_mean=round(stats.reward_mean, 4) if stats else None,
                 tokens_per_s=round(stats.tokens_per_s, 1) if stats else None)

    async def _publish(self, state: LearnerState, policy: Policy, producer: Any, control: ControlPlane,
                       figures: dict[str, float]) -> None:
        assert self.lease is not None
        directory, manifest = await asyncio.to_thread(write_version, policy, self.versions_root, self.cfg.policy,
                                                      state.version)
        await announce(
            producer=producer, codec=self.codec, control=control, lease=self.lease,
            topic=self.topics.policy_versions, groups_topic=self.topics.groups, policy_name=self.cfg.policy,
            run_id=self.cfg.run_id, directory=directory, manifest=manifest, version=state.version, step=state.step,
            kind=WeightsKind.lora if policy.lora else WeightsKind.full, base_model=policy.base_model,
            ranges=state.publishing_ranges, group_count=state.publishing_groups, metrics=figures,
            lease_ttl_s=self.lcfg.lease_ttl_s)
        state.publishing_ranges, state.publishing_groups = {}, 0

    async def _finish_interrupted_publication(self, state: LearnerState, policy: Policy, producer: Any,
                                              control: ControlPlane) -> None:
        """A checkpoint written for a publication that was never announced: announce it now."""
        self._tokenizer = policy.tokenizer
        if not state.publishing_ranges and not state.publishing_groups:
            return
        if state.version > await control.latest_version(self.cfg.policy):
            log.warning("announcing a version whose publication was interrupted", version=state.version)
            await self._publish(state, policy, producer, control, {})
        state.publishing_ranges, state.publishing_groups = {}, 0

    async def _commit_for_monitoring(self, consumer: Any, state: LearnerState) -> None:
        try:
            await consumer.commit({TopicPartition(self.topics.groups, p): o for p, o in state.offsets.items()})
        except Exception as exc:  # noqa: BLE001 - monitoring only; the checkpoint holds the truth
            log.debug("offset commit for monitoring failed", error=str(exc))
