"""The latest policy version per policy, read from ``policy-versions`` (and the Redis pointer when set).

Every worker reads all partitions of the topic (no consumer group), from the beginning, so each
knows the latest version whatever partitions it is assigned. ``ready`` is set once the reader has
caught up with the end offsets seen at start, so that no group is judged against an old view.
"""
from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import TopicPartition

from rlstream.transport.kafka import make_consumer
from rlstream.transport.log import get_logger
from rlstream.schemas.codec import AvroCodec, CodecError
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
        await consumer.start()
        try:
            parts = consumer.partitions_for_topic(self.topic) or set()
            if not parts:
                await consumer._client.force_metadata_update()  # noqa: SLF001 - topic created just before
                parts = consumer.partitions_for_topic(self.topic) or set()
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps) if tps else {}
            while True:
                if not self.ready.is_set() and all([await self._position(consumer, tp) >= ends[tp] for tp in tps]):
                    self.ready.set()
                    log.info("policy versions caught up", latest=self.latest)
                batch = await consumer.getmany(timeout_ms=500, max_records=500)
                for records in batch.values():
                    for record in records:
                        self._apply(record.value, record.offset)
        finally:
            await consumer.stop()

    @staticmethod
    async def _position(consumer: Any, tp: TopicPartition) -> int:
        return int(await consumer.position(tp))

    def _apply(self, value: bytes | None, offset: int) -> None:
        if value is None:
            return
        try:
            pv = self.codec.decode(value, PolicyVersion)
        except CodecError as exc:
            log.warning("unreadable policy version ignored", offset=offset, error=str(exc))
            return
        self.observe(pv.policy, pv.version)

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
