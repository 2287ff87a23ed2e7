"""Recovery reads up to the broker's last stable offsets; read_committed readers keep what was committed after an
aborted transaction (both without a broker: the broker-facing parts are doubles)."""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from aiokafka import TopicPartition
from faust.types import TP

from rlstream.transport import aborted_index
from rlstream.streams.exactly_once.state_reset import install_full_recovery


class FakeRecovery:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def on_rebalance(self, *_: Any, **__: Any) -> None:
        self.calls.append("on_rebalance")

    async def _build_highwaters(self, consumer: Any, tps: set[TP], destination: Counter[TP], title: str) -> None:
        # Faust under exactly_once: the LSO cached from the last fetch response, None (-> -1) before any fetch
        self.calls.append(title)
        destination.clear()
        destination.update({tp: -1 for tp in tps})


class FakeTables:
    def __init__(self) -> None:
        self.recovery = FakeRecovery()
        self.changelog_topics: set[str] = set()

    def values(self) -> list[Any]:
        return []


class FakeApp:
    def __init__(self, in_transaction: bool) -> None:
        self.in_transaction = in_transaction
        self.tables = FakeTables()
        self.consumer_generation_id = 0


class FakeSettled:
    async def stable_offsets(self, tps: set[TP]) -> dict[TP, int]:
        return {tp: 377 + tp.partition for tp in tps}


def test_recovery_stops_at_the_last_stable_offsets_the_broker_reports() -> None:
    app = FakeApp(in_transaction=True)
    install_full_recovery(app, FakeSettled())  # type: ignore[arg-type]
    tps = {TP("members-changelog", 0), TP("members-changelog", 1)}
    ends: Counter[TP] = Counter()
    asyncio.run(app.tables.recovery._build_highwaters(None, tps, ends, "active"))
    assert ends == {TP("members-changelog", 0): 376, TP("members-changelog", 1): 377}  # last offset = LSO - 1
    assert app.tables.recovery.calls == []  # the consumer's cached values are not used


def test_without_transactions_recovery_keeps_fausts_ends() -> None:
    app = FakeApp(in_transaction=False)
    install_full_recovery(app, FakeSettled())  # type: ignore[arg-type]
    ends: Counter[TP] = Counter()
    asyncio.run(app.tables.recovery._build_highwaters(None, {TP("c", 0)}, ends, "active"))
    assert ends == {TP("c", 0): -1} and app.tables.recovery.calls == ["active"]


def test_listed_aborted_transactions_are_kept_left_out_or_looked_up() -> None:
    tp = TP("t-aborted-index", 0)
    aborted = [(1028, 2)]  # (producer id, first offset): what noida-db still lists after the ABORT marker at 5

    def unsettled(producer_id: int, first: int, fetch: int, partition: int = 0) -> aborted_index.Unsettled:
        return aborted_index.Unsettled(TopicPartition(tp.topic, partition), producer_id, first, fetch)

    assert aborted_index.settle_listed(tp, aborted, 2) == (aborted, [])  # begins in the fetch: its marker comes too
    assert aborted_index.settle_listed(tp, aborted, 3) == ([], [unsettled(1028, 2, 3)])  # end unknown: look it up
    aborted_index._remember_abort(tp.topic, tp.partition, 1028, 5)
    assert aborted_index.settle_listed(tp, aborted, 5) == ([], [unsettled(1028, 2, 5)])  # the marker is not before
    assert aborted_index.settle_listed(tp, aborted, 6) == ([], [])  # past the marker: Kafka would not list it
    assert aborted_index.settle_listed(tp, [(1028, 7)], 8) == ([], [unsettled(1028, 7, 8)])  # a later transaction
    assert aborted_index.settle_listed(tp, [(1029, 2)], 6) == ([], [unsettled(1029, 2, 6)])  # another producer
    assert aborted_index.settle_listed(TP(tp.topic, 1), aborted, 6) == ([], [unsettled(1028, 2, 6, partition=1)])
    assert aborted_index.settle_listed(tp, None, 6) == ([], [])


def test_install_wraps_aiokafka_once() -> None:
    from aiokafka.consumer import fetcher

    aborted_index.install()
    patched = fetcher.PartitionRecords.__init__
    aborted_index.install()
    assert fetcher.PartitionRecords.__init__ is patched
