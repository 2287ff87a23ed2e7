"""The latest policy version per policy, read from ``policy-versions`` (and the Redis pointer when set).

Every worker reads all partitions of the topic (no consumer group), from the beginning, so each
knows the latest version whatever partitions it is assigned. ``ready`` is set once the reader has
caught up with the end offsets seen at start, so that no group is judged against an old view.

Version records are untrusted: only those the fenced learner announced count (transport/trusted_versions.py);
any other record is dead-lettered with the reason and moves nothing. Without a control plane (``redis.url``
empty) no record can be verified, so none is read and the staleness filter has no latest version.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from rlstream.transport.control import ControlPlane
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.kafka import make_consumer, make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.serving import ServingControl
from rlstream.transport.topic_reader import Decoded, SourceRecord, TopicReader, caught_up, wait_for_partitions
from rlstream.transport.trusted_versions import TrustedVersions, UntrustedVersionRecord
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import PolicyVersion

log = get_logger(__name__)


class PolicyTracker:
    """Keeps ``latest[policy]`` up to date; never moves a version backwards."""

    def __init__(self, cfg: RlstreamConfig, topic: str, codec: AvroCodec, redis_poll_s: float = 2.0, *,
                 dlq_topic: str | None = None, service: str = "streams",
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.topic = topic
        self.codec = codec
        self.redis_poll_s = redis_poll_s
        self.dlq_topic = dlq_topic  # refused records are dead-lettered there (logged only without it)
        self.service = service
        self.on_refused = on_refused  # called with the reason of each refused record (counting)
        self.refused = 0
        self.latest: dict[str, int] = {}
        self.serving: dict[str, int] = {}  # the version a promotion gate lets serve, per policy (Redis only)
        self.ready = asyncio.Event()
        self._stopping = False

    def version_of(self, policy: str) -> int | None:
        return self.latest.get(policy)

    def serving_of(self, policy: str) -> int | None:
        return self.serving.get(policy)

    def observe(self, policy: str, version: int) -> None:
        if version > self.latest.get(policy, -1):
            self.latest[policy] = version

    async def run(self) -> None:
        """Read the topic forever (and poll Redis alongside when configured)."""
        if not self.cfg.redis.url:
            log.error("redis.url is not set: policy versions cannot be verified and are not read; the staleness "
                      "filter has no latest version")
            self.ready.set()
            return
        tasks = [asyncio.create_task(self._read_topic_forever()), asyncio.create_task(self._poll_redis())]
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
        producer = make_producer(self.cfg.kafka) if self.dlq_topic else None
        sink = DeadLetterSink(producer, self.codec, self.dlq_topic, self.service, best_effort=True) \
            if producer is not None and self.dlq_topic else None
        reader = TopicReader(consumer, self.codec, PolicyVersion, dead_letters=sink, on_reject=self._unreadable)
        control = ControlPlane(self.cfg.redis.url, retry_max_s=self.cfg.redis.retry_max_s)
        trust = TrustedVersions(control, self.cfg.inference.max_version_jump)
        await consumer.start()
        if producer is not None:
            await producer.start()
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
                    if await trust.admit(reader, item):
                        self._apply(item)
        finally:
            await consumer.stop()
            if producer is not None:
                await producer.stop()
            await control.close()

    def _unreadable(self, source: SourceRecord, reason: BaseException | str) -> None:
        if source.value is None:  # a tombstone is no error
            return
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused(reason.reason if isinstance(reason, UntrustedVersionRecord) else "corrupt_payload")
        if not isinstance(reason, UntrustedVersionRecord):  # admit() already logged an untrusted one
            log.warning("unreadable policy version refused", offset=source.offset, error=str(reason))

    def _apply(self, item: Decoded[PolicyVersion]) -> None:
        self.observe(item.event.policy, item.event.version)

    async def _poll_redis(self) -> None:
        from rlstream.transport.control import ControlPlane

        control = ControlPlane(self.cfg.redis.url, retry_max_s=self.cfg.redis.retry_max_s)
        serving = ServingControl(control)
        try:
            while True:
                for policy in {self.cfg.policy, *self.latest}:
                    try:
                        version = await control.latest_version(policy)
                        pointer = await serving.serving(policy)
                    except Exception as exc:  # Redis down: the topic still drives staleness
                        log.warning("redis latest pointer unavailable", policy=policy, error=str(exc))
                        continue
                    if version >= 0:
                        self.observe(policy, version)
                    if pointer is None:
                        self.serving.pop(policy, None)
                    else:
                        self.serving[policy] = pointer.version
                await asyncio.sleep(self.redis_poll_s)
        finally:
            await control.close()
