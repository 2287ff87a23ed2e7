"""Rebuild table state from the committed changelog on every rebalance.

Faust applies table writes to the local store at once, but under exactly_once they only become real
when the partition's transaction commits. A rebalance (or a SIGKILL) aborts the open transaction, and
Faust's recovery then only reads the changelog *after* the offset it last recovered (memory store) or
last committed (RocksDB): writes of the aborted transaction stay in the local store, next to a
changelog that never had them. The state would then hold effects (members, closed groups, progress
markers) whose outputs were rolled back, and later recoveries mix old and new values.

:func:`install_full_recovery` makes every recovery start from an empty local store and the beginning
of the (compacted) changelogs, so the recovered state is exactly the committed state and the
``progress`` markers in it say exactly which input records it reflects. The price is a full changelog
read per rebalance, which compaction keeps proportional to the live state.

A transaction whose commit was requested just before a crash or rebalance gets its commit markers
written partition by partition. Recovery reads each changelog up to its *last stable* offset, so a
recovery started in that window would hold the transaction's writes in one table and not in another.
:class:`SettledTransactions` makes the recovery wait (bounded) until no transaction is pending on the
changelog partitions it is about to read: the recovered state is then one transactional snapshot.

Where recovery stops matters as much as where it starts. Under exactly_once Faust takes each changelog
partition's end from ``AIOKafkaConsumer.last_stable_offset()``, the value cached from the *last fetch
response* for that partition: ``None`` (read as "empty, nothing to recover") before the first fetch of an
assignment, and stale when a transaction was decided after that fetch (e.g. the aborted transaction of a
killed worker, or a commit of the previous owner). Recovery would then stop early on some partitions and
not on others. :func:`install_full_recovery` therefore asks the broker (ListOffsets, read_committed) for
the last stable offsets once the transactions have settled, and recovery reads exactly up to them.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from rlstream.transport.log import get_logger

log = get_logger(__name__)


def wipe_store(store: Any, partitions: set[int]) -> int:
    """Remove the local data (and persisted changelog offsets) of ``partitions``; returns keys removed."""
    removed = 0
    if hasattr(store, "_dbs"):  # RocksDB: one database per partition, the persisted offset is a key in it
        for partition in sorted(partitions):
            db = store._db_for_partition(partition)
            keys = list(db.keys())
            for key in keys:
                del db[key]
            removed += len(keys)
        if hasattr(store, "_key_index"):
            store._key_index.clear()
        return removed
    removed = len(store.data)
    store.data.clear()
    if hasattr(store, "_key_partition"):
        store._key_partition.clear()
    return removed


class SettledTransactions:
    """Waits until the last stable offset equals the high watermark on a set of partitions."""

    def __init__(self, make_consumer: Callable[[str], AIOKafkaConsumer], timeout_s: float = 30.0) -> None:
        self.make_consumer = make_consumer
        self.timeout_s = timeout_s
        self._committed: AIOKafkaConsumer | None = None
        self._uncommitted: AIOKafkaConsumer | None = None

    async def _consumers(self) -> tuple[AIOKafkaConsumer, AIOKafkaConsumer]:
        if self._committed is None or self._uncommitted is None:
            committed, uncommitted = self.make_consumer("read_committed"), self.make_consumer("read_uncommitted")
            await committed.start()
            await uncommitted.start()
            self._committed, self._uncommitted = committed, uncommitted
        return self._committed, self._uncommitted

    async def wait(self, tps: set[Any]) -> bool:
        """True once no transaction is pending on ``tps``; False after the timeout (logged)."""
        if not tps:
            return True
        parts = [TopicPartition(tp.topic, tp.partition) for tp in tps]
        deadline = time.monotonic() + self.timeout_s
        pending: list[str] = []
        while True:
            try:
                committed, uncommitted = await self._consumers()
                stable = await committed.end_offsets(parts)
                high = await uncommitted.end_offsets(parts)
                pending = [f"{tp.topic}:{tp.partition}" for tp in parts if stable.get(tp) != high.get(tp)]
            except Exception as exc:  # the broker is busy or gone: retry until the deadline
                pending = [f"error: {exc}"]
            if not pending:
                return True
            if time.monotonic() >= deadline:
                log.warning("recovery goes on with transactions still pending", partitions=pending[:8])
                return False
            await asyncio.sleep(0.2)

    async def stable_offsets(self, tps: set[Any]) -> dict[Any, int]:
        """The last stable offset of each partition in ``tps``, asked from the broker now (read_committed)."""
        committed, _ = await self._consumers()
        parts = {tp: TopicPartition(tp.topic, tp.partition) for tp in tps}
        ends = await committed.end_offsets(list(parts.values()))
        return {tp: int(ends[part]) for tp, part in parts.items()}

    async def close(self) -> None:
        for consumer in (self._committed, self._uncommitted):
            if consumer is not None:
                await consumer.stop()
        self._committed = self._uncommitted = None


def install_full_recovery(app: Any, settled: SettledTransactions | None = None) -> None:
    """Wrap the table recovery's rebalance hook: wait for pending changelog transactions to settle,
    then wipe local state and recovered offsets before it runs; under exactly_once, recovery reads up to
    the last stable offsets the broker reports (not the consumer's cached ones)."""
    recovery = app.tables.recovery
    original = recovery.on_rebalance
    original_highwaters = recovery._build_highwaters

    async def build_highwaters(consumer: Any, tps: set[Any], destination: Any, title: str) -> None:
        if settled is None or not tps or not app.in_transaction:
            await original_highwaters(consumer, tps, destination, title)
            return
        try:
            stable = await settled.stable_offsets(set(tps))
        except Exception as exc:  # the broker did not answer: Faust's own (cached) values, said loudly
            log.warning("last stable offsets not available; recovery uses the consumer's cached ones",
                        error=str(exc), title=title)
            await original_highwaters(consumer, tps, destination, title)
            return
        destination.clear()
        destination.update({tp: offset - 1 for tp, offset in stable.items()})  # Faust's convention: last offset
        log.info("changelog recovery reads up to the last stable offsets", title=title,
                 ends={f"{tp.topic}:{tp.partition}": offset for tp, offset in sorted(stable.items())})

    async def on_rebalance(assigned: Any, revoked: Any, newly_assigned: Any, generation_id: int = 0) -> None:
        if generation_id == app.consumer_generation_id:
            changelog_tps = set(app.assignor.assigned_actives()) | set(app.assignor.assigned_standbys())
            if settled is not None:
                await settled.wait({tp for tp in app.assignor.assigned_actives()
                                    if tp.topic in app.tables.changelog_topics})
            removed = 0
            for table in app.tables.values():
                partitions = {tp.partition for tp in changelog_tps if tp.topic in table.changelog_topic.topics}
                removed += wipe_store(table.data, partitions)
            recovery.active_offsets.clear()
            recovery.standby_offsets.clear()
            log.info("local table state wiped before recovery", keys=removed, generation=generation_id)
        await original(assigned, revoked, newly_assigned, generation_id)

    recovery.on_rebalance = on_rebalance
    recovery._build_highwaters = build_highwaters
