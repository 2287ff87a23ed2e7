"""read_committed consumers that apply Kafka's rule exactly, from any start offset.

Kafka's rule: a record is invisible to a read_committed consumer only when its producer's transaction ended in an
ABORT marker at or after it. A fetch response lists the aborted transactions of the fetched range as (producer id,
first offset), and aiokafka skips every transactional batch of such a producer id from that first offset on, until
it meets the producer's ABORT marker. Kafka lists only transactions whose ABORT marker is at or after the fetch
offset. noida-db (the local and test broker) lists every aborted transaction of the partition in every fetch, also
those that ended before the fetch offset (measured 2026-11-25, 2-core x86_64 VM: a fetch at any offset of a
partition with aborted transactions beginning at 5 and 15 listed both). A consumer that starts after such an ABORT
marker, or fetches on from one, is told that the transaction is still open and drops every later batch of that
producer id, committed ones included, until the producer's next ABORT marker (a producer that reuses a
transactional id keeps its producer id, with a new epoch): a reader placed in a committed transaction that follows
an aborted one of the same producer sees none of it, a restarted streams worker or learner skips committed input.

:func:`install` makes aiokafka's fetcher settle every listed transaction that began before the fetch offset before
any record of that fetch is handed on:

* ended: an ABORT marker of that producer id at or after the first offset and before the fetch offset is known
  (read by a consumer of this process, or found by a look-up): the entry is left out;
* still open at the fetch offset: a look-up found no marker of that producer id in [first offset, fetch offset):
  the entry stays, and the records up to the producer's ABORT marker are skipped, as Kafka says;
* not known yet: the fetch hands on nothing for that partition (its position does not move), the fetcher reads
  the batches of [first offset, fetch offset) from the same broker with a read_uncommitted fetch (control batches
  included) until it finds the producer's marker, and the next fetch finds the entry settled. A look-up that fails
  (e.g. the transaction's first offset was deleted from the log) is logged as a warning and tried again on the next
  fetch, ``LOOKUP_RETRY_S`` later: no record passes an unsettled entry. (noida-db stops listing an aborted
  transaction once its records are deleted; Kafka lists one only while it is open at the fetch offset.)

Transactions that begin at or after the fetch offset need nothing: their markers come with the fetched data.
What is learnt is kept for the process (per listed transaction, and the ABORT markers read), so a look-up happens
once per aborted transaction that began before a consumer's start.

:func:`prove_gap` answers the streams worker's progress gate (``streams/exactly_once/progress.py``): whether the
offsets a read_committed consumer did not deliver hold only transaction markers and aborted records.

:func:`rlstream.transport.kafka.make_consumer` installs the guard for every read_committed consumer (streams
probes, learner, sync worker, operator tools) and the streams worker for Faust's consumer. rlstream patches aiokafka
in two modules of ``rlstream/transport/``, this one and ``fetch_wait``; each :func:`install` checks the internals it
needs and fails at start-up, naming them, when an aiokafka release no longer has them.
"""
from __future__ import annotations

import asyncio
import bisect
import contextvars
import enum
import inspect
import threading
from dataclasses import dataclass
from typing import Any

import aiokafka.errors as kafka_errors
from aiokafka.consumer import fetcher as _fetcher
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.control_record import ABORT_MARKER, ControlRecord
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import TopicPartition

from rlstream.transport.log import get_logger

log = get_logger(__name__)

READ_UNCOMMITTED = 0
READ_COMMITTED = 1
#: bytes asked for per look-up read (a broker returns at least one whole batch whatever the limit)
LOOKUP_MAX_BYTES = 1 << 20
#: after a failed look-up, the fetcher waits this long before the fetch that tries again
LOOKUP_RETRY_S = 1.0
#: the parameters of ``PartitionRecords.__init__`` the guard relies on, in order
_PARTITION_RECORDS_PARAMS = ["self", "tp", "records", "aborted_transactions", "fetch_offset", "key_deserializer",
                             "value_deserializer", "check_crcs", "isolation_level"]

_lock = threading.Lock()
#: (topic, partition, producer id) -> sorted offsets of the ABORT markers read so far
_abort_markers: dict[tuple[str, int, int], list[int]] = {}
#: (topic, partition, producer id, first offset) of a listed transaction -> offset of the marker that ended it
_ended: dict[tuple[str, int, int, int], int] = {}
#: the same key -> an offset up to which a look-up found no marker of the producer (still open before it)
_open_through: dict[tuple[str, int, int, int], int] = {}
#: the unsettled entries of the fetch being processed (set around aiokafka's ``_proc_fetch_request``)
_unsettled: contextvars.ContextVar[list["Unsettled"] | None] = contextvars.ContextVar("unsettled", default=None)
_installed = False


@dataclass(frozen=True)
class Unsettled:
    """A listed aborted transaction that began before the fetch offset, whose end is not known yet."""

    tp: TopicPartition
    producer_id: int
    first_offset: int
    fetch_offset: int


@dataclass(frozen=True)
class LogBatch:
    """One record batch as the log holds it (what a read_uncommitted fetch returns, control batches included)."""

    base_offset: int
    next_offset: int
    producer_id: int
    transactional: bool
    control: bool
    abort: bool  # a control batch holding an ABORT marker


def _remember_abort(topic: str, partition: int, producer_id: int, offset: int) -> None:
    with _lock:
        offsets = _abort_markers.setdefault((topic, partition, producer_id), [])
        i = bisect.bisect_left(offsets, offset)
        if i == len(offsets) or offsets[i] != offset:
            offsets.insert(i, offset)


def ended_before(topic: str, partition: int, producer_id: int, first_offset: int, fetch_offset: int) -> bool:
    """Whether a transaction of ``producer_id`` that began at ``first_offset`` is known to have ended (a marker of
    that producer at or after ``first_offset``) before ``fetch_offset``."""
    with _lock:
        end = _ended.get((topic, partition, producer_id, first_offset))
        if end is not None:
            return end < fetch_offset
        offsets = _abort_markers.get((topic, partition, producer_id))
        if not offsets:
            return False
        i = bisect.bisect_left(offsets, first_offset)
        return i < len(offsets) and offsets[i] < fetch_offset


def settle_listed(tp: Any, aborted: Any, fetch_offset: int) -> tuple[list[Any], list[Unsettled]]:
    """The aborted transactions of a fetch response that can still hide records at or after ``fetch_offset``, and
    those whose end is not known yet (they began before ``fetch_offset``: a look-up must settle them)."""
    kept: list[Any] = []
    unsettled: list[Unsettled] = []
    for entry in aborted or []:
        producer_id, first_offset = int(entry[0]), int(entry[1])
        if first_offset >= fetch_offset:
            kept.append(entry)  # its marker, if any, comes with the fetched data
        elif ended_before(tp.topic, tp.partition, producer_id, first_offset, fetch_offset):
            continue
        elif _open_through.get((tp.topic, tp.partition, producer_id, first_offset), first_offset) >= fetch_offset:
            kept.append(entry)  # looked up: still open at the fetch offset
        else:
            unsettled.append(Unsettled(TopicPartition(tp.topic, tp.partition), producer_id, first_offset,
                                       fetch_offset))
    return kept, unsettled


async def read_batches(client: Any, node_id: int, tp: TopicPartition, offset: int) -> tuple[list[LogBatch], int]:
    """The batches the log holds from ``offset`` on (one read_uncommitted fetch, control batches included), and the
    partition's high watermark. Raises the broker's error (e.g. ``OffsetOutOfRangeError``)."""
    request = FetchRequest(0, 1, LOOKUP_MAX_BYTES, READ_UNCOMMITTED, [(tp.topic, [(tp.partition, offset,
                                                                                  LOOKUP_MAX_BYTES)])])
    response = await client.send(node_id, request)
    for topic, partitions in response.topics:
        for partition, error_code, highwater, *part_data in partitions:
            if topic != tp.topic or partition != tp.partition:
                continue
            error = kafka_errors.for_code(error_code)
            if error is not kafka_errors.NoError:
                raise error(f"reading {tp.topic}:{tp.partition} at offset {offset}")
            records = MemoryRecords(part_data[-1])
            batches: list[LogBatch] = []
            while records.has_next():
                batch = records.next_batch()
                if batch is None:  # a batch cut short by the size limit: the next read starts there
                    break
                abort = False
                if batch.is_control_batch:
                    marker = next(batch, None)
                    abort = marker is not None and ControlRecord.parse(marker.key) == ABORT_MARKER
                producer_id = batch.producer_id
                batches.append(LogBatch(int(batch.base_offset), int(batch.next_offset),
                                        -1 if producer_id is None else int(producer_id),
                                        bool(batch.is_transactional), bool(batch.is_control_batch), abort))
            return batches, int(highwater)
    raise kafka_errors.KafkaError(f"the broker's answer holds no data of {tp.topic}:{tp.partition}")


async def settle(client: Any, node_id: int, item: Unsettled) -> None:
    """Find out whether the transaction ``item`` lists ended before its fetch offset (see the module docstring)."""
    tp, key = item.tp, (item.tp.topic, item.tp.partition, item.producer_id, item.first_offset)
    offset = max(item.first_offset, _open_through.get(key, item.first_offset))
    while offset < item.fetch_offset:
        batches, _ = await read_batches(client, node_id, tp, offset)
        batches = [b for b in batches if b.next_offset > offset]
        if not batches:
            raise kafka_errors.KafkaError(f"no batch at {tp.topic}:{tp.partition} offset {offset} below the fetch "
                                          f"offset {item.fetch_offset}")
        for batch in batches:
            if batch.base_offset >= item.fetch_offset:
                offset = item.fetch_offset
                break
            if batch.control and batch.abort:
                _remember_abort(tp.topic, tp.partition, batch.producer_id, batch.base_offset)
            if batch.control and batch.producer_id == item.producer_id and batch.base_offset >= item.first_offset:
                with _lock:
                    _ended[key] = batch.base_offset
                return
            offset = batch.next_offset
    with _lock:
        _open_through[key] = max(_open_through.get(key, 0), min(offset, item.fetch_offset))


async def _settle_all(client: Any, node_id: int, items: list[Unsettled]) -> bool:
    """Settle every item; False when a look-up failed (the next fetch asks again)."""
    ok = True
    for item in sorted(set(items), key=lambda i: (i.tp.topic, i.tp.partition, i.first_offset)):
        if not settle_listed(item.tp, [(item.producer_id, item.first_offset)], item.fetch_offset)[1]:
            continue  # settled by an earlier look-up of this round
        try:
            await settle(client, node_id, item)
        except (kafka_errors.KafkaError, OSError) as exc:
            ok = False
            log.warning("aborted transaction look-up failed; the partition's records wait for it",
                        topic=item.tp.topic, partition=item.tp.partition, producer_id=item.producer_id,
                        first_offset=item.first_offset, fetch_offset=item.fetch_offset, error=repr(exc))
    return ok


class GapVerdict(enum.Enum):
    """What a range of offsets a read_committed consumer did not deliver holds."""

    HIDDEN = "hidden"  # only transaction markers and records of transactions that ended in an ABORT marker
    VISIBLE = "visible"  # at least one record a read_committed consumer must deliver
    UNPROVEN = "unproven"  # at least one offset that cannot be proven hidden (absent, deleted, or an open transaction)


@dataclass(frozen=True)
class GapProof:
    """The verdict on [start, stop), the first offset that decided it (None for HIDDEN) and why."""

    verdict: GapVerdict
    offset: int | None
    reason: str


async def prove_gap(consumer: Any, tp: TopicPartition, start: int, stop: int) -> GapProof:
    """Whether every offset of [start, stop) holds a transaction marker or a record whose producer's transaction
    ended in an ABORT marker, read from the log with a read_uncommitted fetch of ``consumer``'s client (started,
    any isolation level). Reads past ``stop`` until each transaction met in the gap has ended, up to the high
    watermark. Raises on a broker error other than offsets below the log start."""
    client = consumer._client  # noqa: SLF001 - no public call reads control batches
    node_id = client.cluster.leader_for_partition(tp)
    if node_id is None or node_id < 0:
        await client.force_metadata_update()
        node_id = client.cluster.leader_for_partition(tp)
        if node_id is None or node_id < 0:
            raise kafka_errors.KafkaError(f"no leader for {tp.topic}:{tp.partition}")
    offset = covered_to = start
    open_in_gap: dict[int, int] = {}  # producer id -> its first offset in the gap whose transaction is not ended
    while covered_to < stop or open_in_gap:
        try:
            batches, high = await read_batches(client, node_id, tp, offset)
        except kafka_errors.OffsetOutOfRangeError:
            return GapProof(GapVerdict.UNPROVEN, offset, "offsets no longer in the log (deleted by retention?)")
        batches = [b for b in batches if b.next_offset > offset]
        if not batches:
            if covered_to < stop:
                return GapProof(GapVerdict.UNPROVEN, covered_to, "offsets the broker returns no batch for")
            return GapProof(GapVerdict.UNPROVEN, min(open_in_gap.values()),
                            f"transaction without an end marker below the high watermark {high}")
        for batch in batches:
            if covered_to < stop and batch.base_offset > covered_to:
                return GapProof(GapVerdict.UNPROVEN, covered_to, "offsets missing from the log")
            if batch.control:
                first = open_in_gap.pop(batch.producer_id, None)
                if first is not None and not batch.abort:
                    return GapProof(GapVerdict.VISIBLE, first, "a record of a committed transaction")
            elif batch.base_offset < stop:
                first_in_gap = max(batch.base_offset, start)
                if not batch.transactional:
                    return GapProof(GapVerdict.VISIBLE, first_in_gap, "a record outside any transaction")
                open_in_gap.setdefault(batch.producer_id, first_in_gap)
            covered_to = max(covered_to, batch.next_offset)
            offset = batch.next_offset
            if covered_to >= stop and not open_in_gap:
                break
    return GapProof(GapVerdict.HIDDEN, None, "transaction markers and aborted records only")


def install() -> None:
    """Patch aiokafka's ``PartitionRecords`` and ``Fetcher._proc_fetch_request`` in this process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        records_cls = getattr(_fetcher, "PartitionRecords", None)
        fetcher_cls = getattr(_fetcher, "Fetcher", None)
        missing = [f"PartitionRecords.{name}" for name in ("__init__", "_contains_abort_marker")
                   if records_cls is None or not hasattr(records_cls, name)]
        proc = getattr(fetcher_cls, "_proc_fetch_request", None)
        if proc is None or not inspect.iscoroutinefunction(proc):
            missing.append("Fetcher._proc_fetch_request (a coroutine function)")
        if records_cls is not None and hasattr(records_cls, "__init__") and \
                list(inspect.signature(records_cls.__init__).parameters) != _PARTITION_RECORDS_PARAMS:
            missing.append(f"PartitionRecords.__init__{tuple(_PARTITION_RECORDS_PARAMS[1:])}")
        if missing:
            raise RuntimeError(f"aiokafka.consumer.fetcher lacks {missing}: this aiokafka release is not supported by "
                               "rlstream's read_committed guard (rlstream/transport/aborted_index.py)")
        _installed = True
    assert records_cls is not None and fetcher_cls is not None and proc is not None
    original_init = records_cls.__init__
    original_contains_abort = records_cls._contains_abort_marker
    original_proc = proc

    def __init__(self: Any, tp: Any, records: Any, aborted_transactions: Any, fetch_offset: int,
                 key_deserializer: Any, value_deserializer: Any, check_crcs: Any, isolation_level: Any) -> None:
        if isolation_level == READ_COMMITTED:
            aborted_transactions, unsettled = settle_listed(tp, aborted_transactions, fetch_offset)
            if unsettled:
                pending = _unsettled.get()
                if pending is None:
                    raise RuntimeError("aiokafka built fetched records outside Fetcher._proc_fetch_request: "
                                       "rlstream's read_committed guard cannot settle their aborted transactions")
                pending.extend(unsettled)
                records = MemoryRecords(b"")  # nothing of this fetch is handed on before the look-up
        original_init(self, tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                      check_crcs, isolation_level)

    def _contains_abort_marker(self: Any, next_batch: Any) -> bool:
        is_abort = bool(original_contains_abort(self, next_batch))
        if is_abort and next_batch.producer_id is not None:
            _remember_abort(self._tp.topic, self._tp.partition, int(next_batch.producer_id),
                            int(next_batch.base_offset))
        return is_abort

    async def _proc_fetch_request(self: Any, assignment: Any, node_id: int, request: Any) -> bool:
        pending: list[Unsettled] = []
        token = _unsettled.set(pending)
        try:
            has_new_data = await original_proc(self, assignment, node_id, request)
        finally:
            _unsettled.reset(token)
        if pending:
            client = getattr(self, "_client", None)
            if client is None:
                raise RuntimeError("aiokafka's Fetcher has no _client: rlstream's read_committed guard cannot look "
                                   "up aborted transactions (rlstream/transport/aborted_index.py)")
            try:
                if not await _settle_all(client, node_id, pending):
                    await asyncio.sleep(LOOKUP_RETRY_S)
            except asyncio.CancelledError:
                return False  # as aiokafka's own fetch task does when the consumer closes
        return bool(has_new_data)

    records_cls.__init__ = __init__
    records_cls._contains_abort_marker = _contains_abort_marker
    fetcher_cls._proc_fetch_request = _proc_fetch_request
