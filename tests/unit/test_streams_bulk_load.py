"""BulkChangelogLoader's time budget, isolated with a scripted consumer (the broker-backed tests are in
tests/integration/test_streams_bulk_recovery.py): when one partition of a table is not read to its end in time, that
whole table is wiped again and none of its partitions is reported recovered (the memory store can only be wiped
whole), while another table read to its end keeps its state and is reported recovered."""
from __future__ import annotations

import json
from typing import Any

import faust
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from faust.types import TP

from rlstream.streams.exactly_once.state_reset import BulkChangelogLoader


def _record(topic: str, partition: int, offset: int, key: str, value: dict[str, Any]) -> ConsumerRecord:
    raw = json.dumps(value).encode()
    return ConsumerRecord(topic, partition, offset, 0, 0, json.dumps(key).encode(), raw, None, 0, len(raw), [])


class ScriptedConsumer:
    """Hands out one scripted batch per getmany; positions follow the records handed out."""

    def __init__(self, batches: list[dict[TopicPartition, list[ConsumerRecord]]]) -> None:
        self.batches = batches
        self.positions: dict[TopicPartition, int] = {}

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def assign(self, parts: list[TopicPartition]) -> None:
        self.positions = {part: 0 for part in parts}

    async def seek_to_beginning(self, *parts: TopicPartition) -> None: ...

    async def getmany(self, *parts: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
                      ) -> dict[TopicPartition, list[ConsumerRecord]]:
        batch = self.batches.pop(0) if self.batches else {}
        for part, records in batch.items():
            self.positions[part] = records[-1].offset + 1
        return batch

    async def position(self, part: TopicPartition) -> int:
        return self.positions[part]


async def test_a_table_with_an_unfinished_partition_is_wiped_whole_and_another_kept() -> None:
    app = faust.App("bulk-unit", broker="kafka://127.0.0.1:1")  # never started: the tables are only stores
    schema = faust.Schema(key_serializer="json", value_serializer="json")
    groups = app.Table("groups", default=None, partitions=2, schema=schema)
    progress = app.Table("progress", default=None, partitions=2, schema=schema)
    g0, g1, p0 = TP("g-changelog", 0), TP("g-changelog", 1), TP("p-changelog", 0)
    first = {  # g0 and p0 read to their ends, g1 only half
        TopicPartition(*g0): [_record(*g0, 0, "a", {"v": 1}), _record(*g0, 1, "a", {"v": 2})],
        TopicPartition(*g1): [_record(*g1, 0, "b", {"v": 1})],
        TopicPartition(*p0): [_record(*p0, 0, "trajectories:0", {"v": 7})],
    }
    loader = BulkChangelogLoader(app, lambda: ScriptedConsumer([first]))  # type: ignore[arg-type, return-value]
    covered = await loader.load({g0: 2, g1: 5, p0: 1}, {g0: groups, g1: groups, p0: progress}, budget_s=0.0)
    assert covered == {p0: 0}
    assert dict(progress.data.items()) == {"trajectories:0": {"v": 7}}
    assert len(groups.data) == 0  # g0 was whole, but the memory store is wiped per table: Faust reads both again

