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
:class:`SettledTransactions` makes the recovery wait until no transaction is pending on the changelog
partitions it is about to read: the recovered state is then one transactional snapshot. The wait has no
deadline (recovering a torn snapshot would break the guarantee silently); it says every
``report_every_s`` which partitions it waits for. It ends in practice within moments: a worker only recovers
the changelogs of partitions it was just assigned, and Faust's transactional ids are per partition, so the
worker's own producers fence the previous owner and abort its open transaction when they start (Kafka also
aborts a transaction after ``transaction.timeout.ms``).

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
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from rlstream.transport.log import get_logger

log = get_logger(__name__)


def wipe_store(store: Any, partitions: set[int]) -> int:
    """Remove the local data (and persisted changelog offsets) of ``partitions``; returns keys removed.

    The store kind is told by its class, and each kind's internals are checked at start-up
    (streams/exactly_once/internals.py): a store of neither kind is an error, never a silent no-op."""
    from faust.stores.memory import Store as MemoryStore

    if isinstance(store, MemoryStore):
        removed = len(store.data)
        store.data.clear()
        store._key_partition.clear()
        return removed
    if type(store).__module__ == "faust.stores.rocksdb":  # one database per partition, its offset a key in it
        removed = 0
        for partition in sorted(partitions):
            db = store._db_for_partition(partition)
            keys = list(db.keys())
            for key in keys:
                del db[key]
            removed += len(keys)
        store._key_index.clear()
        return removed
    raise TypeError(f"cannot wipe a {type(store).__module__}.{type(store).__name__} before recovery: "
                    "streams.store must be memory or rocksdb")


class SettledTransactions:
    """Waits until the last stable offset equals the high watermark on a set of partitions."""

    def __init__(self, make_consumer: Callable[[str], AIOKafkaConsumer], report_every_s: float = 30.0) -> None:
        self.make_consumer = make_consumer
        self.report_every_s = report_every_s
        self._committed: AIOKafkaConsumer | None = None
        self._uncommitted: AIOKafkaConsumer | None = None

    async def _consumers(self) -> tuple[AIOKafkaConsumer, AIOKafkaConsumer]:
        if self._committed is None or self._uncommitted is None:
            committed, uncommitted = self.make_consumer("read_committed"), self.make_consumer("read_uncommitted")
            await committed.start()
            await uncommitted.start()
            self._committed, self._uncommitted = committed, uncommitted
        return self._committed, self._uncommitted

    async def wait(self, tps: set[Any]) -> None:
        """Return once no transaction is pending on ``tps`` (no deadline; the wait is logged while it lasts)."""
        if not tps:
            return
        parts = [TopicPartition(tp.topic, tp.partition) for tp in tps]
        started = time.monotonic()
        next_report = started + self.report_every_s
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
                return
            if time.monotonic() >= next_report:
                next_report += self.report_every_s
                log.warning("recovery waits for open transactions on its changelogs to be decided",
                            waited_s=round(time.monotonic() - started), partitions=pending[:8])
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
