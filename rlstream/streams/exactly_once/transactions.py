"""Exactly-once output for Faust: sink topics and table changelogs in the source partition's transaction.

Two gaps in Faust's exactly_once mode are closed here:

* Faust's transaction manager picks the transactional producer from the *destination* topic's
  partition group, which fails for topics the app does not consume (``groups``, ``dlq``: KeyError in
  the assignor). Here every record sent while an event is processed goes into the transaction of that
  event's source partition, the one whose offsets Faust commits with it.
* Table changelog records wait in Faust's producer buffer, and a transactional commit does not drain
  that buffer: a commit could carry an event's offset while its state change was still queued for the
  next transaction, and a crash then loses the change. :class:`BufferTracker` lets the commit wait
  until everything queued before it has been handed to the producer, and the app's processing lock
  keeps events from running between that drain and the commit, so an event's outputs and its state
  changes always land in the same transaction (an event whose offset missed the commit is then
  replayed against state that already holds it, and the assembler's dedupe makes that a no-op).
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Mapping, Optional

from faust.streams import current_event
from faust.transport.consumer import TransactionManager
from faust.types import TP, HeadersArg, RecordMetadata


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


class SourcePartitionTransactionManager(TransactionManager):
    """Send inside the transaction of the current event's source partition; drain changelogs on commit."""

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
            source_topic: str | None = getattr(self.app, "rlstream_source_topic", None)
            if source_topic is None or partition is None or topic not in self.app.tables.changelog_topics:
                return await super().send(topic, key, value, partition, timestamp, headers)
            group = self.app.assignor.group_for_topic(source_topic)
            tid = f"{self.app.conf.id}-{group}-{partition}"
            return await self.producer.send(topic, key, value, partition, timestamp, headers, transactional_id=tid)
        source = event.message
        group = self.app.assignor.group_for_topic(source.topic)
        tid = f"{self.app.conf.id}-{group}-{source.partition}"
        return await self.producer.send(topic, key, value, partition, timestamp, headers, transactional_id=tid)

    async def commit(self, offsets: Mapping[TP, int], start_new_transaction: bool = True) -> bool:
        tracker: BufferTracker | None = getattr(self.app, "rlstream_buffer_tracker", None)
        lock: asyncio.Lock | None = getattr(self.app, "rlstream_processing_lock", None)
        if lock is None:
            if tracker is not None:
                await tracker.drain()
            return await super().commit(offsets, start_new_transaction)
        async with lock:  # no event is half-way through its writes while the transaction closes
            if tracker is not None:
                await tracker.drain()
            return await super().commit(offsets, start_new_transaction)
