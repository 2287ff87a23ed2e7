"""A bounded queue between responses and Kafka: capture never blocks or fails a response."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from rlstream.transport.log import get_logger
from rlstream.schemas.models import RewardEvent, TrajectoryEvent, WireModel

log = get_logger(__name__)


class Submitter(Protocol):
    """What the queue needs of a publisher (``TrajectoryPublisher`` has it)."""

    trajectories_topic: str
    rewards_topic: str

    async def submit(self, topic: str, key: str, event: WireModel) -> "asyncio.Future[Any]": ...


@dataclass
class CaptureStats:
    queued: int = 0
    dropped_full: int = 0      # the queue was full: the event was not kept
    submitted: int = 0
    acknowledged: int = 0
    failed: int = 0            # handing to the producer failed, or the broker did not write it
    lost_on_shutdown: int = 0


class CaptureQueue:
    """Events wait here (``maxsize``) for a worker task that hands them to the publisher."""

    def __init__(self, publisher: Submitter, maxsize: int) -> None:
        self.publisher = publisher
        self.queue: asyncio.Queue[WireModel] = asyncio.Queue(maxsize)
        self.stats = CaptureStats()
        self._task: asyncio.Task[None] | None = None

    def put(self, event: WireModel) -> bool:
        """Queue one event without waiting; False (counted and logged) when the queue is full."""
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.stats.dropped_full += 1
            log.warning("capture queue full: event dropped", kind=type(event).__name__,
                        dropped=self.stats.dropped_full, key=getattr(event, "trajectory_id", ""))
            return False
        self.stats.queued += 1
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gateway-capture")

    async def _run(self) -> None:
        while True:
            event = await self.queue.get()
            try:
                await self._submit(event)
            finally:
                self.queue.task_done()

    async def _submit(self, event: WireModel) -> None:
        if isinstance(event, TrajectoryEvent):
            topic, key = self.publisher.trajectories_topic, event.example_id
        elif isinstance(event, RewardEvent):
            topic, key = self.publisher.rewards_topic, event.example_id
        else:  # pragma: no cover - only these two are queued
            raise TypeError(type(event))
        try:
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

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every queued event is handed over; then stop the worker."""
        try:
            await asyncio.wait_for(self.queue.join(), timeout_s)
        except asyncio.TimeoutError:
            self.stats.lost_on_shutdown += self.queue.qsize()
            log.error("capture events not handed to Kafka at shutdown", count=self.queue.qsize())
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
