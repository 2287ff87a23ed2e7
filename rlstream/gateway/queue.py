"""Between responses and Kafka: a bounded queue, and an on-disk spool while Kafka is slow or down.

Capture never blocks a response: the routes only :meth:`CaptureQueue.put` an event (False, counted and logged, when
the queue is full). An event Kafka can never take (larger than its record size: the publisher's codec refuses it) is
refused at :meth:`~CaptureQueue.put` with :class:`CaptureRefused`, so the route answers an error instead of a 2xx for
a call that is not captured. A sender task takes events from the queue and

* without a spool, hands them to the publisher; what Kafka refuses is counted and logged, not kept;
* with a spool (:class:`~rlstream.gateway.spool.Spool`), hands them to the publisher while Kafka keeps up
  (*direct*), and switches to *spooling* when Kafka does not take an event or acknowledge it within
  ``spool_after_s``, or refuses one: from then on events are appended to the spool (fsync'd per batch) and a drainer
  task re-sends the spool in order. Capture goes direct again once the spool is empty. An event sent directly and
  overdue is spooled too, linked to its pending delivery: the drainer waits for that delivery and re-sends the
  record only if it failed, so the producer's own retries and the drainer never both write it.

Idempotent re-send: a spooled record counts as sent only once Kafka acknowledged it; the acknowledgements are
persisted after each drained batch and a segment is deleted once all of it is acknowledged. After a crash a
record is re-sent only if it was acknowledged after the last persisted batch (at most ``drain_batch`` records),
or if it was in flight directly when the gateway died; the stream app drops such duplicates by trajectory_id
(``streams.closed_retention_s``).

Tenants: with ``tenant_share`` below 1 and more than one tenant (:meth:`CaptureQueue.share_among`), each tenant's
events may take at most that share of the queue, and of the spool (``Spool.tenant_max_bytes``); a tenant past its share
of the queue overflows to the spool (or is dropped without one) while the other tenants' events still find room: one
tenant's flood never evicts or blocks another's captures. A single tenant has the whole of both.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from rlstream.gateway.spool import Position, Spool, SpoolRecord
from rlstream.schemas.codec import CodecError
from rlstream.schemas.models import CallEvent, RewardEvent, TrajectoryEvent, WireModel
from rlstream.transport.log import get_logger

log = get_logger(__name__)


class Submitter(Protocol):
    """What the queue needs of a publisher (``TrajectoryPublisher`` has it)."""

    trajectories_topic: str
    rewards_topic: str
    calls_topic: str  # a session's calls, keyed by session id (stitched by the stream app)

    async def submit(self, topic: str, key: str, event: WireModel) -> "asyncio.Future[Any]": ...


class Encoder(Protocol):
    def encode(self, event: WireModel) -> bytes: ...


class SpoolSubmitter(Submitter, Protocol):
    """What the queue needs of a publisher when it has a spool: events are encoded once, sent as bytes."""

    codec: Encoder

    async def submit_encoded(self, topic: str, key: bytes, value: bytes) -> "asyncio.Future[Any]": ...


class CaptureRefused(ValueError):
    """An event that can never be sent (larger than a Kafka record, or not encodable): not queued."""


@dataclass
class CaptureStats:
    queued: int = 0
    dropped_full: int = 0      # the queue was full: the event was not kept
    submitted: int = 0         # handed to the producer (directly, not from the spool)
    acknowledged: int = 0      # written by the broker (directly or from the spool), each event once
    failed: int = 0            # not encoded, not handed over, or not written (with a spool: then spooled)
    lost_on_shutdown: int = 0
    overflowed: int = 0        # the queue was full: the event went to the spool instead (a burst, a shutdown)
    spooled: int = 0           # events written to the spool
    spool_sent: int = 0        # spooled events handed to the producer by the drainer
    spool_dropped: int = 0     # the spool was full (spool_max_bytes) or the disk failed: the event was not kept
    over_share: int = 0        # a tenant's share of the queue was full: its event overflowed to the spool or dropped
    refused: int = 0           # never queued: over Kafka's record size or not encodable (CaptureRefused)


@dataclass(eq=False)
class _Queued:
    """An event waiting to be sent, its tenant, and its record when it was encoded at :meth:`CaptureQueue.put`."""

    tenant: str
    event: WireModel
    record: SpoolRecord | None = None


@dataclass(eq=False)
class _Direct:
    """An event handed to the producer directly, not yet acknowledged."""

    record: SpoolRecord
    delivery: "asyncio.Future[Any]"
    sent_at: float
    spooled: bool = False  # a copy is in the spool (linked to ``delivery``)


class CaptureQueue:
    """Events wait here (``maxsize``) for a sender task; with ``spool``, Kafka's troubles go to disk."""

    def __init__(self, publisher: Submitter, maxsize: int, spool: Spool | None = None, spool_after_s: float = 2.0,
                 drain_batch: int = 256, tenant_share: float = 1.0) -> None:
        self.publisher = publisher
        self.queue: asyncio.Queue[_Queued] = asyncio.Queue(maxsize)
        self.tenant_share = tenant_share
        self.spool: Spool | None = None
        #: the share of the queue and of the spool each tenant has now (:meth:`share_among`)
        self.share: float
        #: the most events one tenant may have in the queue (``share`` of it)
        self.tenant_slots: int
        self._apply_share(tenant_share)
        self._held: dict[str, int] = {}  # per tenant: its events in the queue
        self.stats = CaptureStats()
        self.spool_after_s = spool_after_s
        self.drain_batch = drain_batch
        #: True while events go to the spool (from the start when it holds events of a previous run)
        self.spooling = False
        self._inflight: set[_Direct] = set()
        self._rescue: list[_Direct] = []  # direct deliveries that failed before they were spooled
        #: spool positions whose record is also pending directly: the drainer waits for that delivery first
        self._links: dict[Position, "asyncio.Future[Any]"] = {}
        self._holding: list[SpoolRecord] = []  # taken from the queue, neither handed over nor being spooled
        self._overflow: list[_Queued] = []  # did not fit the queue: the watcher writes them to the spool
        self._appends: set["asyncio.Task[list[Position | None]]"] = set()
        self._appending = 0  # spool writes under way
        self._drain_busy = False
        self._drain_progress = 0.0  # monotonic time of the drainer's last batch start or acknowledgement
        self._drain_wake = asyncio.Event()
        self._watch_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        if spool is not None:
            self.use_spool(spool)

    def use_spool(self, spool: Spool) -> None:
        """Spool through ``spool`` (called before :meth:`start`), each tenant with its share of it; events it holds from
        before are sent first."""
        if not (hasattr(self.publisher, "submit_encoded") and hasattr(self.publisher, "codec")):
            raise TypeError("a spool needs a publisher with codec and submit_encoded (TrajectoryPublisher)")
        self.spool = spool
        self._apply_share(self.share)
        self.spooling = spool.pending > 0

    def share_among(self, tenants: int) -> None:
        """Each tenant's share of the queue and of the spool now that ``tenants`` tenants may capture: all of them
        for a single tenant (no other tenant's captures to keep room for), else ``tenant_share``."""
        self._apply_share(self.tenant_share if tenants > 1 else 1.0)

    def _apply_share(self, share: float) -> None:
        """Hold each tenant to ``share`` of the queue and of the spool (if there is one)."""
        self.share = share
        self.tenant_slots = max(1, int(self.queue.maxsize * share))
        if self.spool is not None:
            self.spool.tenant_max_bytes = max(1, int(self.spool.max_bytes * share))

    # -- the routes' side ---------------------------------------------------------------------
    def put(self, event: WireModel, tenant: str | None = None) -> bool:
        """Queue one event of ``tenant`` (default: the event's own ``tenant`` field, else '') without waiting.
        When the queue, or the tenant's share of it, is full the event goes to the spool (where there is one and the
        tenant's share of it is not full: a burst of closed sessions, a shutdown); else it is dropped: False,
        counted and logged. :class:`CaptureRefused` for an event Kafka can never take (with a publisher that has a
        codec, the event is encoded here, once)."""
        owner = tenant if tenant is not None else str(getattr(event, "tenant", "") or "")
        item = _Queued(owner, event, self._encode_at_put(event, owner))
        held = self._held.get(owner, 0)
        full = held >= self.tenant_slots
        if full:
            self.stats.over_share += 1
        else:
            try:
                self.queue.put_nowait(item)
            except asyncio.QueueFull:
                full = True
            else:
                self._held[owner] = held + 1
                self.stats.queued += 1
                return True
        if self.spool is not None and self._tasks and not self.spool.tenant_full(owner):
            if not self._overflow:
                log.warning("capture queue full: events go to the spool", queue_size=self.queue.maxsize,
                            tenant=owner, tenant_slots=self.tenant_slots)
            self._overflow.append(item)
            self.stats.overflowed += 1
            self._watch_wake.set()
            return True
        self.stats.dropped_full += 1
        log.warning("capture queue full: event dropped", kind=type(event).__name__, tenant=owner,
                    dropped=self.stats.dropped_full, key=getattr(event, "trajectory_id", ""))
        return False

    def _encode_at_put(self, event: WireModel, tenant: str) -> SpoolRecord | None:
        """The record of ``event`` when the publisher has a codec (None without one: it is encoded when sent);
        :class:`CaptureRefused` when the codec refuses it (larger than ``kafka.max_message_bytes``)."""
        codec = getattr(self.publisher, "codec", None)
        if codec is None or not hasattr(self.publisher, "submit_encoded"):
            return None
        topic, key = self._topic_key(event)
        try:
            value = codec.encode(event)
        except CodecError as exc:  # too large, or not the schema's shape: no retry would send it
            self.stats.refused += 1
            log.error("capture event refused: Kafka cannot take it", kind=type(event).__name__, tenant=tenant,
                      error=str(exc), refused=self.stats.refused)
            raise CaptureRefused(str(exc)) from exc
        except Exception as exc:  # the schema registry unreachable: the sender encodes it later (and counts)
            log.warning("capture event not encoded yet; the sender tries again", kind=type(event).__name__,
                        error=str(exc))
            return None
        return SpoolRecord(topic, key.encode(), value, tenant)

    def _taken(self, item: _Queued) -> None:
        """``item`` left the queue: its tenant's share has room again."""
        left = self._held.get(item.tenant, 0) - 1
        if left > 0:
            self._held[item.tenant] = left
        else:
            self._held.pop(item.tenant, None)

    def start(self) -> None:
        if self._tasks:
            return
        self._tasks.append(asyncio.create_task(self._run(), name="gateway-capture"))
        if self.spool is not None:
            self._tasks.append(asyncio.create_task(self._drain(), name="gateway-spool-drain"))
            self._tasks.append(asyncio.create_task(self._watch(), name="gateway-spool-watch"))
            if self.spooling:
                log.warning("capture starts by sending the spool", pending=self.spool.pending)

    def figures(self) -> dict[str, Any]:
        """What ``GET /rlstream/stats`` shows of the spool."""
        if self.spool is None:
            return {"enabled": False}
        return {"enabled": True, "spooling": self.spooling, "pending": self.spool.pending,
                "bytes": self.spool.disk_bytes, "segments": self.spool.segments,
                "directory": str(self.spool.directory), **vars(self.spool.stats)}

    # -- sending ------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            while len(batch) < self.drain_batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for item in batch:
                self._taken(item)
            try:
                if self.spool is None:
                    for item in batch:
                        await self._submit(item)
                else:
                    await self._send_or_spool(batch)
            except Exception as exc:  # never let the sender die: the next events must still go out
                log.error("capture sender error", error=str(exc), count=len(batch))
            finally:
                for _ in batch:
                    self.queue.task_done()

    def _topic_key(self, event: WireModel) -> tuple[str, str]:
        if isinstance(event, TrajectoryEvent):
            return self.publisher.trajectories_topic, event.example_id
        if isinstance(event, RewardEvent):
            return self.publisher.rewards_topic, event.example_id
        if isinstance(event, CallEvent):
            return self.publisher.calls_topic, event.session_id
        raise TypeError(type(event))  # pragma: no cover - only these three are queued

    async def _submit(self, item: _Queued) -> None:
        event, record = item.event, item.record
        try:
            if record is not None:
                delivery = await self.publisher.submit_encoded(  # type: ignore[attr-defined]
                    record.topic, record.key, record.value)
            else:
                topic, key = self._topic_key(event)
                delivery = await self.publisher.submit(topic, key, event)
        except Exception as exc:  # Kafka down, encoding error: count and log, never raise into the server
            self.stats.failed += 1
            log.error("capture event not handed to Kafka", kind=type(event).__name__, error=str(exc))
            return
        self.stats.submitted += 1
        delivery.add_done_callback(self._delivered)

    def _delivered(self, fut: "asyncio.Future[Any]") -> None:
        if fut.cancelled() or fut.exception() is not None:
            self.stats.failed += 1
        else:
            self.stats.acknowledged += 1

    def _encode(self, item: _Queued) -> SpoolRecord | None:
        if item.record is not None:
            return item.record
        topic, key = self._topic_key(item.event)
        try:
            value = self.publisher.codec.encode(item.event)  # type: ignore[attr-defined]
        except Exception as exc:  # too large, invalid: it can never be sent
            self.stats.failed += 1
            log.error("capture event not encoded; dropped", kind=type(item.event).__name__, error=str(exc))
            return None
        return SpoolRecord(topic, key.encode(), value, item.tenant)

    async def _send_or_spool(self, batch: list[_Queued]) -> None:
        records = [r for r in map(self._encode, batch) if r is not None]
        publisher: SpoolSubmitter = self.publisher  # type: ignore[assignment]
        sent = 0
        self._holding = records
        while sent < len(records) and not self.spooling:
            record = records[sent]
            try:
                delivery = await asyncio.wait_for(publisher.submit_encoded(record.topic, record.key, record.value),
                                                  self.spool_after_s)
            except Exception as exc:  # not taken in time, or refused: nothing was handed over
                self._start_spooling("Kafka did not take an event", error=repr(exc))
                break
            self.stats.submitted += 1
            direct = _Direct(record, delivery, time.monotonic())
            self._inflight.add(direct)
            delivery.add_done_callback(partial(self._direct_done, direct))
            sent += 1
            self._holding = records[sent:]
        self._holding = []
        if sent < len(records):
            await self._append(records[sent:])

    def _direct_done(self, direct: _Direct, fut: "asyncio.Future[Any]") -> None:
        self._inflight.discard(direct)
        if not fut.cancelled() and fut.exception() is None:
            self.stats.acknowledged += 1
            return
        self.stats.failed += 1
        if not direct.spooled:  # not written: spool it (the watcher does the disk work)
            self._rescue.append(direct)
            self._watch_wake.set()

    def _start_spooling(self, reason: str, **fields: Any) -> None:
        if not self.spooling:
            self.spooling = True
            log.warning("capture goes to the spool until Kafka is back", reason=reason, **fields)

    async def _append(self, records: list[SpoolRecord]) -> list[Position | None]:
        """Write ``records`` to the spool in a worker thread; shielded: a shutdown never cuts a write short."""
        self._appending += 1
        task = asyncio.create_task(self._write(records))
        self._appends.add(task)
        task.add_done_callback(self._appends.discard)
        return await asyncio.shield(task)

    async def _write(self, records: list[SpoolRecord]) -> list[Position | None]:
        assert self.spool is not None
        try:
            positions = await asyncio.to_thread(self.spool.append, records)
        except Exception as exc:  # append never raises by contract; belt and braces
            log.error("spool write failed", error=str(exc))
            positions = [None] * len(records)
        finally:
            self._appending -= 1
        kept = sum(p is not None for p in positions)
        self.stats.spooled += kept
        self._drain_progress = time.monotonic()  # the drainer has new work: shutdown gives it time to send it
        if kept < len(records):
            self.stats.spool_dropped += len(records) - kept
            log.error("capture events dropped: the spool is full or the disk failed", count=len(records) - kept,
                      dropped=self.stats.spool_dropped, max_bytes=self.spool.max_bytes)
        self._drain_wake.set()
        return positions

    # -- the watcher: overdue or failed direct deliveries go to the spool -------------------------------
    async def _watch(self) -> None:
        period = max(0.02, min(0.25, self.spool_after_s / 4))
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._watch_wake.wait(), period)
            self._watch_wake.clear()
            try:
                await self._spool_overflow()
                await self._spool_troubled()
            except Exception as exc:
                log.error("capture watcher error", error=str(exc))

    async def _spool_overflow(self, chunk: int = 512) -> None:
        """Events that did not fit the queue, to the spool (encoded a chunk at a time: the loop keeps serving)."""
        while self._overflow:
            events, self._overflow = self._overflow[:chunk], self._overflow[chunk:]
            self._appending += 1  # counted from here: shutdown waits for these too
            try:
                records = [r for r in map(self._encode, events) if r is not None]
            finally:
                self._appending -= 1
            if records:
                await self._append(records)
            await asyncio.sleep(0)

    async def _spool_troubled(self) -> None:
        now = time.monotonic()
        overdue = [d for d in self._inflight
                   if not d.spooled and not d.delivery.done() and now - d.sent_at >= self.spool_after_s]
        failed, self._rescue = self._rescue, []
        if not overdue and not failed:
            return
        self._start_spooling("Kafka did not acknowledge in time" if overdue else "Kafka refused events",
                             overdue=len(overdue), failed=len(failed))
        for d in overdue:
            d.spooled = True  # before the await: a failure meanwhile must not rescue it twice
        positions = await self._append([d.record for d in overdue + failed])
        for d, position in zip(overdue, positions):
            if position is not None:
                self._links[position] = d.delivery

    # -- the drainer: the spool to Kafka, in order ----------------------------------------------------
    async def _drain(self) -> None:
        assert self.spool is not None
        backoff = 0.2
        while True:
            try:
                if self.spool.pending == 0:
                    self._maybe_go_direct()
                    self._drain_wake.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._drain_wake.wait(), 1.0)
                    continue
                self._drain_busy, self._drain_progress = True, time.monotonic()
                try:
                    ok = await self._drain_batch()
                finally:
                    self._drain_busy = False
                await asyncio.to_thread(self.spool.commit)
            except Exception as exc:
                log.error("spool drainer error", error=str(exc))
                ok = False
            if ok:
                backoff = 0.2
            else:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _drain_batch(self) -> bool:
        """Send one batch of unacknowledged records and wait for each outcome; True when all were written."""
        assert self.spool is not None
        publisher: SpoolSubmitter = self.publisher  # type: ignore[assignment]
        stored = await asyncio.to_thread(self.spool.unacknowledged, self.drain_batch)
        waiting: list[tuple[Position, "asyncio.Future[Any]", bool]] = []  # (position, delivery, sent by us)
        ok = True
        for item in stored:
            linked = self._links.pop(item.position, None)
            if linked is not None:
                waiting.append((item.position, linked, False))
                continue
            record = item.record
            try:
                delivery = await publisher.submit_encoded(record.topic, record.key, record.value)
            except Exception as exc:
                log.warning("spool not sent: Kafka not reachable; retrying", error=str(exc),
                            pending=self.spool.pending)
                ok = False
                break
            self.stats.spool_sent += 1
            waiting.append((item.position, delivery, True))
            delivery.add_done_callback(partial(self._spooled_done, item.position, True))
        for position, delivery, ours in waiting:
            if not ours:
                delivery.add_done_callback(partial(self._spooled_done, position, False))
        if waiting:
            await asyncio.wait([d for _, d, _ in waiting])
        return ok and all(not d.cancelled() and d.exception() is None for _, d, _ in waiting)

    def _spooled_done(self, position: Position, ours: bool, fut: "asyncio.Future[Any]") -> None:
        if fut.cancelled() or fut.exception() is not None:
            if ours:
                self.stats.failed += 1
            return  # stays unacknowledged: the next batch sends it again
        assert self.spool is not None
        self.spool.mark_acknowledged(position)
        self._drain_progress = time.monotonic()
        if ours:  # a linked direct delivery was counted by _direct_done
            self.stats.acknowledged += 1

    def _maybe_go_direct(self) -> None:
        if self.spooling and self._appending == 0 and not self._rescue and self.spool is not None \
                and self.spool.pending == 0:
            self.spooling = False
            log.warning("Kafka is back and the spool is sent: capture goes directly again")

    # -- shutdown -----------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> None:
        """Hand over what is queued (at most ``timeout_s``), then stop. With a spool, whatever Kafka has not
        acknowledged by then is on disk (sent at the next start); without one it is counted as lost."""
        deadline = time.monotonic() + timeout_s
        try:
            await asyncio.wait_for(self.queue.join(), timeout_s)
        except asyncio.TimeoutError:
            if self.spool is None:
                self.stats.lost_on_shutdown += self.queue.qsize()
                log.error("capture events not handed to Kafka at shutdown", count=self.queue.qsize())
        if self.spool is not None:
            # direct deliveries end acknowledged, or spooled by the watcher once overdue; a drained batch that
            # is being acknowledged is let finish (its acknowledgements then need not be sent again)
            # events that did not fit the queue are written, and the spool sent while Kafka keeps acknowledging
            while time.monotonic() < deadline and (
                    any(not d.spooled for d in self._inflight) or self._overflow or self._appending
                    or (self._drain_busy and time.monotonic() - self._drain_progress < self.spool_after_s)
                    or (self.spool.pending and not self.spooling
                        and time.monotonic() - self._drain_progress < self.spool_after_s)):
                await asyncio.sleep(0.02)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self.spool is not None:
            await self._spool_leftovers()

    async def _spool_leftovers(self) -> None:
        """At shutdown: queued events and unacknowledged direct ones go to the spool, then it is closed."""
        assert self.spool is not None
        await asyncio.gather(*self._appends, return_exceptions=True)
        records, self._holding = list(self._holding), []
        overflow, self._overflow = self._overflow, []
        records += [r for r in map(self._encode, overflow) if r is not None]
        while not self.queue.empty():
            item = self.queue.get_nowait()
            self._taken(item)
            record = self._encode(item)
            self.queue.task_done()
            if record is not None:
                records.append(record)
        unacked = [d for d in self._inflight if not d.spooled and not d.delivery.done()] + self._rescue
        self._rescue = []
        records += [d.record for d in unacked]
        if unacked:
            log.warning("direct deliveries not acknowledged at shutdown: spooled (sent again at the next start)",
                        count=len(unacked))
        if records:
            await self._append(records)
        await asyncio.to_thread(self.spool.close)
        if self.spool.pending:
            log.warning("spool closed with events Kafka has not acknowledged; they are sent at the next start",
                        pending=self.spool.pending, directory=str(self.spool.directory))
