"""Exactly-once output to sink topics for Faust.

Faust's transaction manager picks the transactional producer from the *destination* topic's
partition group, which fails for topics the app does not consume (``groups``, ``dlq``: KeyError in
the assignor) and would put an output in another partition's transaction. Here every record sent
while an event is being processed goes into the transaction of that event's source partition, the
one whose offsets Faust commits with it: output and input offsets commit or abort together.
"""
from __future__ import annotations

from typing import Any, Awaitable, Optional

from faust.streams import current_event
from faust.transport.consumer import TransactionManager
from faust.types import HeadersArg, RecordMetadata


class SourcePartitionTransactionManager(TransactionManager):
    """Send inside the transaction of the source partition of the current event."""

    async def send(
        self,
        topic: str,
        key: Optional[bytes],
        value: Optional[bytes],
        partition: Optional[int],
        timestamp: Optional[float],
        headers: Optional[HeadersArg],
        *,
        transactional_id: Optional[str] = None,
    ) -> Awaitable[RecordMetadata]:
        event: Any = current_event()
        if event is None:
            return await super().send(topic, key, value, partition, timestamp, headers)
        source = event.message
        group = self.app.assignor.group_for_topic(source.topic)
        tid = f"{self.app.conf.id}-{group}-{source.partition}"
        return await self.producer.send(topic, key, value, partition, timestamp, headers, transactional_id=tid)
