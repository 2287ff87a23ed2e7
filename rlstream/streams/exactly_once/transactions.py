"""Exactly-once output for Faust: sink topics and table changelogs in the source partition's transaction.

Three gaps in Faust's exactly_once mode are closed here:

* Faust's transaction manager picks the transactional producer from the *destination* topic's
  partition group, which fails for topics the app does not consume (``groups``, ``dlq``: KeyError in
  the assignor). Here every record sent while an event is processed goes into the transaction of that
  event's source partition, the one whose offsets Faust commits with it.
* A rebalance does not end the transactions of the partitions a worker keeps: Faust forgets the revoked
  acks before its last commit, so that commit skips them, and the records of those transactions stay
  uncommitted into the next generation (the changelog's last stable offset stays behind them, and the
  full recovery after the rebalance would wait for them and then rebuild a state without them, while
  they still commit later). :meth:`SourcePartitionTransactionManager.on_partitions_revoked` commits
  every open transaction first (under the processing lock): each holds whole records with their
  progress markers, so committing them without their input offsets is consistent (the markers, not the
  committed offsets, say where to resume).
* Table changelog records wait in Faust's producer buffer, and a transactional commit does not drain
  that buffer: a commit could carry an event's offset while its state change was still queued for the
  next transaction, and a crash then loses the change. :class:`BufferTracker` lets the commit wait
  until everything queued before it has been handed to the producer, and the app's processing lock
  keeps events from running between that drain and the commit, so an event's outputs and its state
  changes always land in the same transaction (an event whose offset missed the commit is then
  replayed against state that already holds it, and the assembler's dedupe makes that a no-op).

:class:`SourcePartitionApp` is the ``faust.App`` whose consumer uses :class:`SourcePartitionTransactionManager`;
the streams app hands that manager its :class:`TransactionSettings` through
:meth:`SourcePartitionTransactionManager.configure` (nothing is stored on Faust's own objects).

Whether Faust uses transactions at all is decided by ``App.in_transaction``: ``in_worker`` and
processing_guarantee exactly_once. Faust caches that property on first read, and its consumer copies it
once when it is built; ``in_worker`` only becomes true when ``faust.Worker`` starts. The streams app builds
its consumer (and configures the manager above) before that, so in Faust's own classes the worker would
run with transactions silently off: plain producers, plain offset commits, read_uncommitted recovery, and
a SIGKILL leaves whatever prefix of a record's writes had been sent. :class:`SourcePartitionApp` and
:class:`SourcePartitionConsumer` therefore read the flag live, and :func:`check_guarantee` lets the
worker refuse to run exactly_once without it.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Awaitable, Mapping, Optional, Set

import faust
from aiokafka.errors import ProducerFenced
from faust.streams import current_event
from faust.transport.consumer import TransactionManager
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.transport.drivers.aiokafka import Transport as AIOKafkaTransport
from faust.types import TP, HeadersArg, RecordMetadata
from faust.types.enums import ProcessingGuarantee
from faust.types.transports import TransportT

from rlstream.streams.exactly_once.internals import open_transactional_ids
from rlstream.transport.log import get_logger

log = get_logger(__name__)


class BufferTracker:
    """Counts what enters and leaves a Faust ``ProducerBuffer`` (install before the app starts)."""

    def __init__(self, buffer: Any) -> None:
        self.queued = 0
        self.sent = 0
        original_put, original_send = buffer.put, buffer._send_pending

        def put(fut: Any) -> None:
            self.queued += 1
            original_put(fut)

        async def send_pending(fut: Any) -> None:
            try:
                await original_send(fut)
            finally:
                self.sent += 1

        buffer.put = put
        buffer._send_pending = send_pending

    async def drain(self, poll_s: float = 0.001) -> None:
        """Wait until every record queued before this call was handed to the producer."""
        target = self.queued
        while self.sent < target:
            await asyncio.sleep(poll_s)


@dataclass(frozen=True)
class TransactionSettings:
    """What the transaction manager needs from the streams app."""

    source_topic: str  # an input topic: its partition groups own the co-partitioned changelog partitions
    buffer_tracker: BufferTracker | None = None  # drained before every commit
    processing_lock: asyncio.Lock | None = None  # held by every event; taken by the commit (exactly_once)


class SourcePartitionTransactionManager(TransactionManager):
    """Send inside the transaction of the current event's source partition; drain changelogs on commit.

    Until :meth:`configure` is called it behaves like Faust's own manager for changelog records and commits."""

    settings: TransactionSettings | None = None

    def configure(self, settings: TransactionSettings) -> None:
        """Set what the manager needs from the app (call before the app starts)."""
        self.settings = settings

    async def send(
        self,
        topic: str,
        key: Optional[bytes],
        value: Optional[bytes],
        partition: Optional[int],
        timestamp: Optional[float],
        headers: Optional[HeadersArg],
        *,
        transactional_id: Optional[str] = None,
    ) -> Awaitable[RecordMetadata]:
        event: Any = current_event()
        if event is None:
            # table changelog records are sent from the producer buffer, outside the event: they belong
            # to the transaction of the source partition with their partition number (tables are
            # co-partitioned with the inputs), whatever topic group the assignor gave the changelog
            source_topic = self.settings.source_topic if self.settings is not None else None
            if source_topic is None or partition is None or topic not in self.app.tables.changelog_topics:
                return await super().send(topic, key, value, partition, timestamp, headers)
            tid = self.transactional_id(source_topic, partition)
            return await self.producer.send(topic, key, value, partition, timestamp, headers, transactional_id=tid)
        source = event.message
        tid = self.transactional_id(source.topic, source.partition)
        return await self.producer.send(topic, key, value, partition, timestamp, headers, transactional_id=tid)

    def transactional_id(self, source_topic: str, partition: int) -> str:
        """Faust's transactional id of a source partition: one producer per partition of a topic group."""
        return f"{self.app.conf.id}-{self.app.assignor.group_for_topic(source_topic)}-{partition}"

    def _between_events(self) -> Any:
        """The processing lock (exactly_once: no event is half-way through its writes while a transaction closes),
        or nothing to hold."""
        lock = self.settings.processing_lock if self.settings is not None else None
        return lock if lock is not None else contextlib.nullcontext()

    async def _drain_changelogs(self) -> None:
        """Wait until every changelog record queued so far has been handed to the producer."""
        tracker = self.settings.buffer_tracker if self.settings is not None else None
        if tracker is not None:
            await tracker.drain()

    async def commit(self, offsets: Mapping[TP, int], start_new_transaction: bool = True) -> bool:
        async with self._between_events():
            await self._drain_changelogs()
            return await self._commit_each(offsets, start_new_transaction)

    async def _commit_each(self, offsets: Mapping[TP, int], start_new_transaction: bool) -> bool:
        """Faust's commit, with the transactions of the source partitions committed side by side instead of one
        after another: each is its own producer with its own broker round trips (offsets, end of transaction), so a
        worker with many partitions holds the processing lock for one partition's commit, not for their sum."""
        group_id = self.app.conf.id
        by_transactional_id: dict[str, dict[TP, int]] = defaultdict(dict)
        for tp, offset in offsets.items():
            by_transactional_id[self.transactional_id(tp.topic, tp.partition)][tp] = offset
        results = await asyncio.gather(*(
            self.producer.commit_transactions({tid: tid_offsets}, group_id,
                                              start_new_transaction=start_new_transaction)
            for tid, tid_offsets in sorted(by_transactional_id.items())), return_exceptions=True)
        failures = [result for result in results if isinstance(result, BaseException)]
        fenced = [failure for failure in failures if isinstance(failure, ProducerFenced)]
        if fenced:  # as Faust does: a newer worker owns the partition, this one must stop
            log.warning("producer fenced", error=str(fenced[0]))
            await self.app.crash(fenced[0])
        elif failures:
            raise failures[0]
        return True

    async def on_partitions_revoked(self, revoked: Set[TP]) -> None:
        """A rebalance begins: flush (Faust), then commit every transaction this worker still has open."""
        await super().on_partitions_revoked(revoked)
        await self.end_open_transactions()

    async def end_open_transactions(self) -> None:
        """Commit the open transaction of every transactional producer, between two events (module docstring)."""
        async with self._between_events():
            await self._drain_changelogs()
            for tid in open_transactional_ids(self.producer):
                await self.producer.commit_transaction(tid)  # Faust's: takes the id's lock, logs a fenced producer


class SourcePartitionConsumer(AIOKafkaConsumer):
    """Faust's aiokafka consumer whose ``in_transaction`` follows the app (Faust copies it once, at build time,
    which may be before the worker starts; see the module docstring)."""

    @property  # type: ignore[override]
    def in_transaction(self) -> bool:
        return bool(self.app.in_transaction)

    @in_transaction.setter
    def in_transaction(self, value: bool) -> None:
        """Faust's constructor assigns the app's value of that moment; the live value is read instead."""


class SourcePartitionTransport(AIOKafkaTransport):
    """Faust's aiokafka transport, with :class:`SourcePartitionTransactionManager` as its transaction manager."""

    Consumer = SourcePartitionConsumer
    TransactionManager = SourcePartitionTransactionManager


class SourcePartitionApp(faust.App):
    """A ``faust.App`` whose consumer transport is :class:`SourcePartitionTransport` (broker: kafka:// only)."""

    @property  # type: ignore[override]
    def in_transaction(self) -> bool:
        """Faust's rule (in a worker, with processing_guarantee exactly_once), read live instead of cached on the
        first read: anything that reads it before ``faust.Worker`` starts would otherwise turn transactions off."""
        return bool(self.in_worker and self.conf.processing_guarantee == ProcessingGuarantee.EXACTLY_ONCE)

    def _new_transport(self) -> TransportT:
        return SourcePartitionTransport(self.conf.broker_consumer, self)

    def transaction_manager(self) -> SourcePartitionTransactionManager:
        """The consumer's transaction manager (creates the consumer if needed)."""
        manager = self.consumer.transactions
        assert isinstance(manager, SourcePartitionTransactionManager), type(manager)
        return manager


def check_guarantee(app: faust.App) -> str | None:
    """What is wrong with the running worker's transaction mode (None when it is right): the worker must use
    transactions in the app and in its consumer (exactly_once)."""
    if not app.in_transaction:
        return "processing_guarantee is exactly_once but the app does not use transactions"
    if not app.consumer.in_transaction:
        return "processing_guarantee is exactly_once but the consumer does not use transactions"
    return None
