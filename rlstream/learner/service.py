"""The learner service: lease -> resume -> consume ``groups`` -> GRPO steps -> checkpoints -> publications.

Exactly-once: the checkpoint holds the next offset to read per partition of ``groups``; on start the
learner seeks there (Kafka's committed offsets are written for lag monitoring only). Every publication step is
also a checkpoint step, written *before* the version is announced, so a published version's lineage
(``trained_on``) is always backed by a checkpoint and no group is trained twice into a published lineage;
a crash between the checkpoint and the announcement is repaired on restart (the version is announced then).

Lineage is exact: ``trained_on`` holds the offsets of the groups trained into the version and no other record.
Records that are consumed but not trained on: groups of another policy, of a run outside ``learner.run_ids``,
validation groups, and stale groups (a turn they train was produced more than ``streams.max_policy_lag`` versions
before the version the step trains on top of, or, while a promotion gate holds serving behind it, before the serving
version; each turn judged by its own recorded version) are skipped and counted
(``learner/groups_skipped``, tag ``reason``); records that do not
decode, and groups that cannot be tokenised or batched (e.g. a token id outside the vocabulary), go to ``dlq``
with the reason. A step whose loss or gradient is not finite changes nothing (``learner/nonfinite_skipped``), and
weights that are not finite are never checkpointed nor published (``learner/publish_refused``).

Under ``torchrun`` the ranks train together (:mod:`rlstream.learner.distributed`): replicated, or sharded with
FSDP2 (``learner.parallelism: fsdp``, :mod:`rlstream.learner.sharded`).

Under a promotion gate the learner starts no step while it is ``learner.max_versions_ahead_of_serving`` versions
ahead of the serving version, and after ``learner.reset_after_rejections`` rejections on ``promotions`` it moves back
to the serving version's verified weights with a new optimizer (:mod:`rlstream.learner.reset`, docs/off-policy.md).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiokafka import ConsumerRecord, TopicPartition

from rlstream.learner import distributed

from rlstream.learner.batch import (Sample, behaviour_version, collate, mark_stale_rows_without_logprobs,
                                    samples_from_groups)
from rlstream.learner.checkpoint import CheckpointStore, LearnerState
from rlstream.learner.policy import Policy, load_policy, pick_device, require_model_dir
from rlstream.learner.loop import REFUSED_NONFINITE, PublicationTarget, TrainPublishLoop
from rlstream.learner.publish import Announcer, versions_root
from rlstream.learner.reset import fresh_trainer, load_serving_weights, verified_serving_weights, versions_ahead
from rlstream.learner.reporting import Reporters, check_report_to
from rlstream.learner.sharded import ShardedCheckpointStore
from rlstream.learner.step import GRPOTrainerStep, StepStats, step_figures
from rlstream.learner.waiting import WaitingForGroups
from rlstream.transport import metric_names
from rlstream.transport.control import ControlPlane, Lease, LeaseLost
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.kafka import make_consumer, make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.manifest import ManifestError
from rlstream.transport.metrics import MetricsPublisher
from rlstream.transport.promotions import PromotionsFollower
from rlstream.transport.serving import ServingControl, ServingPointer, staleness_reference
from rlstream.transport.signals import on_stop_signals
from rlstream.transport.topic_reader import TopicReader, fetch_batch, wait_for_partitions
from rlstream.schemas.codec import CodecError, codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, MetricEvent, PolicyVersion, TrajectoryGroup, TrajectorySource
from rlstream.schemas.topics import TopicNames

log = get_logger(__name__)
#: how long a training step waits for Redis (lease check, status) before it goes on without it
REDIS_PATIENCE_IN_STEP_S = 3.0
#: how often the learner reads the serving pointer (its staleness reference under a promotion gate)
SERVING_REFRESH_S = 2.0
SERVICE = "learner"
#: how often a learner held at ``learner.max_versions_ahead_of_serving`` looks at the serving pointer and ``promotions``
HELD_POLL_S = 1.0
#: after a failed move back to the serving version (its weights did not verify), how long before the next try
RESET_RETRY_S = 30.0
#: Why a group was consumed without training (the ``reason`` tag of ``learner/groups_skipped``).
SKIP_OTHER_POLICY, SKIP_OTHER_RUN, SKIP_VALIDATION = "other_policy", "other_run", "validation"
#: A group whose oldest trained turn is more than ``streams.max_policy_lag`` versions behind the learner's version.
SKIP_STALE = "stale"


@dataclass
class TakenGroup:
    """One record of ``groups`` read for the next step (with its samples when it is usable)."""

    partition: int
    offset: int
    group: TrajectoryGroup | None
    samples: list[Sample]


class Learner:
    """One learner process for one policy."""

    def __init__(self, cfg: RlstreamConfig, *, holder: str | None = None, kill_after_step: int | None = None,
                 pause_in_announcement: int | None = None) -> None:
        self.cfg = cfg
        self.lcfg = cfg.learner
        self.topics = TopicNames.from_config(cfg.topics)
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self.kill_after_step = kill_after_step  # fault injection for tests: SIGKILL self after this step
        # fault injection for tests: SIGSTOP self once this version's record is sent, before its transaction commits
        self.pause_in_announcement = pause_in_announcement
        check_report_to(self.lcfg.report_to)  # a missing tracker package fails now, not after the first step
        self.codec = codec_for(cfg)
        # a registry that is down or refuses a schema stops the learner now, not after its first step
        self.codec.ensure_registered([PolicyVersion.avro_name, MetricEvent.avro_name, DeadLetter.avro_name])
        self.output_dir = Path(self.lcfg.output_dir)
        self.store = CheckpointStore(self.output_dir / "checkpoints", keep=self.lcfg.keep_checkpoints)
        self.versions_root = versions_root(self.output_dir, self.lcfg.weight_store)
        self._buffer: deque[ConsumerRecord] = deque()
        self._stop = asyncio.Event()
        self.lease: Lease | None = None
        self.lease_lost = False
        self._metrics: MetricsPublisher | None = None
        self._lease_reported: bool | None = None  # the last learner/lease_held value emitted
        self.policy: Policy | None = None  # the trained model, once loaded
        self.skipped: Counter[str] = Counter()  # groups consumed without training, by reason (since start)
        self.validation_groups_skipped = 0
        self._tokenizer: Any = None
        self._vocab_size: int | None = None
        self._reader: TopicReader[TrajectoryGroup] | None = None
        self._reporters = Reporters([])
        self.parallel: distributed.DataParallel | None = None
        self._lease_lock = asyncio.Lock()
        self._known_version = 0  # the newest version this learner published or resumed from
        self.training_version = 0  # the version the current step trains on top of (its checkpoint's)
        self.loop: TrainPublishLoop | None = None  # train, checkpoint, write a version, announce it
        self._waiting: WaitingForGroups | None = None  # tells the rollout when this learner has nothing to read
        self._serving_control: ServingControl | None = None  # the gate's serving pointer (staleness reference)
        self._serving: int | None = None
        self._serving_pointer: ServingPointer | None = None
        self._serving_read_at = float("-inf")
        self._promotions: PromotionsFollower | None = None  # the gate's decisions (when to move back to serving)
        self._reset_failed_at = float("-inf")
        self._held_since: float | None = None  # held at learner.max_versions_ahead_of_serving since then

    def request_stop(self) -> None:
        self._stop.set()

    # -- main ------------------------------------------------------------------------------------------
    async def run(self) -> LearnerState:
        """Run until ``learner.total_steps`` or a stop request; returns the final state.

        Under ``torchrun`` (``WORLD_SIZE`` > 1) rank 0 runs this loop and the other ranks follow it
        (:mod:`rlstream.learner.distributed`)."""
        require_model_dir(self.lcfg.model)  # before the lease is taken and anything is loaded
        self.parallel = distributed.from_environment(self._device(), sharded=self.lcfg.parallelism == "fsdp")
        if self.parallel is not None and self.parallel.sharded:  # every rank writes its shards (DCP)
            self.store = ShardedCheckpointStore(self.output_dir / "checkpoints", self.parallel,
                                                keep=self.lcfg.keep_checkpoints)
        try:
            if self.parallel is not None and not self.parallel.is_driver:
                return await self._follow(self.parallel)
            return await self._drive()
        finally:
            distributed.shutdown()

    def _device(self) -> torch.device:
        device = pick_device(self.lcfg.device)
        if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            torch.cuda.set_device(distributed.local_rank())  # one GPU per rank
            device = torch.device("cuda", distributed.local_rank())
        return device

    async def _load(self) -> tuple[Policy, GRPOTrainerStep, LearnerState]:
        """The policy, its trainer and the newest checkpoint's state; on every rank, the same replica."""
        policy = self.policy = await asyncio.to_thread(load_policy, self.lcfg, parallel=self.parallel)
        trainer = GRPOTrainerStep(policy, self.lcfg, self.parallel)
        state = await asyncio.to_thread(self.store.load_latest, policy.model, trainer.optimizer,
                                        trainer.scheduler) or LearnerState()
        if self.parallel is not None:
            if not await asyncio.to_thread(self.parallel.same_everywhere, state.step):
                raise RuntimeError("the ranks resumed from different checkpoints (is learner.output_dir shared?)")
            if not self.parallel.sharded:  # sharded: each rank's shards come from the same files and seed
                await asyncio.to_thread(self.parallel.copy_from_driver, list(policy.trainable_parameters()))
        return policy, trainer, state

    async def _follow(self, parallel: distributed.DataParallel) -> LearnerState:
        """A rank > 0: wait for the driver's start, then run each step it broadcasts until it says stop."""
        command, _ = await asyncio.to_thread(parallel.broadcast_command)
        if command != distributed.START:
            return LearnerState()
        policy, trainer, state = await self._load()
        log.info("data-parallel rank following the driver", rank=parallel.rank, world_size=parallel.world_size,
                 step=state.step)
        while True:
            command, payload = await asyncio.to_thread(parallel.broadcast_command)
            if command == distributed.RESET:  # the driver moved back to the serving version's weights
                await asyncio.to_thread(load_serving_weights, policy, payload)
                trainer = fresh_trainer(policy, self.lcfg, trainer, parallel)
                continue
            if command in (distributed.NONFINITE, distributed.CHECKPOINT, distributed.GATHER):
                await asyncio.to_thread(self._join_collective, command, payload, policy, trainer)
                continue
            if command != distributed.STEP:
                return state
            await asyncio.to_thread(trainer.step, payload)
            state.step += 1

    def _join_collective(self, command: str, payload: Any, policy: Policy, trainer: GRPOTrainerStep) -> None:
        """A sharded follower's part of a collective the driver runs outside a step (what it announced)."""
        if command == distributed.NONFINITE:
            policy.nonfinite_parameters()
        elif command == distributed.CHECKPOINT:
            self.store.save(LearnerState.from_json(payload), policy.model, trainer.optimizer, trainer.scheduler)
        elif command == distributed.GATHER:
            with policy.publishable():
                pass

    async def _drive(self) -> LearnerState:
        control = ControlPlane(self.cfg.redis.url, self.cfg.redis.retry_max_s)
        producer = make_producer(self.cfg.kafka)
        # announcements only: transactional, one id per policy, started once the lease is held (fences a zombie)
        announcer = Announcer.for_policy(self.cfg.kafka, self.cfg.policy)
        announcer_started = False
        consumer = make_consumer(self.cfg.kafka, group_id=f"{self.cfg.policy}-learner",
                                 isolation_level="read_committed")
        decisions: Any = None  # the gate's decisions, read from the topic's start (when rejections can reset)
        renew_task: asyncio.Task[None] | None = None
        try:
            self.lease = await self._acquire(control)
            if self.lease is None:
                return LearnerState()
            renew_task = asyncio.create_task(self._renew_loop(control))
            if self.parallel is not None:
                await asyncio.to_thread(self.parallel.broadcast_command, distributed.START)
            policy, trainer, state = await self._load()
            self.loop = TrainPublishLoop(
                policy=policy, trainer=trainer, state=state, announcer=announcer, control=control, codec=self.codec,
                target=PublicationTarget(self.cfg.policy, self.cfg.run_id, self.topics, self.versions_root,
                                         self.lcfg.lease_ttl_s, self.lcfg.weight_store,
                                         dict(self.lcfg.weight_store_options)),
                guard=_LearnerLease(self, control), store=self.store, before_step=self._broadcast_step)
            self._known_version = max(state.version, await control.latest_version(self.cfg.policy))
            self._waiting = WaitingForGroups(control, self.cfg.policy)
            self._serving_control = ServingControl(control)
            self._tokenizer, self._vocab_size = policy.tokenizer, policy.vocab_size
            self._reporters = Reporters.open(
                self.lcfg.report_to, log_dir=self.lcfg.logging_dir or self.output_dir / "logs",
                run_name=f"{self.cfg.run_id}-{self.cfg.policy}", config=self.lcfg.model_dump(mode="json"))
            await producer.start()
            await announcer.producer.start()
            announcer_started = True
            metrics = self._metrics = MetricsPublisher(producer, self.codec, self.topics.metrics, SERVICE,
                                                       self.cfg.run_id, prometheus_port=self.lcfg.prometheus_port)
            await self._report_lease(not self.lease_lost)
            await self._finish_interrupted_publication(state, control)
            await self.loop.announce_base()  # version 0: what serves before the gate promoted anything
            await consumer.start()
            await self._assign_and_seek(consumer, state)
            if self.lcfg.reset_after_rejections > 0:
                decisions = make_consumer(self.cfg.kafka, group_id=None)
                await decisions.start()
                self._promotions = PromotionsFollower(decisions, self.codec, self.topics.promotions, self.cfg.policy)
            # records that do not decode (or that no step can use, see _decode) go to dlq with the reason
            reader = self._reader = TopicReader(
                consumer, self.codec, TrajectoryGroup, errors=(CodecError, ValueError),
                dead_letters=DeadLetterSink(producer, self.codec, self.topics.dlq, SERVICE))
            log.info("learner started", policy=self.cfg.policy, step=state.step, version=state.version,
                     offsets=state.offsets, holder=self.holder, num_iterations=self.lcfg.num_iterations)
            while state.step < self.lcfg.total_steps and not self._stop.is_set() and not self.lease_lost:
                self.training_version = state.version  # what the next step trains on top of (staleness is against it)
                if not await self._within_bound_of_serving(state, metrics):
                    break
                taken = await self._take_groups(reader, self.lcfg.groups_per_step)
                if taken is None:
                    break
                await self._train_step(state, taken, control, metrics, consumer)
            return state
        finally:
            if self.parallel is not None:  # release the other ranks (waiting for START, or in their loop)
                try:
                    await asyncio.to_thread(self.parallel.broadcast_command, distributed.STOP)
                except Exception as exc:  # noqa: BLE001 - a dead rank: torchrun stops the group anyway
                    log.warning("could not tell the other ranks to stop", error=str(exc))
            if renew_task:
                renew_task.cancel()
            self._reporters.close()
            await consumer.stop()
            if decisions is not None:
                await decisions.stop()
            await producer.stop()
            if announcer_started:
                try:
                    await announcer.producer.stop()
                except Exception as exc:  # noqa: BLE001 - a fenced producer may fail to close cleanly
                    log.warning("announcing producer stop failed", error=str(exc))
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
        while not self.lease_lost:
            await asyncio.sleep(self.lcfg.lease_ttl_s / 3)
            try:
                await control.renew_lease(self.cfg.policy, self.lease, self.lcfg.lease_ttl_s)
                await self._report_lease(True)
            except LeaseLost as exc:
                await self._report_lease(False)
                if not await self._regain(control, exc):
                    return
            except Exception as exc:  # noqa: BLE001 - Redis gone past redis.retry_max_s: keep trying, never die
                await self._report_lease(False)
                log.warning("lease renewal failed; retrying (no checkpoint or version until it succeeds)",
                            error=str(exc))

    async def _report_lease(self, held: bool) -> None:
        """Emit ``learner/lease_held`` when it changes (once the metrics publisher exists)."""
        if self._metrics is None or held == self._lease_reported:
            return
        try:
            await self._metrics.emit(metric_names.LEARNER_LEASE_HELD, 1.0 if held else 0.0,
                                     tags={"policy": self.cfg.policy})
            self._lease_reported = held
        except Exception as exc:  # noqa: BLE001 - Kafka unreachable too: the next change or renewal tries again
            log.warning("lease state not reported", held=held, error=str(exc))

    async def _regain(self, control: ControlPlane, exc: LeaseLost) -> bool:
        """After a failed renewal: take the lease back when it merely expired (Redis was unreachable for longer
        than its ttl) and no other learner published meanwhile; otherwise the learner stops (it lost it)."""
        async with self._lease_lock:
            if self.lease_lost:
                return False
            try:
                holder = await control.lease_holder(self.cfg.policy)
                if self.lease is not None and holder == self.lease.value:
                    return True  # already taken back (the renewal loop and a step both noticed)
                if holder is None:
                    lease = await control.acquire_lease(self.cfg.policy, self.holder, self.lcfg.lease_ttl_s)
                    if lease is not None:
                        if await control.latest_version(self.cfg.policy) <= self._known_version:
                            log.warning("learner lease expired while Redis was unreachable; taken back",
                                        policy=self.cfg.policy, fencing_token=lease.token)
                            self.lease = lease
                            return True
                        await control.release_lease(self.cfg.policy, lease)
            except Exception as retry_exc:  # noqa: BLE001 - still unreachable: the next renewal tries again
                log.warning("lease not taken back yet", error=str(retry_exc))
                return True
            self._lost(exc)
            return False

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
                if self._waiting is not None:
                    await (self._waiting.reading() if self._buffer else self._waiting.nothing_to_read())
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
        reason = self._skip_reason(group)
        if reason is not None:  # consumed, never trained on, not an error: counted, no dead letter
            self.skipped[reason] += 1
            if reason == SKIP_VALIDATION:
                self.validation_groups_skipped += 1
            log.debug("group skipped", reason=reason, group_id=group.group_id, policy=group.policy,
                      run_id=group.run_id, partition=record.partition, offset=record.offset)
            return skipped
        try:
            samples = samples_from_groups([group], self._tokenizer, self.cfg.finetuning.target_functions,
                                          self.cfg.finetuning.target_model, vocab_size=self._vocab_size)
            if samples:
                collate(samples, pad_id=0)  # batchable on its own (padding values do not matter here)
            behaviour = behaviour_version(group, samples)
            reference = staleness_reference(self.training_version, await self._serving_version())
            if reference - behaviour > self.cfg.streams.max_policy_lag:  # e.g. a backlog left while it was down
                self.skipped[SKIP_STALE] += 1
                log.info("stale group skipped", group_id=group.group_id, lag=self.training_version - behaviour,
                         max_policy_lag=self.cfg.streams.max_policy_lag, version=self.training_version,
                         judged_against=reference, partition=record.partition, offset=record.offset)
                return skipped
            return TakenGroup(record.partition, record.offset, group, samples)
        except Exception as exc:  # noqa: BLE001 - decoded, but it cannot be tokenised or batched: no step can use it
            await reader.reject(decoded.source, exc)
        return skipped

    async def _serving_version(self) -> int | None:
        """The version a promotion gate lets serve (None without a gate), read at most every
        ``SERVING_REFRESH_S``; while Redis cannot answer, the last one read."""
        now = time.monotonic()
        if self._serving_control is not None and now - self._serving_read_at >= SERVING_REFRESH_S:
            self._serving_read_at = now
            try:
                pointer = await asyncio.wait_for(self._serving_control.serving(self.cfg.policy),
                                                 timeout=REDIS_PATIENCE_IN_STEP_S)
                self._serving = pointer.version if pointer is not None else None
                self._serving_pointer = pointer
            except Exception as exc:  # noqa: BLE001 - staleness falls back to the last pointer read
                log.warning("serving pointer not read (Redis unreachable?)", error=str(exc))
        return self._serving

    # -- bounded ahead of serving --------------------------------------------------------------------------
    def versions_ahead(self, state: LearnerState) -> int | None:
        """How many versions the learner's weights are ahead of serving (None without a serving pointer)."""
        if self._serving is None:
            return None
        return versions_ahead(state.version, self._serving, state.reset_to, state.reset_at)

    async def _within_bound_of_serving(self, state: LearnerState, metrics: MetricsPublisher) -> bool:
        """Before a step: move back to the serving version's weights when the gate's rejections call for it
        (:meth:`_reset_due`), then wait while the learner is ``learner.max_versions_ahead_of_serving`` versions ahead
        of serving. False when the learner is asked to stop while it waits."""
        bound = self.lcfg.max_versions_ahead_of_serving
        tags = {"policy": self.cfg.policy}
        while True:
            await self._serving_version()
            ahead = self.versions_ahead(state)
            if ahead is None:
                self._held_since = None
                return True
            if await self._reset_due(state, ahead, bound) and await self._reset_to_serving(state, metrics):
                continue
            if bound is None or ahead < bound:
                if self._held_since is not None:
                    log.info("learner within its bound of the serving version again", ahead=ahead, bound=bound,
                             serving=self._serving, version=state.version,
                             held_s=round(time.monotonic() - self._held_since, 1))
                self._held_since = None
                return True
            if self._held_since is None:
                self._held_since = time.monotonic()
                log.warning("learner held: its weights are as far ahead of the serving version as allowed",
                            ahead=ahead, bound=bound, serving=self._serving, version=state.version)
                await metrics.emit(metric_names.LEARNER_VERSIONS_AHEAD_OF_SERVING, float(ahead), step=state.step,
                                   tags=tags)
            if self._stop.is_set() or self.lease_lost:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=HELD_POLL_S)

    async def _reset_due(self, state: LearnerState, ahead: int, bound: int | None) -> bool:
        """Whether to move back to serving: ``learner.reset_after_rejections`` rejections in a row of versions
        trained since the last reset, or, held at the bound, the newest version rejected (nothing is left for the
        gate to judge)."""
        if self._promotions is None or ahead <= 0 or time.monotonic() - self._reset_failed_at < RESET_RETRY_S:
            return False
        try:
            await self._promotions.poll()
        except Exception as exc:  # noqa: BLE001 - Kafka unreachable: decide with what was read
            log.warning("promotions not read", error=str(exc))
        run = self._promotions.rejections(above=state.reset_at if state.reset_at is not None else 0)
        if run.count >= self.lcfg.reset_after_rejections:
            return True
        return bound is not None and ahead >= bound and state.version in run.versions

    async def _reset_to_serving(self, state: LearnerState, metrics: MetricsPublisher) -> bool:
        """Load the serving version's verified weights, start a new optimizer, checkpoint; False (retried after
        ``RESET_RETRY_S``) when its weights do not verify or fit."""
        assert self.loop is not None and self.policy is not None
        pointer, ahead = self._serving_pointer, self.versions_ahead(state)
        if pointer is None:
            return False
        try:
            weights = await asyncio.to_thread(verified_serving_weights, pointer, self.cfg.policy, self.versions_root)
            await asyncio.to_thread(load_serving_weights, self.policy, weights)
        except (ManifestError, OSError) as exc:
            self._reset_failed_at = time.monotonic()
            log.error("the serving version's weights were refused; the learner trains on from its own",
                      serving=pointer.version, uri=pointer.uri, error=str(exc))
            return False
        if self.parallel is not None:
            await asyncio.to_thread(self.parallel.broadcast_command, distributed.RESET, weights)
        self.loop.trainer = fresh_trainer(self.policy, self.lcfg, self.loop.trainer, self.parallel)
        state.pending_offsets, state.pending_groups = {}, 0  # trained into weights that are gone: not the lineage
        state.reset_to, state.reset_at = weights.version, state.version
        state.resets += 1
        await self.loop.save(checkpoint=True, publish=False, figures={})  # a restart resumes from serving's weights
        log.warning("learner moved back to the serving version's weights after gate rejections; optimizer reset",
                    serving=weights.version, was_ahead=ahead, version=state.version, next_version=state.version + 1,
                    resets=state.resets, directory=str(weights.directory))
        tags = {"policy": self.cfg.policy}
        await metrics.emit(metric_names.LEARNER_RESETS_TO_SERVING, float(state.resets), step=state.step, tags=tags)
        await metrics.emit(metric_names.LEARNER_VERSIONS_AHEAD_OF_SERVING, 0.0, step=state.step, tags=tags)
        return True

    def _skip_reason(self, group: TrajectoryGroup) -> str | None:
        """Why a decoded group is not for this learner (None when it is)."""
        if group.policy != self.cfg.policy:
            return SKIP_OTHER_POLICY
        if self.lcfg.run_ids and group.run_id not in self.lcfg.run_ids:
            return SKIP_OTHER_RUN
        if any(t.source == TrajectorySource.validation for t in group.trajectories):
            return SKIP_VALIDATION  # held-out evaluation traffic
        return None

    # -- training ----------------------------------------------------------------------------------------
    def _broadcast_step(self, samples: list[Sample]) -> None:
        """Hand the step's batch to the other data-parallel ranks (before the driver's own step)."""
        if self.parallel is not None:
            self.parallel.broadcast_command(distributed.STEP, samples)

    async def _train_step(self, state: LearnerState, taken: list[TakenGroup], control: ControlPlane,
                          metrics: MetricsPublisher, consumer: Any) -> None:
        assert self.loop is not None
        samples: list[Sample] = []
        groups = [t for t in taken if t.group is not None]
        for index, t in enumerate(groups):
            for s in t.samples:
                s.group = index
                samples.append(s)
        mark_stale_rows_without_logprobs(samples, state.version, self.lcfg.max_lag_without_logprobs)
        stats = await self.loop.train_batch(samples)
        for t in taken:
            state.offsets[t.partition] = t.offset + 1
        # exact lineage: the groups whose samples went into an applied optimizer step, nothing else
        trained = ([t for t in groups if any(s.trainable for s in t.samples)]
                   if stats is not None and stats.trained else [])
        self.loop.record_trained([(t.partition, t.offset) for t in trained])
        lag = [state.version - behaviour_version(g.group, g.samples) for g in groups if g.group is not None]
        await self._report(state, stats, lag, metrics, control, len(trained))
        if self.kill_after_step is not None and state.step == self.kill_after_step:
            log.warning("fault injection: SIGKILL after step", step=state.step)
            os.kill(os.getpid(), signal.SIGKILL)
        publish_due = state.step % self.lcfg.publish_every == 0
        saved = await self.loop.save(checkpoint=state.step % self.lcfg.checkpoint_every == 0, publish=publish_due,
                                     figures=stats.figures() if stats else {},
                                     before_commit=self._pause_self if state.version + 1 == self.pause_in_announcement
                                     else None)
        if saved.refused == REFUSED_NONFINITE and publish_due:  # restart the learner to resume from its last checkpoint
            await metrics.emit(metric_names.LEARNER_PUBLISH_REFUSED, 1.0, step=state.step,
                               tags={"reason": "nonfinite_weights", "policy": self.cfg.policy})
        if saved.version is not None:
            self._known_version = max(self._known_version, saved.version.version)
        await self._report_serving_distance(state, metrics, control)
        await self._commit_for_monitoring(consumer, state)

    async def _report(self, state: LearnerState, stats: StepStats | None, lag: list[int],
                      metrics: MetricsPublisher, control: ControlPlane, n_groups: int) -> None:
        tags = {metric_names.STEP_TAG: metric_names.STEP_LEARNER, "policy": self.cfg.policy}
        await metrics.emit_many(step_figures(stats, n_groups, lag), step=state.step, tags=tags)
        figures = step_figures(stats, n_groups, lag)  # and for the trackers of learner.report_to
        for reason, count in sorted(self.skipped.items()):
            await metrics.emit(metric_names.LEARNER_GROUPS_SKIPPED, float(count), step=state.step,
                               tags={**tags, "reason": reason})
            figures[f"{metric_names.LEARNER_GROUPS_SKIPPED}/{reason}"] = float(count)
        dead_lettered = float(self._reader.rejected if self._reader is not None else 0)
        await metrics.emit(metric_names.LEARNER_DLQ_TOTAL, dead_lettered, step=state.step, tags=tags)
        figures[metric_names.LEARNER_DLQ_TOTAL] = dead_lettered
        self._reporters.log(figures, state.step)
        if stats is not None:
            await metrics.emit(metric_names.REWARD_MEAN, stats.reward_mean, step=state.version,
                               tags={metric_names.STEP_TAG: metric_names.STEP_VERSION, "policy": self.cfg.policy})
        try:  # status is for operators: an unreachable Redis must not hold training up
            await control.set_status(self.cfg.run_id, {"learner_step": state.step, "learner_version": state.version,
                                                       "learner_groups_trained": state.groups_trained,
                                                       "learner_loss": stats.loss if stats else 0.0},
                                     patience_s=REDIS_PATIENCE_IN_STEP_S)
        except Exception as exc:  # noqa: BLE001
            log.warning("run status not written (Redis unreachable?)", error=str(exc))
        log.info("learner step", step=state.step, groups=n_groups,
                 loss=round(stats.loss, 5) if stats else None, reward_mean=round(stats.reward_mean, 4) if stats else None,
                 tokens_per_s=round(stats.tokens_per_s, 1) if stats else None,
                 optimizer_steps=stats.optimizer_steps if stats else None)

    async def _report_serving_distance(self, state: LearnerState, metrics: MetricsPublisher,
                                       control: ControlPlane) -> None:
        """After a step's publication: how far ahead of serving the learner now is, and its moves back."""
        tags = {"policy": self.cfg.policy}
        ahead = self.versions_ahead(state)
        if ahead is not None:
            await metrics.emit(metric_names.LEARNER_VERSIONS_AHEAD_OF_SERVING, float(ahead), step=state.step,
                               tags=tags)
        await metrics.emit(metric_names.LEARNER_RESETS_TO_SERVING, float(state.resets), step=state.step, tags=tags)
        try:
            await control.set_status(self.cfg.run_id, {
                "learner_versions_ahead_of_serving": "" if ahead is None else ahead,
                "learner_resets_to_serving": state.resets,
                "learner_reset_to": "" if state.reset_to is None else state.reset_to},
                patience_s=REDIS_PATIENCE_IN_STEP_S)
        except Exception as exc:  # noqa: BLE001 - status is for operators
            log.warning("run status not written (Redis unreachable?)", error=str(exc))

    @staticmethod
    def _pause_self() -> None:
        log.warning("fault injection: SIGSTOP in the middle of an announcement (record sent, not committed)")
        os.kill(os.getpid(), signal.SIGSTOP)

    def _lost(self, exc: BaseException) -> None:
        log.error("learner lease lost or announcement fenced: another learner holds the policy; stopping without "
                  "publishing", error=str(exc))
        self.lease_lost = True
        self._stop.set()

    async def _lease_confirmed(self, control: ControlPlane) -> bool:
        """Renew the lease before writing a checkpoint: False (and the learner stops) when another learner took
        it; False for this step when Redis cannot be reached (the step's checkpoint and version wait)."""
        assert self.lease is not None
        try:
            await control.renew_lease(self.cfg.policy, self.lease, self.lcfg.lease_ttl_s,
                                      patience_s=REDIS_PATIENCE_IN_STEP_S)
            await self._report_lease(True)
            return True
        except LeaseLost as exc:
            await self._report_lease(False)
            if await self._regain(control, exc) and not self.lease_lost:
                return await self._lease_confirmed(control)
        except Exception as exc:  # noqa: BLE001 - Redis unreachable: retry at the next due step
            await self._report_lease(False)
            log.warning("lease not confirmed (Redis unreachable?); no checkpoint or version this step",
                        error=str(exc))
        return False

    async def _finish_interrupted_publication(self, state: LearnerState, control: ControlPlane) -> None:
        """A checkpoint written for a publication that was never announced: announce it now."""
        assert self.loop is not None
        if not state.publishing_offsets and not state.publishing_groups:
            return
        if state.version > await control.latest_version(self.cfg.policy):
            log.warning("announcing a version whose publication was interrupted", version=state.version)
            announced = await self.loop.announce_pending({})
            if announced is not None:
                self._known_version = max(self._known_version, announced.version)
        state.publishing_offsets, state.publishing_groups = {}, 0

    async def _commit_for_monitoring(self, consumer: Any, state: LearnerState) -> None:
        try:
            await consumer.commit({TopicPartition(self.topics.groups, p): o for p, o in state.offsets.items()})
        except Exception as exc:  # noqa: BLE001 - monitoring only; the checkpoint holds the truth
            log.debug("offset commit for monitoring failed", error=str(exc))


class _LearnerLease:
    """The service's hold on the learner lease, as the train-and-publish loop sees it: confirmation takes an
    expired lease back when no other learner published meanwhile (:meth:`Learner._lease_confirmed`)."""

    def __init__(self, learner: Learner, control: ControlPlane) -> None:
        self.learner = learner
        self.control = control

    @property
    def lease(self) -> Lease:
        assert self.learner.lease is not None, "the lease is acquired before the loop runs"
        return self.learner.lease

    async def confirm(self) -> bool:
        return await self.learner._lease_confirmed(self.control)

    def lost(self, exc: BaseException) -> None:
        self.learner._lost(exc)


@dataclass
class LearnerOutcome:
    """How a learner run ended: where it stopped, and whether another learner took its lease."""

    state: LearnerState
    lease_lost: bool


def run_learner(cfg: RlstreamConfig, *, holder: str | None = None, kill_after_step: int | None = None,
                pause_in_announcement: int | None = None) -> LearnerOutcome:
    """Run the learner service until ``learner.total_steps``; SIGINT/SIGTERM stop it after the current step.
    Raises :class:`rlstream.learner.reporting.ReportingError` when a tracker cannot be used."""
    learner = Learner(cfg, holder=holder, kill_after_step=kill_after_step, pause_in_announcement=pause_in_announcement)

    async def main() -> LearnerState:
        on_stop_signals(learner.request_stop)
        return await learner.run()

    state = asyncio.run(main())
    return LearnerOutcome(state, learner.lease_lost)
