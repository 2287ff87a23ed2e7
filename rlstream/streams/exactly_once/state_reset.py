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

How recovery reads matters for its speed. Faust hands every changelog record through its stream machinery (a
task per record, a recovery-end check over all partitions per record): about 3,700 records/s on two cores,
four and a half minutes for a changelog of 1,000,000 records. :class:`BulkChangelogLoader` reads the active
changelog partitions first with one plain read_committed consumer, up to the same last stable offsets, and
applies them in batches through the table's own ``apply_changelog_batch`` (what Faust's recovery calls), only the
last record of each key per batch; it then marks those partitions recovered up to their ends, so that Faust's own
recovery finds nothing left to read there. Faust runs this step under ``broker_request_timeout`` and stops the
worker past it, so the loader has a time budget (three quarters of it): a table with a partition it could not
finish is wiped again and Faust's recovery reads that table's partitions from their start, the slow way.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from faust.types import TP
from faust.utils import json as faust_json

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


def wipe_tables(tables: dict[Any, Any], partitions: Iterable[Any]) -> list[Any]:
    """Wipe, once each, every table that one of ``partitions`` fills (``tables``: changelog partition -> table),
    all of its partitions in ``tables`` (a memory store is only wiped whole); returns those partitions."""
    wiped: list[Any] = []
    for table_id in {id(tables[tp]) for tp in partitions}:
        table_tps = [tp for tp in tables if id(tables[tp]) == table_id]
        wipe_store(tables[table_tps[0]].data, {tp.partition for tp in table_tps})
        wiped += table_tps
    return wiped


@dataclass(slots=True)  # not frozen: a frozen dataclass costs several times more to build, per record
class ChangelogMessage:
    """What a store's ``apply_changelog_batch`` reads of a changelog record."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None

    @property
    def tp(self) -> TP:
        return TP(self.topic, self.partition)


@dataclass(slots=True)
class ChangelogEvent:
    """A changelog record with its key and value decoded by the table's schema (as Faust's recovery has it)."""

    key: Any
    value: Any
    message: ChangelogMessage


class BulkChangelogLoader:
    """Reads changelog partitions from their start up to given end offsets with one plain read_committed consumer
    and applies them to their tables in batches (see the module docstring)."""

    def __init__(self, app: Any, make_consumer: Callable[[], AIOKafkaConsumer], batch_records: int = 20_000,
                 report_every_s: float = 30.0) -> None:
        self.app = app
        self.make_consumer = make_consumer
        self.batch_records = batch_records
        self.report_every_s = report_every_s

    def _decoders(self, table: Any) -> tuple[Callable[[ChangelogMessage], Any], Callable[[ChangelogMessage], Any]]:
        """Key and value decoders of a table's changelog: the schema's own, or Faust's bare JSON decoder (orjson
        where installed) for a JSON schema without model types: the same values, without the search for model
        namespaces in every decoded object that took two thirds of the load's time."""
        schema = table.changelog_topic.schema
        plain = schema.key_type is None and schema.value_type is None
        if plain and schema.key_serializer == "json" and schema.value_serializer == "json":
            return (lambda m: faust_json.loads(m.key)), (lambda m: None if m.value is None else faust_json.loads(m.value))
        return ((lambda m: schema.loads_key(self.app, m)),
                (lambda m: None if m.value is None else schema.loads_value(self.app, m)))

    def _events(self, table: Any, records: list[Any]) -> list[ChangelogEvent]:
        """The batch's records as events, only the last record of each key: a changelog writes a key many times
        (a group at each member and reward, a progress marker at every input record) and only the last value
        of a batch survives it, so the others are not decoded."""
        last: dict[Any, Any] = {}
        for record in records:
            last[record.key] = record
        load_key, load_value = self._decoders(table)
        events = []
        for record in sorted(last.values(), key=lambda r: r.offset):
            message = ChangelogMessage(record.topic, record.partition, record.offset, record.key, record.value)
            events.append(ChangelogEvent(load_key(message), load_value(message), message))
        return events

    async def load(self, ends: dict[Any, int], tables: dict[Any, Any], budget_s: float) -> dict[Any, int]:
        """Apply every visible record below ``ends[tp]`` (the last stable offset) of each partition to
        ``tables[tp]`` (the last of each key per batch: the same state); returns ``ends[tp] - 1`` for each
        partition read to its end. A table with a partition not read to its end within ``budget_s`` is wiped again
        and all its partitions are left out (Faust's recovery then reads them from their start)."""
        todo = {tp: end for tp, end in ends.items() if end > 0 and tp in tables}
        covered: dict[Any, int] = {}
        if not todo:
            return covered
        consumer = self.make_consumer()
        await consumer.start()
        started = time.monotonic()
        next_report = started + self.report_every_s
        applied = 0
        try:
            parts = {TopicPartition(tp.topic, tp.partition): tp for tp in todo}
            consumer.assign(list(parts))
            await consumer.seek_to_beginning(*parts)
            while parts:
                batch = await consumer.getmany(*parts, timeout_ms=500, max_records=self.batch_records)
                for part, records in batch.items():
                    tp = parts.get(part)
                    if tp is None:
                        continue
                    wanted = [r for r in records if r.offset < todo[tp]]
                    if wanted:
                        table = tables[tp]
                        table.apply_changelog_batch(self._events(table, wanted))
                        covered[tp] = wanted[-1].offset
                        applied += len(wanted)
                for part, tp in list(parts.items()):
                    if await consumer.position(part) >= todo[tp]:  # markers and aborted records count as read
                        covered[tp] = todo[tp] - 1
                        del parts[part]
                await asyncio.sleep(0)  # the batch ran without a pause: let heartbeats and timers run
                now = time.monotonic()
                if parts and now - started >= budget_s:
                    # what is half loaded goes: every table with an unfinished partition is wiped whole (the memory
                    # store wipes whole tables) and Faust's recovery reads all of that table's partitions
                    for tp in wipe_tables(tables, parts.values()):
                        covered.pop(tp, None)
                    log.warning("bulk changelog load out of time; Faust's recovery reads the partitions left, from "
                                "their start", applied=applied, budget_s=budget_s,
                                left=sorted(f"{tp.topic}:{tp.partition}" for tp in parts.values()))
                    break
                if now >= next_report:
                    next_report += self.report_every_s
                    log.info("bulk changelog load", applied=applied, partitions_left=len(parts))
        finally:
            await consumer.stop()
        log.info("changelogs loaded in bulk", records=applied, partitions=len(covered),
                 seconds=round(time.monotonic() - started, 2))
        return covered


def install_full_recovery(app: Any, settled: SettledTransactions | None = None,
                          loader: BulkChangelogLoader | None = None) -> None:
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
        if loader is not None and title == "active":
            # Faust runs this step under broker_request_timeout (and stops the worker past it): the loader stops
            # within it, and Faust's recovery reads what is left
            budget_s = 0.75 * float(app.conf.broker_request_timeout)
            tables = {tp: recovery.tp_to_table[tp] for tp in stable if tp in recovery.tp_to_table}
            try:
                covered = await loader.load(stable, tables, budget_s)
            except Exception as exc:  # the broker failed the loader: Faust's recovery reads everything, as before
                log.warning("bulk changelog load failed; Faust's recovery reads the changelogs whole",
                            error=repr(exc))
                wipe_tables(tables, tables)
                covered = {}
            for tp, offset in covered.items():  # (a Counter: update() would add) Faust's recovery goes on after
                recovery.active_offsets[tp] = offset

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
