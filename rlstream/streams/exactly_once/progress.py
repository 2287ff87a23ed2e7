"""Source progress kept in a changelog table: the state and its input offset commit together.

``progress`` maps ``"<topic>:<partition>"`` to the offset of the last record of that source partition
whose effects (table writes, groups, dead letters) were applied. It is written while the record is
processed, so it lands in the same partition transaction as those effects; after a restart or a
rebalance the recovered marker M says exactly where the recovered state stops, whatever offset the
consumer group committed.

:class:`ProgressGate` decides, per record, whether it may be processed:

* after every assignment the gate is closed until Faust's table recovery has finished (the app is no
  longer rebalancing) and a resync has sought every assigned source partition to M + 1 (no marker:
  the committed offset stands);
* a record at or below M was applied already and is skipped (replays after a seek are cheap);
* a record above M + 1 means records in between were not delivered (stale buffered records from an
  older position, or records Faust dropped on a flow resume), or that the offsets in between hold no
  record a read_committed consumer sees (transaction markers, aborted records). A :class:`GapProbe`
  reads the offsets in between from the log (:func:`rlstream.transport.aborted_index.prove_gap`):

  - proven to hold only transaction markers and records of transactions that ended in an ABORT marker:
    the record is processed;
  - a record a read_committed consumer must deliver is there: the record is skipped *un-acked* (so the
    committed offset cannot pass it) and the partition is sought back to M + 1, again and again, until
    the missing records come in order. A gap is never accepted on a timer: under load a seek back can
    take longer than any fixed patience;
  - neither can be proven (offsets deleted from the log, an open transaction, a broker that returns no
    batch): the partition stops there, loudly (an error log and ``on_unproven_gap``, which the worker
    counts as ``streams.unproven_gaps``), and the gate asks again every ``PROBE_RETRY_S``. No gap is
    accepted because a probe saw nothing.

Every seek of the gate also moves Faust's read offset for the partition back (as Faust's own
``Consumer.seek`` does): Faust drops fetched records below the offset it last handed to the stream, so
records the gate deferred (e.g. while the app was still rebalancing) would otherwise never come again, and
the gate would end up skipping them.
"""
from __future__ import annotations

import asyncio
import contextvars
import enum
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from faust.types import TP

from rlstream.transport.aborted_index import GapProof, GapVerdict, prove_gap
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: a seek back that has not brought the missing record within this time is done again (without limit)
SEEK_BACK_RETRY_S = 2.0
#: an inconclusive probe (the broker did not answer in time) is asked again after this long
PROBE_RETRY_S = 10.0


class Admission(enum.Enum):
    """What the gate decided for one record."""

    PROCESS = "process"  # the next record of its partition: apply it (then ack it)
    APPLIED = "applied"  # at or below the marker: applied before, ack it without processing
    LATER = "later"  # out of order or during a rebalance: skip it un-acked, it will be fetched again


def progress_key(topic: str, partition: int) -> str:
    """The progress table key of one source partition."""
    return f"{topic}:{partition}"


#: ``probe(tp, start, stop)``: what the offsets [start, stop) hold (None: no answer from the broker)
Probe = Callable[[TP, int, int], Awaitable["GapProof | None"]]
#: ``on_unproven_gap(tp, start, stop, proof)``: a partition stopped before a gap that cannot be proven hidden
UnprovenGapHook = Callable[[TP, int, int, GapProof], None]


class GapProbe:
    """What the offsets a read_committed consumer did not deliver hold, read from the log with a group-less
    consumer's client (:func:`rlstream.transport.aborted_index.prove_gap`)."""

    def __init__(self, consumer_factory: Callable[[], AIOKafkaConsumer], timeout_s: float = 10.0) -> None:
        self._factory = consumer_factory
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        self.timeout_s = timeout_s

    async def __call__(self, tp: TP, start: int, stop: int) -> GapProof | None:
        async with self._lock:
            try:
                if self._consumer is None:
                    consumer = self._factory()
                    await consumer.start()
                    self._consumer = consumer
                return await asyncio.wait_for(
                    prove_gap(self._consumer, TopicPartition(tp.topic, tp.partition), start, stop), self.timeout_s)
            except Exception as exc:  # inconclusive: the gate keeps the record back and asks again later
                log.warning("offset probe failed", topic=tp.topic, partition=tp.partition, start=start, stop=stop,
                            error=repr(exc))
            return None

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None


class ProgressGate:
    """Per-record gate over a ``progress`` table (see the module docstring)."""

    def __init__(self, table: MutableMapping[str, Any], consumer: Any, topics: set[str], probe: Probe,
                 on_unproven_gap: UnprovenGapHook | None = None) -> None:
        self.table = table
        self.consumer = consumer
        self.topics = topics
        self.probe = probe
        self.on_unproven_gap = on_unproven_gap
        self.resync_needed = True
        self._seek_back: dict[TP, tuple[int, float, int]] = {}  # offset, when, attempt
        self._probed: dict[TP, tuple[int, float]] = {}  # the expected offset last probed, and when
        # partitions without a marker: the offset before the position they were sought to at resync
        self._floor: dict[TP, int] = {}

    def invalidate(self) -> None:
        """A rebalance or recovery began: resync before the next record."""
        self.resync_needed = True

    def marker(self, topic: str, partition: int) -> int | None:
        """The last applied offset of the partition (or, before its first record, the one before the
        resync position)."""
        value = self.table.get(progress_key(topic, partition))
        return self._floor.get(TP(topic, partition)) if value is None else int(value)

    async def resync(self) -> dict[TP, int]:
        """Seek every assigned source partition to its marker + 1; returns the seeks done."""
        self.resync_needed = False  # a rebalance during the seeks sets it again
        self._seek_back.clear()
        self._floor.clear()
        seeks: dict[TP, int] = {}
        origin: dict[str, str] = {}
        assigned = [tp for tp in sorted(self.consumer.assignment()) if tp.topic in self.topics]
        # Read outside the record being processed (an empty context): Faust's RocksDB store looks a key up only in
        # the database of the current event's partition, so the markers of every other partition would read as
        # missing and those partitions would start from their committed offsets instead.
        markers = contextvars.Context().run(lambda: {tp: self.marker(tp.topic, tp.partition) for tp in assigned})
        for tp in assigned:
            marker = markers[tp]
            if marker is None:  # nothing applied yet: start at the committed offset (else the log start)
                start = self.consumer._committed_offset.get(tp)
                how = "committed"
                if start is None:
                    start = (await self.consumer.earliest_offsets(tp)).get(tp) or 0
                    how = "log start"
                self._floor[tp] = start - 1
            else:
                start, how = marker + 1, "marker"
            await self._seek(tp, start)
            seeks[tp] = start
            origin[f"{tp.topic}:{tp.partition}"] = f"{start} ({how})"
        log.info("source partitions sought to their progress markers", seeks=origin)
        return seeks

    async def admit(self, topic: str, partition: int, offset: int) -> Admission:
        """Whether the record is the next one to apply, was applied already, or must come again later
        (records before it are missing: the partition is sought back to marker + 1)."""
        marker = self.marker(topic, partition)
        if marker is None:
            return Admission.PROCESS
        if offset <= marker:
            return Admission.APPLIED
        expected = marker + 1
        if offset == expected:
            return Admission.PROCESS
        tp = TP(topic, partition)
        probed = self._probed.get(tp)
        if probed is None or probed[0] != expected or time.monotonic() - probed[1] >= PROBE_RETRY_S:
            self._probed[tp] = (expected, time.monotonic())
            proof = await self.probe(tp, expected, offset)
            if proof is not None and proof.verdict is GapVerdict.HIDDEN:
                log.debug("offsets proven to hold only transaction markers and aborted records",
                          topic=topic, partition=partition, first=expected, last=offset - 1)
                return Admission.PROCESS
            if proof is not None and proof.verdict is GapVerdict.UNPROVEN:
                log.error("partition stopped: offsets before this record cannot be proven to hold only transaction "
                          "markers and aborted records", topic=topic, partition=partition, expected=expected,
                          offset=offset, unproven_offset=proof.offset, reason=proof.reason)
                if self.on_unproven_gap is not None:
                    self.on_unproven_gap(tp, expected, offset, proof)
        sought = self._seek_back.get(tp)
        if sought is not None and sought[0] == expected:
            return Admission.LATER  # stale records still in the buffer; the seek back is under way
        await self._seek_back_to(tp, expected, 1)
        log.warning("records missing before this one; partition sought back", topic=topic, partition=partition,
                    expected=expected, offset=offset)
        return Admission.LATER

    async def _seek_back_to(self, tp: TP, offset: int, attempt: int) -> None:
        await self._seek(tp, offset)
        self._seek_back[tp] = (offset, time.monotonic(), attempt)

    async def _seek(self, tp: TP, offset: int) -> None:
        """Seek and let the records from ``offset`` on through again (see the module docstring)."""
        await self.consumer.seek_wait({tp: offset})
        read_offset = getattr(self.consumer, "_read_offset", None)  # Faust's consumer; test doubles have none
        if read_offset is not None:
            read_offset[tp] = offset if offset else None  # exactly what faust's Consumer.seek stores

    async def maintain(self) -> None:
        """Timer work (call with no record in flight): seek again every partition whose seek back has
        not brought its missing record yet (a fetch in flight can move the read position past it)."""
        now = time.monotonic()
        for tp, (offset, at, attempt) in list(self._seek_back.items()):
            marker = self.marker(tp.topic, tp.partition)
            if marker is not None and marker >= offset:
                del self._seek_back[tp]  # the missing records came
            elif now - at >= SEEK_BACK_RETRY_S and tp in self.consumer.assignment():
                await self._seek_back_to(tp, offset, attempt + 1)
                log.info("partition sought back again", topic=tp.topic, partition=tp.partition, offset=offset,
                         attempt=attempt + 1)

    def applied(self, topic: str, partition: int, offset: int) -> None:
        """Record that the record's effects were applied (call inside the record's processing)."""
        self.table[progress_key(topic, partition)] = offset
