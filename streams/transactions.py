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
            return await super().send(topic, key, value, partition, timestamp, headers)
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


def dropped_ranges(consumer: Any, topics: set[str]) -> dict[TP, tuple[int, int]]:
    """Input partitions whose next uncommitted records were dropped without being processed.

    Faust's stream buffer is cleared when flow resumes after a rebalance or recovery
    (``clear_on_resume``); records fetched just before that are dropped un-acked while the
    fetcher's read offset has already moved past them, so they are neither processed nor
    fetched again in this session. The acked offsets then start above the committed offset
    with a hole no transaction marker explains, no offset of that partition can be committed
    any more, and the groups waiting for those records never complete. Per partition records
    are processed in order, so an acked offset above a missing one can only mean the missing
    one was dropped. Returns ``{tp: (committed, first_acked)}`` for every such hole.
    """
    holes: dict[TP, tuple[int, int]] = {}
    assignment = consumer.assignment()
    for tp, acked in list(consumer._acked.items()):
        if tp.topic not in topics or tp not in assignment or not acked:
            continue
        committed = consumer._committed_offset.get(tp)
        if committed is None:
            continue
        first = min(acked)
        if first <= committed:
            continue
        gap = consumer._gap.get(tp)
        covered = 0
        if gap:
            for iv in gap.overlap(committed, first):
                covered += min(iv.end, first) - max(iv.begin, committed)
        if covered < first - committed:
            holes[tp] = (committed, first)
    return holes


async def refetch_dropped(consumer: Any, topics: set[str]) -> dict[TP, tuple[int, int]]:
    """Seek every partition with dropped records back to its committed offset (call with no event
    in flight: under the app's processing lock). Records already processed come again and are
    ignored by the assembler's dedupe; their offsets are already acked."""
    holes = dropped_ranges(consumer, topics)
    for tp, (committed, _first) in holes.items():
        await consumer.seek(tp, committed)
    return holes
