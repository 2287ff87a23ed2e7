"""The Faust app: trajectories + rewards -> validated, assembled, filtered groups (and dead letters).

One agent consumes ``trajectories``, ``rewards`` and an internal ``<app_id>-ticks`` topic (all
co-partitioned, keyed by example_id); a timer sends a tick to every partition of the tick topic so that
timeouts are decided inside the partition's own event stream, where table writes and outputs share
the partition's transaction. Tables (changelog-backed, keyed by group_id / trajectory_id) hold the
assembly state; ``groups`` and ``dlq`` records are produced in the same transaction as the input
offsets (exactly_once, the only processing guarantee).

Recovery: a ``progress`` table holds, per source partition, the offset of the last applied record,
written in that record's transaction; after every rebalance the tables are rebuilt from the committed
changelogs (streams/exactly_once/state_reset.py) and records are admitted only from marker + 1 on
(streams/exactly_once/progress.py), so the state, its outputs and the input position always move together.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust

from rlstream.transport import aborted_index, fetch_wait
from rlstream.transport import metric_names as mn
from rlstream.transport.deadletter import dead_letter, fit_dead_letter
from rlstream.transport.kafka import make_consumer, make_producer, ssl_context
from rlstream.transport.log import get_logger, logging_dict_config
from rlstream.transport.metrics import MetricsPublisher
from rlstream.schemas.codec import AvroCodec, codec_for
from rlstream.schemas.config import KafkaConfig, RlstreamConfig
from rlstream.schemas.models import CallEvent, DeadLetter, MetricEvent, RewardEvent, TrajectoryEvent, TrajectoryGroup
from rlstream.schemas.sampling import TemperatureRange
from rlstream.schemas.topics import TopicNames
from rlstream.streams import validation as v
from rlstream.streams.baseline import BaselineRules
from rlstream.streams.deadlines import DueIndex
from rlstream.streams.reward_rules import RewardRules
from rlstream.streams.assembly import (AssemblyRules, Finished, GroupAssembler, OpenGroup, Outcome, Reject,
                                       SourceRef, group_state_from_json)
from rlstream.streams.filters import apply_filters
from rlstream.streams.policy import PolicyTracker
from rlstream.streams.stitching import Stitched, Stitcher, StitchRules
from rlstream.streams.shutdown import DeadlineWorker, StopDeadline, flush_standard_streams
from rlstream.streams.payloads import OffsetReader, PayloadCache
from rlstream.streams.staging import StagedWrites, changelog_copy, oversized_writes
from rlstream.streams.telemetry import Telemetry
from rlstream.streams.exactly_once.broker_watch import (BROKER_LOST_EXIT_CODE, BrokerConnectionWatch,
                                                       first_bootstrap_address)
from rlstream.streams.exactly_once.internals import check_internals, forget_unacked, send_queued_changelogs
from rlstream.streams.exactly_once.progress import Admission, GapProbe, ProgressGate
from rlstream.streams.exactly_once.state_reset import (BulkChangelogLoader, SettledTransactions,
                                                      install_full_recovery)
from rlstream.streams.exactly_once.transactions import (BufferTracker, SourcePartitionApp, TransactionSettings,
                                                        check_guarantee)

log = get_logger(__name__)
SERVICE = "streams"


class CommitSoon:
    """When the next early commit is due: the soonest ``sent + delay`` of the outputs sent since the last one (a
    delay of 0 asks for none: the periodic commit takes them)."""

    def __init__(self) -> None:
        self._due: float | None = None
        self._sooner = asyncio.Event()

    def request(self, delay_s: float) -> None:
        """An output was sent: commit it within ``delay_s`` (or sooner, for another output's shorter delay)."""
        if delay_s <= 0:
            return
        due = time.monotonic() + delay_s
        if self._due is None or due < self._due:
            self._due = due
            self._sooner.set()

    async def wait(self) -> None:
        """Return once a requested commit is due; outputs sent from then on ask for the next one."""
        while True:
            if self._due is None:
                await self._sooner.wait()
            self._sooner.clear()
            assert self._due is not None
            remaining = self._due - time.monotonic()
            if remaining <= 0:
                self._due = None
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._sooner.wait(), remaining)


def ticks_topic_name(cfg: RlstreamConfig) -> str:
    """The internal topic that carries timeout ticks (co-partitioned with the inputs)."""
    return f"{cfg.streams.app_id}-ticks"


def faust_settings(cfg: RlstreamConfig, worker_id: str) -> dict[str, Any]:
    """Faust settings derived from the rlstream config."""
    s = cfg.streams
    store = "memory://" if s.store == "memory" else "rocksdb://"
    settings: dict[str, Any] = dict(
        broker=[f"kafka://{host.strip()}" for host in cfg.kafka.bootstrap_servers.split(",") if host.strip()],
        processing_guarantee=s.processing_guarantee,
        store=store,
        datadir=str(Path(s.data_dir) / worker_id),
        topic_partitions=cfg.topics.partitions,
        topic_replication_factor=cfg.topics.replication_factor,
        topic_allow_declare=True,
        table_standby_replicas=s.standby_replicas,
        broker_commit_interval=s.commit_interval_s,
        broker_session_timeout=cfg.kafka.session_timeout_ms / 1000.0,
        broker_heartbeat_interval=max(1.0, cfg.kafka.session_timeout_ms / 3000.0),
        broker_rebalance_timeout=s.rebalance_timeout_s,
        consumer_group_instance_id=f"{s.app_id}-{worker_id}" if s.static_membership else None,
        # a JoinGroup may be held by the coordinator for the whole rebalance timeout
        broker_request_timeout=max(cfg.kafka.request_timeout_ms / 1000.0, s.rebalance_timeout_s + 10),
        broker_client_id=f"{cfg.kafka.client_id}-{SERVICE}-{worker_id}",
        consumer_auto_offset_reset="earliest",
        producer_max_request_size=cfg.kafka.max_message_bytes + 64 * 1024,
        producer_linger_ms=s.producer_linger_ms,
        producer_max_batch_size=s.producer_batch_bytes,
        consumer_max_fetch_size=max(1_048_576, cfg.kafka.max_message_bytes * 2),
        key_serializer="raw",
        value_serializer="raw",
        web_enabled=False,
        autodiscover=False,
        stream_wait_empty=True,
    )
    credentials = faust_credentials(cfg.kafka)
    if credentials is not None:
        settings["broker_credentials"] = credentials
    return settings


def faust_credentials(kafka: KafkaConfig) -> Any:
    """Faust's ``broker_credentials`` for ``kafka.security_protocol``, the same TLS context and SASL settings as
    every aiokafka client of rlstream (transport/kafka.py): ``SSLCredentials`` under SSL, ``SASLCredentials`` with
    the TLS context under SASL_SSL (without one Faust would speak SASL in clear), ``SASLCredentials`` alone under
    SASL_PLAINTEXT; None under PLAINTEXT."""
    context = ssl_context(kafka)
    if kafka.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        return faust.SASLCredentials(
            username=kafka.sasl_plain_username,
            password=kafka.sasl_plain_password.get_secret_value() if kafka.sasl_plain_password else None,
            mechanism=kafka.sasl_mechanism, ssl_context=context)
    if context is not None:
        return faust.SSLCredentials(context)
    return None


#: Assembly outcomes that take an episode's first score (an accepted trajectory, or a reward held or joined; not a
#: duplicate or a correction): the record whose reward components say how the episode used its tools.
FIRST_SCORES = ("trajectories_accepted", "rewards_held", "rewards_joined")

class DetachedValues(MutableMapping[str, Any]):
    """A table view whose values are private copies.

    Faust serializes a changelog record when its producer buffer sends it, not when the table is
    written, and a memory store hands out the stored object itself: a state dict changed in place
    by a later record would reach the changelog with that later record's changes, in the earlier
    record's transaction. Copying on read and write keeps every changelog record equal to the
    value written; the copies go through the changelog's own JSON serializer (streams/staging.py)."""

    def __init__(self, table: Any) -> None:
        self.table = table

    @staticmethod
    def _copy(value: Any) -> Any:
        return None if value is None else changelog_copy(value)

    def __getitem__(self, key: str) -> Any:
        value = self.table.get(key)
        if value is None:
            raise KeyError(key)
        return self._copy(value)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        value = self.table.get(key)
        return default if value is None else self._copy(value)

    def __setitem__(self, key: str, value: Any) -> None:
        self.table[key] = self._copy(value)

    def __delitem__(self, key: str) -> None:
        del self.table[key]

    def __contains__(self, key: object) -> bool:
        return key in self.table

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.table))

    def __len__(self) -> int:
        return len(self.table)

    def items(self) -> Iterator[tuple[str, Any]]:  # type: ignore[override]
        """(key, value) for every key that holds a value (a store may list emptied keys). For scans, so not copied:
        a caller reads them (streams.assembly decodes what it keeps into new objects) and never changes them."""
        for key, value in list(self.table.items()):
            if value is not None:
                yield key, value


@dataclass
class StreamsApp:
    """The configured Faust app plus what its agent and timers share."""

    cfg: RlstreamConfig
    worker_id: str
    codec: AvroCodec = field(default_factory=AvroCodec)
    telemetry: Telemetry = field(default_factory=Telemetry)

    def __post_init__(self) -> None:
        self.codec = codec_for(self.cfg)
        # a registry that is down or refuses a schema stops the worker now, before it takes a partition
        self.codec.ensure_registered([TrajectoryGroup.avro_name, DeadLetter.avro_name, MetricEvent.avro_name,
                                      TrajectoryEvent.avro_name, RewardEvent.avro_name])
        # changelog recovery (read_committed) must not drop records committed after an aborted transaction
        aborted_index.install()
        fetch_wait.install(self.cfg.kafka.empty_fetch_wait_ms)  # Faust's consumer too (transport/fetch_wait.py)
        self.names = TopicNames.from_config(self.cfg.topics)
        self.ticks = ticks_topic_name(self.cfg)
        settings = faust_settings(self.cfg, self.worker_id)
        Path(settings["datadir"]).mkdir(parents=True, exist_ok=True)
        # outputs join the transaction of the source partition (see streams/exactly_once/transactions.py)
        self.app = SourcePartitionApp(self.cfg.streams.app_id, **settings)
        self.processing_lock = asyncio.Lock()
        #: a sent group or stitched trajectory waits for its transaction's commit (commit_sent_outputs)
        self.commit_soon = CommitSoon()
        raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
        # calls (keyed by session id) share the agent, and so the partition transactions, of the other inputs
        self.source = self.app.topic(self.names.trajectories, self.names.rewards, self.names.calls, self.ticks, **raw)
        self.groups_out = self.app.topic(self.names.groups, **raw)
        self.trajectories_out = self.app.topic(self.names.trajectories, **raw)
        self.rewards_out = self.app.topic(self.names.rewards, **raw)
        self.dlq_out = self.app.topic(self.names.dlq, **raw)
        parts = self.cfg.topics.partitions
        json_schema = faust.Schema(key_serializer="json", value_serializer="json")
        self.group_table = self.app.Table("groups", default=None, partitions=parts, schema=json_schema)
        self.curriculum_table = self.app.Table("curriculum", default=None, partitions=parts, schema=json_schema)
        # scoped session id -> its open trajectory's calls and what its next records need (streams/stitching.py)
        self.session_table = self.app.Table("sessions", default=None, partitions=parts, schema=json_schema)
        # "<topic>:<partition>" -> last applied offset, in the same transaction as the record's effects
        self.progress_table = self.app.Table("progress", default=None, partitions=parts, schema=json_schema)
        # ticks carry no data (a lost or repeated tick only moves a timeout check): only the inputs are gated
        # recovered state == one committed snapshot (see streams/exactly_once/state_reset.py)
        self.settled = SettledTransactions(lambda iso: make_consumer(self.cfg.kafka, group_id=None, isolation_level=iso))
        install_full_recovery(self.app, self.settled, BulkChangelogLoader(
            self.app, lambda: make_consumer(self.cfg.kafka, group_id=None, isolation_level="read_committed")))
        self.offset_probe = GapProbe(lambda: make_consumer(self.cfg.kafka, group_id=None,
                                                           isolation_level="read_committed"))
        self.gate = ProgressGate(self.progress_table, self.app.consumer,
                                 {self.names.trajectories, self.names.rewards, self.names.calls},
                                 self.offset_probe,
                                 on_unproven_gap=lambda *_: self.telemetry.count(mn.STREAMS_UNPROVEN_GAPS))
        self.app.transaction_manager().configure(TransactionSettings(
            source_topic=self.names.trajectories, buffer_tracker=BufferTracker(self.app.producer.buffer),
            processing_lock=self.processing_lock))
        self.reward_range = v.RewardRange(*self.cfg.streams.reward_range)
        self.rules = AssemblyRules(group_timeout_s=self.cfg.streams.group_timeout_s,
                                   min_group_size=self.cfg.streams.min_group_size,
                                   closed_retention_s=self.cfg.streams.closed_retention_s,
                                   single_timeout_s=self.cfg.streams.reward_window_s,
                                   reward=RewardRules.from_config(self.cfg.streams.reward),
                                   baseline=BaselineRules(self.cfg.streams.baseline_method,
                                                          self.cfg.streams.baseline_window,
                                                          self.cfg.streams.baseline_ema_alpha, self.reward_range))
        self.groups_view = DetachedValues(self.group_table)
        s = self.cfg.streams
        self.stitcher = Stitcher(DetachedValues(self.session_table), StitchRules(
            idle_s=s.session_idle_s, max_turns=s.session_max_turns, max_bytes=s.session_max_bytes,
            retention_s=s.session_retention_s, producer_id=f"{SERVICE}:{self.worker_id}"))
        # members' records stay on their topic: a bounded cache, and a read back by offset on a miss
        self.payloads = PayloadCache(self.cfg.streams.payload_cache_bytes)
        self.offset_reader = OffsetReader(lambda: make_consumer(self.cfg.kafka, group_id=None,
                                                                isolation_level="read_committed"))
        # when each group's time comes, so a tick does not walk the table (rebuilt whenever the table changes under us)
        self.due_index = DueIndex()
        self.assembler = GroupAssembler(self.groups_view, self.payloads, self.codec, self.rules, self.due_index)
        self.policy = PolicyTracker(self.cfg, self.names.policy_versions, self.codec, dlq_topic=self.names.dlq,
                                    service=f"{SERVICE}:{self.worker_id}", on_refused=self._count_refused_version)
        self._side_producer: Any = None
        self._metrics: MetricsPublisher | None = None
        check_internals(self.app, self.cfg.streams.store)  # before anything starts: fail naming what is missing
        self._register()

    # -- wiring ----------------------------------------------------------------------------
    def _register(self) -> None:
        app = self.app

        @app.agent(self.source, name="assemble")
        async def assemble(stream: Any) -> None:
            await self.policy.ready.wait()
            # manual acks: a record skipped out of order must not let the committed offset pass it
            acked = stream.noack()
            async for event in acked.events():
                async with self.processing_lock:
                    verdict = await self.admit_and_handle(event.message)
                if verdict is Admission.LATER:
                    forget_unacked(self.app.consumer, event.message)
                else:
                    await acked.ack(event)

        @app.task
        async def check_transaction_mode() -> None:
            # runs once the worker has started: a worker without transactions would lose and repeat state changes
            # on a crash, so it stops instead
            problem = check_guarantee(self.app)
            if problem is not None:
                log.error("streams worker stops: wrong transaction mode", problem=problem)
                await self.app.crash(RuntimeError(problem))

        if self.cfg.streams.exit_on_broker_loss:
            @app.task
            async def exit_on_broker_loss() -> None:
                # a transaction resumed on a restarted broker can stay open forever (streams/exactly_once/broker_watch.py)
                address = first_bootstrap_address(self.cfg.kafka.bootstrap_servers)
                await BrokerConnectionWatch(address, exit_for_broker_loss).run()

        @app.task
        async def follow_policy_versions() -> None:
            await self.policy.run()

        @app.task
        async def side_producer() -> None:
            producer = make_producer(self.cfg.kafka)
            await producer.start()
            self._side_producer = producer
            self._metrics = MetricsPublisher(producer, self.codec, self.names.metrics, f"{SERVICE}:{self.worker_id}",
                                             self.cfg.run_id, self.cfg.streams.prometheus_port)

        @app.task
        async def commit_sent_outputs() -> None:
            await self.commit_sent_outputs()

        @app.timer(self.cfg.streams.tick_interval_s)
        async def tick() -> None:
            await self.send_ticks()

        @app.timer(1.0)
        async def keep_in_order() -> None:
            await self.maintain_progress()

        @app.on_partitions_revoked.connect
        async def on_revoked(*_: Any, **__: Any) -> None:
            self.gate.invalidate()
            self.due_index.invalidate()

        @app.on_partitions_assigned.connect
        async def on_assigned(*_: Any, **__: Any) -> None:
            self.gate.invalidate()
            self.due_index.invalidate()

        @app.on_rebalance_complete.connect
        async def on_recovered(*_: Any, **__: Any) -> None:
            self.gate.invalidate()
            self.due_index.invalidate()

        @app.timer(self.cfg.streams.metrics_interval_s)
        async def report() -> None:
            await self.report()

        @app.on_before_shutdown.connect
        async def stop_side(app: Any, **_: Any) -> None:  # noqa: ARG001
            if self._side_producer is not None:
                await self._side_producer.stop()
            await self.settled.close()
            await self.offset_probe.close()
            await self.offset_reader.close()

    async def commit_sent_outputs(self) -> None:
        """Commit soon after a group (``streams.group_commit_delay_s``) or a stitched trajectory
        (``streams.session_commit_delay_s``) was sent, ahead of the periodic commit: either is readable under
        read_committed only once the transaction that holds it commits. Faust's public ``Consumer.commit`` does the
        commit, as its own commit timer does; a commit that fails is left to the periodic one."""
        while True:
            await self.commit_soon.wait()
            if self.app.rebalancing:
                continue
            try:
                await self.app.consumer.commit()
            except Exception as exc:
                log.warning("commit after a sent group failed; the periodic commit retries", error=str(exc))

    # -- per event ---------------------------------------------------------------------------
    async def admit_and_handle(self, msg: Any) -> "Admission":
        """Process the record only when the progress gate admits it (see streams.progress): never while a
        rebalance or table recovery is under way, only after the resync to the recovered markers, and
        never a record at or below its partition's marker. Returns what became of the record."""
        if self.app.rebalancing:
            self.telemetry.count(mn.STREAMS_RECORDS_DEFERRED)
            return Admission.LATER
        if self.gate.resync_needed:
            await self.gate.resync()
        if msg.topic == self.ticks:
            await self.handle(msg)
            return Admission.PROCESS
        verdict = await self.gate.admit(msg.topic, msg.partition, msg.offset)
        if verdict is Admission.PROCESS:
            await self.handle(msg)
        else:
            self.telemetry.count(mn.STREAMS_RECORDS_SKIPPED if verdict is Admission.APPLIED
                                 else mn.STREAMS_RECORDS_DEFERRED)
        return verdict

    async def handle(self, msg: Any) -> None:
        """Process one record of trajectories, rewards or ticks."""
        src = SourceRef(msg.topic, msg.partition, msg.offset)
        now = time.time()
        self.telemetry.processed(msg.topic, msg.partition, msg.offset)
        if msg.topic == self.names.calls:
            await self._stitch(msg, src, now)
            self.gate.applied(msg.topic, msg.partition, msg.offset)
            await self.send_table_changes()
            return
        if msg.topic == self.ticks:
            try:
                await self._send_stitched(self.stitcher.on_tick(msg.partition, now))
            except Exception:  # a tick carries no data: the next tick checks again
                log.exception("session tick could not be processed", partition=msg.partition)
            try:
                due = self.assembler.due(msg.partition, now)
                await self.read_back([state for _, state in due if state is not None])
                outcome = self.assembler.time_out(due, now)
            except Exception:  # a tick carries no data: log it, the next tick checks again
                log.exception("tick could not be processed", partition=msg.partition)
                self.due_index.invalidate(msg.partition)  # what it popped and did not finish is found again
                outcome = Outcome()
        else:
            self.telemetry.count(mn.STREAMS_EVENTS_IN)
            try:
                outcome = await self._ingest(msg, src, now)
            except v.Rejected as rej:
                outcome = Outcome(rejects=[Reject(rej.invalid.reason, rej.invalid.message, src, msg.key, msg.value)])
            except Exception as exc:  # a bug must not stop the stream: the record goes to the dlq
                log.exception("record could not be processed", topic=msg.topic, partition=msg.partition,
                              offset=msg.offset)
                outcome = Outcome(rejects=[Reject("processing_error", f"{type(exc).__name__}: {exc}", src, msg.key,
                                                  msg.value)])
        await self.publish(outcome, msg.partition)
        if msg.topic != self.ticks:
            self.gate.applied(msg.topic, msg.partition, msg.offset)
        await self.send_table_changes()

    async def send_table_changes(self) -> None:
        """Hand this record's queued changelog records to the producer now, inside the record's context
        (so inside its partition's transaction, before any commit can run between the record's
        outputs and its state changes)."""
        await send_queued_changelogs(self.app.producer.buffer)

    async def _ingest(self, msg: Any, src: SourceRef, now: float) -> Outcome:
        """Validate and assemble one input record; its table writes are applied only once all of them fit (see
        streams/staging.py), so a rejected or failing record leaves the state as it was."""
        event = self._decode_valid(msg)
        # read, not copied: group_state_from_json builds new objects, and the assembler works on those (one decode)
        stored = self.group_table.get(event.group_id)
        state = None if stored is None else group_state_from_json(stored)
        # this record may finish the group: its members' records must be at hand; when some had to be read back
        # (other tasks ran meanwhile), the assembler reads the state again
        if isinstance(state, OpenGroup) and await self.read_back([state]):
            state = None
        groups = StagedWrites(self.groups_view)
        assembler = GroupAssembler(groups, self.payloads, self.codec, self.rules, self.due_index)
        record_ts = float(msg.timestamp or now)
        if isinstance(event, TrajectoryEvent):
            outcome = assembler.on_trajectory(event, bytes(msg.value), msg.key, src, record_ts, now, state)
        else:
            outcome = assembler.on_reward(event, bytes(msg.value), msg.key, src, record_ts, now, state)
        limit = self.cfg.kafka.max_message_bytes
        too_large = oversized_writes(groups, limit)
        if too_large:
            key, size = too_large[0]
            raise v.Rejected(v.Invalid(v.STATE_TOO_LARGE, (
                f"holding this record needs a {size}-byte state record (key {key[:80]!r}), over "
                f"kafka.max_message_bytes ({limit}); the group holds too many members")))
        groups.apply()
        if any(outcome.counts[first] for first in FIRST_SCORES):  # each episode's tool use once (no duplicates)
            self.telemetry.count_tool_use(event.reward_components if isinstance(event, TrajectoryEvent)
                                          else event.components)
        return outcome

    async def _stitch(self, msg: Any, src: SourceRef, now: float) -> None:
        """One ``calls`` record into its session (streams/stitching.py); a bad record goes to the dlq."""
        self.telemetry.count(mn.STREAMS_EVENTS_IN)
        try:
            call = v.decode_event(self.codec, msg.value, CallEvent)
            assert isinstance(call, CallEvent)
            if msg.key is not None and msg.key != call.session_id.encode():
                raise v.Rejected(v.Invalid(v.KEY_MISMATCH, f"record key {msg.key[:80]!r} is not the session id "
                                                           f"{call.session_id[:80]!r}; key calls by session id"))
            staged = StagedWrites(self.stitcher.table)
            stitched = Stitcher(staged, self.stitcher.rules).on_call(call, msg.partition, now)
            too_large = oversized_writes(staged, self.cfg.kafka.max_message_bytes)
            if too_large:
                raise v.Rejected(v.Invalid(v.STATE_TOO_LARGE, (
                    f"holding this call needs a {too_large[0][1]}-byte session record, over kafka.max_message_bytes "
                    f"({self.cfg.kafka.max_message_bytes}); lower streams.session_max_bytes")))
            staged.apply()
        except v.Rejected as rej:
            await self._dead_letter(Reject(rej.invalid.reason, rej.invalid.message, src, msg.key, msg.value))
            return
        except Exception as exc:  # a bug must not stop the stream: the record goes to the dlq
            log.exception("call could not be stitched", partition=msg.partition, offset=msg.offset)
            await self._dead_letter(Reject("processing_error", f"{type(exc).__name__}: {exc}", src, msg.key,
                                           msg.value))
            return
        await self._send_stitched(stitched)

    async def _send_stitched(self, stitched: Stitched) -> None:
        """Send what the stitcher produced (in the current record's transaction) and count it."""
        for name, n in stitched.counts.items():
            self.telemetry.count(name, n)
        for trajectory in stitched.trajectories:
            await self.trajectories_out.send(key=trajectory.example_id.encode(), value=self.codec.encode(trajectory))
            self.commit_soon.request(self.cfg.streams.session_commit_delay_s)  # a session's end waits on no more
        for reward in stitched.rewards:
            await self.rewards_out.send(key=reward.example_id.encode(), value=self.codec.encode(reward))

    def _decode_valid(self, msg: Any) -> TrajectoryEvent | RewardEvent:
        """The record decoded and checked (raises :class:`streams.validation.Rejected`)."""
        if msg.topic == self.names.trajectories:
            ingested = v.decode_trajectory(self.codec, msg.value)
            event = ingested.event
            invalid = v.check_key(msg.key, event.example_id) or v.validate_trajectory(
                event, self.cfg.streams.min_allowed_group_size, self.cfg.streams.max_allowed_group_size,
                ingested.turn_counts, self.reward_range, TemperatureRange(*self.cfg.streams.temperature_range))
        else:
            event = v.decode_event(self.codec, msg.value, RewardEvent)
            assert isinstance(event, RewardEvent)
            invalid = v.check_key(msg.key, event.example_id) or v.validate_reward(event, self.reward_range)
        if invalid:
            raise v.Rejected(invalid)
        return event

    async def read_back(self, states: list[OpenGroup]) -> bool:
        """Put the records of these groups' members that are not cached back into the cache, read by their offsets
        (after a restart, a rebalance or an eviction; see streams/payloads.py). False when every record was cached
        (nothing was awaited), else True."""
        missing = [m.source for state in states for m in state.members.values() if m.source not in self.payloads]
        if not missing:
            return False
        found = await self.offset_reader.read(missing)
        for ref, value in found.items():
            self.payloads[ref] = value
        self.telemetry.count(mn.STREAMS_PAYLOADS_READ_BACK, len(found))
        return True

    async def publish(self, outcome: Outcome, partition: int) -> None:
        """Send the outcome's dead letters and the groups that pass the filters; count everything."""
        for name, n in outcome.counts.items():
            self.telemetry.count(name, n)
        for reject in outcome.rejects:
            await self._dead_letter(reject)
        for finished in outcome.finished:
            await self._emit(finished, partition)

    def _count_refused_version(self, reason: str) -> None:
        """A policy-versions record the tracker dead-lettered (untrusted or undecodable)."""
        self.telemetry.count(mn.STREAMS_DLQ, reason=reason)
        self.telemetry.count(mn.STREAMS_DLQ_TOTAL)

    async def _dead_letter(self, reject: Reject) -> None:
        """Send one dead letter, cut to fit one record (see transport/deadletter.py)."""
        letter = dead_letter(topic=reject.source.topic, partition=reject.source.partition,
                             offset=reject.source.offset, key=reject.key, value=reject.value, error=reject.message,
                             error_type=reject.reason, service=f"{SERVICE}:{self.worker_id}")
        try:
            letter, value = fit_dead_letter(letter, self.codec)
        except Exception as exc:  # not expected: the letter still goes out, without the record's bytes
            log.exception("dead letter could not be fitted; sent without key and value", reason=reject.reason)
            letter, value = fit_dead_letter(letter.model_copy(update={
                "key": None, "value": None, "error_message": f"{reject.message} [key and value left out: {exc}]"}),
                self.codec)
        await self.dlq_out.send(key=letter.key, value=value)
        self.telemetry.count(mn.STREAMS_DLQ, reason=reject.reason)
        self.telemetry.count(mn.STREAMS_DLQ_TOTAL)
        log.info("dead letter", reason=reject.reason, topic=reject.source.topic, partition=reject.source.partition,
                 offset=reject.source.offset)

    async def _emit(self, finished: Finished, partition: int) -> None:
        group = finished.header
        verdict = apply_filters(group, self.cfg.streams, self.policy.version_of(group.policy),
                                DetachedValues(self.curriculum_table), partition, member_rewards=finished.rewards,
                                serving_version=self.policy.serving_of(group.policy),
                                baseline_min_count=self.cfg.learner.baseline_min_count)
        if verdict.reason is not None:
            self.telemetry.count(mn.STREAMS_GROUPS_FILTERED, reason=verdict.reason)
            log.info("group filtered", group_id=group.group_id, reason=verdict.reason, detail=verdict.detail)
            return
        try:
            value = finished.encode(verdict.group)  # the members' records placed as consumed (no re-encoding)
        except Exception as exc:  # e.g. over the size limit: every member goes to the dlq instead
            for member in finished.members:
                await self._dead_letter(Reject(v.GROUP_TOO_LARGE, f"group {group.group_id} not emitted: {exc}",
                                               member.source, group.example_id.encode(), member.payload))
            return
        await self.groups_out.send(key=group.example_id.encode(), value=value)
        self.commit_soon.request(self.cfg.streams.group_commit_delay_s)
        self.telemetry.count(mn.STREAMS_EVENTS_OUT)
        self.telemetry.count(mn.STREAMS_GROUPS_EMITTED, reason=group.completion.value)
        latency_s = time.time() - finished.last_member_ts
        self.telemetry.observe_latency(latency_s)
        if self._metrics is not None:  # one histogram observation per group (Prometheus only, see metric_names)
            await self._metrics.emit(mn.STREAMS_ASSEMBLY_LATENCY_S, max(0.0, latency_s),
                                     tags={"worker": self.worker_id})

    # -- timers ------------------------------------------------------------------------------
    async def maintain_progress(self) -> None:
        """Resync after a rebalance even when no record arrives, and repeat seeks back that did not
        bring their missing records (see streams.progress)."""
        if self.app.rebalancing:
            return
        async with self.processing_lock:
            if self.app.rebalancing:
                return
            if self.gate.resync_needed:
                await self.gate.resync()
            await self.gate.maintain()

    async def send_ticks(self) -> None:
        """One tick per partition of the tick topic (plain producer: ticks need no transaction)."""
        if self._side_producer is None:
            return
        stamp = str(time.time()).encode()
        for p in range(self.cfg.topics.partitions):
            try:
                await self._side_producer.send(self.ticks, stamp, partition=p)
            except Exception as exc:
                log.warning("tick not sent", partition=p, error=str(exc))

    async def consumer_lag(self) -> float:
        """Records behind the high watermark over the assigned input partitions."""
        lag = 0
        consumer = self.app.consumer
        for tp in consumer.assignment():
            if tp.topic not in (self.names.trajectories, self.names.rewards, self.names.calls):
                continue
            try:
                high = consumer.highwater(tp)
                pos = self.telemetry.positions.get((tp.topic, tp.partition))
                if pos is None:
                    pos = await consumer.position(tp)
                if high is not None and pos is not None:
                    lag += max(0, int(high) - int(pos))
            except Exception:  # not assigned any more, or not fetched yet
                continue
        return float(lag)

    async def report(self) -> None:
        if self._metrics is None:
            return
        figures = self.telemetry.report()
        figures[mn.STREAMS_CONSUMER_LAG] = await self.consumer_lag()
        for key, value in figures.items():
            reason = mn.split_streams_figure(key)[1]
            tags = {"worker": self.worker_id, **({"reason": reason} if reason else {})}
            await self._metrics.emit(mn.split_streams_figure(key)[0], value, tags=tags)


async def prepare_topics(cfg: RlstreamConfig) -> None:
    """Create rlstream's topics and the tick topic before the app starts (never broker auto-create)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    from rlstream.transport.kafka import client_options, create_topics

    await create_topics(cfg.kafka, cfg.topics)
    admin = AIOKafkaAdminClient(**client_options(cfg.kafka))
    await admin.start()
    try:
        if ticks_topic_name(cfg) not in set(await admin.list_topics()):
            try:
                await admin.create_topics([NewTopic(ticks_topic_name(cfg), cfg.topics.partitions,
                                                    cfg.topics.replication_factor,
                                                    topic_configs={"retention.ms": str(3600 * 1000)})])
            except TopicAlreadyExistsError:
                pass
    finally:
        await admin.close()


def exit_for_broker_loss(reason: str) -> None:
    """End the worker process now, without a clean stop: its open transactions must not reach a restarted broker."""
    log.error("streams worker exits: its broker went away while transactions may be open; a supervisor restarts it "
              "and it resumes from the committed state", reason=reason, exit_code=BROKER_LOST_EXIT_CODE)
    flush_standard_streams()
    os._exit(BROKER_LOST_EXIT_CODE)


def run_worker(cfg: RlstreamConfig, worker_id: str, loglevel: str = "WARNING") -> None:
    """Create the topics, then run the Faust worker in this process until SIGTERM/SIGINT (a clean stop, or an exit
    after ``streams.stop_timeout_s`` when the clean stop hangs, e.g. on a broker that is down)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(prepare_topics(cfg))
    streams = StreamsApp(cfg, worker_id)
    log.info("streams worker starting", app_id=cfg.streams.app_id, worker=worker_id,
             guarantee=cfg.streams.processing_guarantee, store=cfg.streams.store)
    # logging_config: Faust replaces the root handlers at start; this keeps rlstream's one log pipeline (JSON lines)
    worker = DeadlineWorker(streams.app, loop=loop, loglevel=loglevel, quiet=True, redirect_stdouts=False,
                            logging_config=logging_dict_config(loglevel))
    # a stop signal starts Faust's clean stop and a hard deadline: the broker may be down (streams/shutdown.py)
    worker.stop_deadline = StopDeadline(cfg.streams.stop_timeout_s)
    worker.spinner = None  # its cursor escapes would be the only lines on stdout that are not JSON
    worker.execute_from_commandline()
