"""The latest policy version per policy, read from ``policy-versions`` (and the Redis pointer when set).

Every worker reads all partitions of the topic (no consumer group), from the beginning, so each
knows the latest version whatever partitions it is assigned. ``ready`` is set once the reader has
caught up with the end offsets seen at start, so that no group is judged against an old view.
"""
from __future__ import annotations

import asyncio

from rlstream.transport.kafka import make_consumer
from rlstream.transport.log import get_logger
from rlstream.transport.topic_reader import Decoded, SourceRecord, TopicReader, caught_up, wait_for_partitions
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import PolicyVersion

log = get_logger(__name__)


class PolicyTracker:
    """Keeps ``latest[policy]`` up to date; never moves a version backwards."""

    def __init__(self, cfg: RlstreamConfig, topic: str, codec: AvroCodec, redis_poll_s: float = 2.0) -> None:
        self.cfg = cfg
        self.topic = topic
        self.codec = codec
        self.redis_poll_s = redis_poll_s
        self.latest: dict[str, int] = {}
        self.ready = asyncio.Event()
        self._stopping = False

    def version_of(self, policy: str) -> int | None:
        return self.latest.get(policy)

    def observe(self, policy: str, version: int) -> None:
        if version > self.latest.get(policy, -1):
            self.latest[policy] = version

    async def run(self) -> None:
        """Read the topic forever (and poll Redis alongside when configured)."""
        tasks = [asyncio.create_task(self._read_topic_forever())]
        if self.cfg.redis.url:
            tasks.append(asyncio.create_task(self._poll_redis()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _read_topic_forever(self) -> None:
        delay = 0.5
        while True:
            try:
                await self._read_topic()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker hiccup: read again from the start, never take the app down
                log.warning("policy-versions reader failed, restarting", error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _read_topic(self) -> None:
        consumer = make_consumer(self.cfg.kafka, group_id=None, isolation_level="read_committed")
        reader = TopicReader(consumer, self.codec, PolicyVersion, on_reject=self._unreadable)
        await consumer.start()
        try:
            tps = await wait_for_partitions(consumer, self.topic, timeout_s=10.0)  # the topic may be brand new
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            while True:
                if not self.ready.is_set() and await caught_up(consumer, ends):
                    self.ready.set()
                    log.info("policy versions caught up", latest=self.latest)
                for item in await reader.fetch(timeout_ms=500, max_records=500):
                    self._apply(item)
        finally:
            await consumer.stop()

    @staticmethod
    def _unreadable(source: SourceRecord, reason: BaseException | str) -> None:
        if source.value is not None:  # a tombstone is no error
            log.warning("unreadable policy version ignored", offset=source.offset, error=str(reason))

    def _apply(self, item: Decoded[PolicyVersion]) -> None:
        self.observe(item.event.policy, item.event.version)

    async def _poll_redis(self) -> None:
        from rlstream.transport.control import ControlPlane

        control = ControlPlane(self.cfg.redis.url, retry_max_s=self.cfg.redis.retry_max_s)
        try:
            while True:
                for policy in {self.cfg.policy, *self.latest}:
                    try:
                        version = await control.latest_version(policy)
                    except Exception as exc:  # Redis down: the topic still drives staleness
                        log.warning("redis latest pointer unavailable", policy=policy, error=str(exc))
                        continue
                    if version >= 0:
                        self.observe(policy, version)
                await asyncio.sleep(self.redis_poll_s)
        finally:
            await control.close()
