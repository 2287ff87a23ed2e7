"""Where the records of waiting group members are kept: not in the changelog.

The assembly state (streams.assembly) holds where each waiting trajectory came from (topic, partition, offset);
its bytes stay on the ``trajectories`` topic, which keeps them anyway. :class:`PayloadCache` keeps recently
consumed records in memory, up to ``streams.payload_cache_bytes``, so a group that completes soon after its
members arrived is built from memory; :class:`OffsetReader` reads a record back by its offset (read_committed) when
it is not cached: after a restart or a rebalance, or for a single response whose feedback came hours later. The
topic's retention must outlast ``streams.reward_window_s``; a record that is gone goes to the dead letters as
``payload_unavailable``.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any

from aiokafka import TopicPartition

from rlstream.streams.assembly import SourceRef
from rlstream.transport.log import get_logger

log = get_logger(__name__)


class PayloadCache(MutableMapping[SourceRef, bytes]):
    """Record bytes by source, least recently used first out once over ``max_bytes`` (a miss is read back)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self._entries: OrderedDict[SourceRef, bytes] = OrderedDict()

    def __getitem__(self, ref: SourceRef) -> bytes:
        value = self._entries[ref]
        self._entries.move_to_end(ref)
        return value

    def __setitem__(self, ref: SourceRef, value: bytes) -> None:
        old = self._entries.pop(ref, None)
        if old is not None:
            self.size_bytes -= len(old)
        self._entries[ref] = value
        self.size_bytes += len(value)
        while self.size_bytes > self.max_bytes and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self.size_bytes -= len(evicted)

    def __delitem__(self, ref: SourceRef) -> None:
        self.size_bytes -= len(self._entries.pop(ref))

    def __contains__(self, ref: object) -> bool:
        return ref in self._entries

    def __iter__(self) -> Iterator[SourceRef]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


class OffsetReader:
    """Reads records back by (topic, partition, offset) with a group-less read_committed consumer of its own."""

    def __init__(self, consumer_factory: Callable[[], Any], timeout_s: float = 10.0) -> None:
        self._factory = consumer_factory
        self._consumer: Any = None
        self._lock = asyncio.Lock()
        self.timeout_s = timeout_s

    async def read(self, refs: Iterable[SourceRef]) -> dict[SourceRef, bytes]:
        """The bytes of every record of ``refs`` that is still on its topic and visible to read_committed; a record
        that is gone (retention), aborted or not there is left out (the caller dead-letters its member)."""
        wanted: dict[TopicPartition, set[int]] = {}
        for ref in refs:
            wanted.setdefault(TopicPartition(ref.topic, ref.partition), set()).add(ref.offset)
        if not wanted:
            return {}
        found: dict[SourceRef, bytes] = {}
        async with self._lock:
            if self._consumer is None:
                self._consumer = self._factory()
                await self._consumer.start()
            consumer = self._consumer
            consumer.assign(list(wanted))
            for tp, offsets in wanted.items():
                found.update(await self._read_partition(consumer, tp, sorted(offsets)))
        return found

    async def _read_partition(self, consumer: Any, tp: TopicPartition, offsets: list[int]) -> dict[SourceRef, bytes]:
        found: dict[SourceRef, bytes] = {}
        pending = list(offsets)
        deadline = time.monotonic() + self.timeout_s
        while pending and time.monotonic() < deadline:
            consumer.seek(tp, pending[0])
            batch = await consumer.getmany(tp, timeout_ms=500)
            records = batch.get(tp, [])
            if not records:
                continue
            last = records[-1].offset
            by_offset = {r.offset: r.value for r in records}
            for offset in [o for o in pending if o <= last]:
                value = by_offset.get(offset)
                if value is not None:
                    found[SourceRef(tp.topic, tp.partition, offset)] = bytes(value)
                pending.remove(offset)  # read, or not visible at its offset (aborted, a marker, deleted)
        if pending:
            log.warning("records not read back", topic=tp.topic, partition=tp.partition, offsets=pending[:20],
                        count=len(pending))
        return found

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
