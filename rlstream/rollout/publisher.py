"""Publishing trajectories and rewards to Kafka, with backpressure and honest acknowledgements.

:class:`TrajectoryPublisher` wraps an idempotent aiokafka producer (acks=all). Events are keyed by
``example_id`` so that every event of one example lands in one partition. At most ``max_in_flight``
events wait for the broker: ``submit`` blocks (backpressure) when that many are unacknowledged.
An event counts as acknowledged only when the broker has confirmed the write; a delivery failure is
raised to whoever awaits the event and again by ``flush``.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from rlstream.transport.kafka import make_producer
from rlstream.transport.log import get_logger
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import KafkaConfig
from rlstream.schemas.models import RewardEvent, TrajectoryEvent, WireModel

T = TypeVar("T")

log = get_logger(__name__)


class PublishError(RuntimeError):
    """One or more events were not written; ``failures`` lists (key, error) for each."""

    def __init__(self, message: str, failures: list[tuple[str, BaseException]] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or []


@dataclass
class PublishStats:
    submitted: int = 0
    acknowledged: int = 0
    failed: int = 0
    unconfirmed: int = 0  # callers told "not acknowledged" after the delivery timeout
    by_topic: dict[str, int] = field(default_factory=dict)


class TrajectoryPublisher:
    """Publishes TrajectoryEvents and RewardEvents, keyed by example_id."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        trajectories_topic: str,
        rewards_topic: str,
        codec: AvroCodec | None = None,
        max_in_flight: int = 256,
        delivery_timeout_s: float = 120.0,
        calls_topic: str = "",
    ) -> None:
        self.producer = producer
        self.calls_topic = calls_topic  # the gateway's session calls (CallEvent, keyed by session id)
        self.delivery_timeout_s = delivery_timeout_s
        self.trajectories_topic = trajectories_topic
        self.rewards_topic = rewards_topic
        self.codec = codec or AvroCodec()
        self.max_in_flight = max_in_flight
        self._slots = asyncio.Semaphore(max_in_flight)
        self._pending: set[asyncio.Future[RecordMetadata]] = set()
        self._unreported: list[tuple[str, BaseException]] = []
        self._started = False
        self._start_lock = asyncio.Lock()
        self._closed = False
        self.stats = PublishStats()

    @classmethod
    def from_config(cls, kafka: KafkaConfig, trajectories_topic: str, rewards_topic: str,
                    max_in_flight: int = 256, delivery_timeout_s: float = 120.0, codec: AvroCodec | None = None,
                    calls_topic: str = "", **producer_options: object) -> "TrajectoryPublisher":
        """A publisher over a new idempotent producer built from the Kafka config (and its schema registry).
        Pass ``codec`` (``schemas.codec.codec_for(cfg)``) when the producer also writes other topics (metrics)."""
        codec = codec or AvroCodec.from_config(kafka, {TrajectoryEvent.avro_name: trajectories_topic,
                                                       RewardEvent.avro_name: rewards_topic})
        return cls(make_producer(kafka, **producer_options), trajectories_topic, rewards_topic, codec=codec,
                   max_in_flight=max_in_flight, delivery_timeout_s=delivery_timeout_s, calls_topic=calls_topic)

    async def start(self) -> "TrajectoryPublisher":
        async with self._start_lock:  # the gateway's sender and spool drainer may both be first
            if not self._started:
                # a registry that is down or refuses the schemas stops the publisher now, not its first events
                await asyncio.to_thread(self.codec.ensure_registered, [TrajectoryEvent.avro_name,
                                                                       RewardEvent.avro_name])
                await self.producer.start()
                self._started = True
        return self

    async def __aenter__(self) -> "TrajectoryPublisher":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        """Events handed to the producer and not yet acknowledged or failed."""
        return len(self._pending)

    async def submit(self, topic: str, key: str, event: WireModel) -> asyncio.Future[RecordMetadata]:
        """Hand one event to the producer; waits while ``max_in_flight`` are unacknowledged.

        Returns a future that resolves to the broker's RecordMetadata once written, or raises the
        delivery error. Encoding errors are raised here, before anything is sent.
        """
        if self._closed:
            raise PublishError("publisher is closed")
        if not self._started:
            await self.start()
        return await self.submit_encoded(topic, key.encode(), self.codec.encode(event))

    async def submit_encoded(self, topic: str, key: bytes, value: bytes) -> asyncio.Future[RecordMetadata]:
        """:meth:`submit` for an event already encoded (the capture gateway's spool re-sends stored bytes).

        Cancelled while waiting, it hands nothing to the producer and raises CancelledError."""
        if self._closed:
            raise PublishError("publisher is closed")
        if not self._started:
            await self.start()
        await self._slots.acquire()
        try:
            delivery = await self.producer.send(topic, value, key=key)
        except asyncio.CancelledError:
            self._slots.release()
            raise
        except BaseException as exc:
            self._slots.release()
            self.stats.failed += 1
            shown = key.decode(errors="replace")
            raise PublishError(f"event for key {shown!r} was not handed to the producer: {exc}",
                               [(shown, exc)]) from exc
        self.stats.submitted += 1
        self.stats.by_topic[topic] = self.stats.by_topic.get(topic, 0) + 1
        self._pending.add(delivery)
        delivery.add_done_callback(lambda fut, k=key.decode(errors="replace"): self._delivered(fut, k))
        return delivery

    def _delivered(self, fut: asyncio.Future[RecordMetadata], key: str) -> None:
        self._pending.discard(fut)
        self._slots.release()
        if fut.cancelled():
            self.stats.failed += 1
            self._unreported.append((key, asyncio.CancelledError("delivery cancelled")))
        elif fut.exception() is not None:
            self.stats.failed += 1
            self._unreported.append((key, fut.exception()))  # type: ignore[arg-type]
            log.error("event not delivered", key=key, error=str(fut.exception()))
        else:
            self.stats.acknowledged += 1

    async def _wait(self, delivery: asyncio.Future[RecordMetadata], key: str) -> RecordMetadata:
        try:
            meta = await asyncio.wait_for(asyncio.shield(delivery), self.delivery_timeout_s)
        except asyncio.TimeoutError:
            self.stats.unconfirmed += 1
            raise PublishError(
                f"event for key {key!r} was not acknowledged within {self.delivery_timeout_s:.0f} s (broker "
                "unreachable?); it is not confirmed and may still be written by the producer's retries",
                [(key, TimeoutError("delivery not acknowledged"))]) from None
        except Exception as exc:
            self._forget(delivery)
            raise PublishError(f"event for key {key!r} was not written: {exc}", [(key, exc)]) from exc
        return meta

    def _forget(self, delivery: asyncio.Future[RecordMetadata]) -> None:
        """The caller saw this failure itself; flush need not report it again."""
        exc = delivery.exception() if delivery.done() and not delivery.cancelled() else None
        self._unreported = [(k, e) for k, e in self._unreported if e is not exc]

    async def publish_trajectory(self, event: TrajectoryEvent) -> RecordMetadata:
        """Write one trajectory and wait for the broker's acknowledgement."""
        delivery = await self.submit(self.trajectories_topic, event.example_id, event)
        return await self._wait(delivery, event.example_id)

    async def publish_reward(self, event: RewardEvent) -> RecordMetadata:
        """Write one (late) reward and wait for the broker's acknowledgement."""
        delivery = await self.submit(self.rewards_topic, event.example_id, event)
        return await self._wait(delivery, event.example_id)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every submitted event is acknowledged or failed; raise PublishError on failures,
        or when some are still unacknowledged after ``timeout_s`` (default: the delivery timeout)."""
        timeout_s = self.delivery_timeout_s if timeout_s is None else timeout_s
        if self._pending:
            done, still = await asyncio.wait(list(self._pending), timeout=timeout_s)
            if still:
                raise PublishError(f"{len(still)} event(s) not acknowledged within {timeout_s:.0f} s")
        if self._unreported:
            failures, self._unreported = self._unreported, []
            raise PublishError(f"{len(failures)} event(s) were not written; first: {failures[0][1]}", failures)

    async def close(self) -> None:
        """Flush, then stop the producer. Raises PublishError if anything was not written."""
        if self._closed:
            return
        try:
            if self._started:
                await self.flush()
        finally:
            self._closed = True
            await self.producer.stop()  # also after a failed start, which may have left its client open


class SyncTrajectoryPublisher:
    """:class:`TrajectoryPublisher` for synchronous code (a Flask view, a LangChain callback, a script): the
    publisher runs on its own event loop in a background thread; every method blocks until it is done.

        with SyncTrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards) as publisher:
            publisher.publish_trajectory(event)
    """

    def __init__(self, make: Callable[[], "TrajectoryPublisher"]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlstream-publisher", daemon=True)
        self._thread.start()
        self._publisher = self._call(self._build(make))
        self._closed = False

    @staticmethod
    async def _build(make: Callable[[], "TrajectoryPublisher"]) -> TrajectoryPublisher:
        return make()  # created on the publisher's loop (its locks and futures belong to that loop)

    @classmethod
    def from_config(cls, kafka: KafkaConfig, trajectories_topic: str, rewards_topic: str,
                    **options: Any) -> "SyncTrajectoryPublisher":
        return cls(lambda: TrajectoryPublisher.from_config(kafka, trajectories_topic, rewards_topic, **options))

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> "SyncTrajectoryPublisher":
        self._call(self._publisher.start())
        return self

    def __enter__(self) -> "SyncTrajectoryPublisher":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> PublishStats:
        return self._publisher.stats

    def publish_trajectory(self, event: TrajectoryEvent) -> RecordMetadata:
        """Write one trajectory; returns once the broker acknowledged it."""
        return self._call(self._publisher.publish_trajectory(event))

    def publish_reward(self, event: RewardEvent) -> RecordMetadata:
        """Write one (late) reward; returns once the broker acknowledged it."""
        return self._call(self._publisher.publish_reward(event))

    def flush(self, timeout_s: float | None = None) -> None:
        self._call(self._publisher.flush(timeout_s))

    def close(self) -> None:
        """Flush, stop the producer and the background loop (raises PublishError if anything was not written)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._publisher.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
