"""The streams app configures its own transaction manager (nothing is stored on Faust's objects), really uses
transactions in a worker, and ends its open transactions when a rebalance begins."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import ProducerFenced
from faust.types import TP
from pydantic import ValidationError

from rlstream.schemas.config import RlstreamConfig
from rlstream.streams.app import StreamsApp
from rlstream.streams.exactly_once.internals import UnsupportedLibraryVersion
from rlstream.streams.exactly_once.transactions import (SourcePartitionTransactionManager, SourcePartitionTransport,
                                                        check_guarantee)


def test_transaction_manager_gets_explicit_settings(tmp_path: Path) -> None:
    streams = build(tmp_path)
    manager = streams.app.consumer.transactions
    assert isinstance(streams.app.transport, SourcePartitionTransport)
    assert isinstance(manager, SourcePartitionTransactionManager) and manager.settings is not None
    assert manager.settings.source_topic == streams.names.trajectories
    assert manager.settings.buffer_tracker is not None
    assert manager.settings.processing_lock is streams.processing_lock
    assert not [name for name in vars(streams.app) if name.startswith("rlstream")]


def build(tmp_path: Path) -> StreamsApp:
    cfg = RlstreamConfig()
    cfg.kafka.bootstrap_servers = "localhost:9092"  # never contacted: the app is only built
    cfg.streams.data_dir = str(tmp_path)
    return StreamsApp(cfg, "w0")


def test_at_least_once_is_refused_by_the_config() -> None:
    """exactly_once is the only guarantee: a config that asks for at_least_once fails to load, naming the field."""
    with pytest.raises(ValidationError, match="processing_guarantee"):
        RlstreamConfig.model_validate({"streams": {"processing_guarantee": "at_least_once"}})
    assert RlstreamConfig.model_validate(
        {"streams": {"processing_guarantee": "exactly_once"}}).streams.processing_guarantee == "exactly_once"


def test_the_worker_uses_transactions_although_its_consumer_is_built_before_the_worker_starts(
        tmp_path: Path) -> None:
    # Faust caches App.in_transaction on first read and its consumer copies it when built; StreamsApp builds the
    # consumer before faust.Worker sets in_worker, which left exactly_once workers without any transaction
    streams = build(tmp_path)
    app, consumer = streams.app, streams.app.consumer
    assert not app.in_transaction and not consumer.in_transaction  # not in a worker (yet)
    assert check_guarantee(app) == "processing_guarantee is exactly_once but the app does not use transactions"
    app.in_worker = True  # what faust.Worker.on_start does
    assert app.in_transaction and consumer.in_transaction
    assert check_guarantee(app) is None


class FakeTxnManager:
    def __init__(self, open_: bool) -> None:
        self.open = open_

    def is_in_transaction(self) -> bool:
        return self.open


class FakeTxnProducer:
    def __init__(self, open_: bool) -> None:
        self._txn_manager = FakeTxnManager(open_)


class FakeProducer:
    """The surface of Faust's producer that the transaction manager touches at a revocation."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock = lock
        self._transaction_producers = {"app-1-1": FakeTxnProducer(True), "app-1-0": FakeTxnProducer(False),
                                       "app-0-0": FakeTxnProducer(True)}
        self.flushed = 0
        self.committed: list[str] = []

    async def flush(self) -> None:
        self.flushed += 1

    async def commit_transaction(self, tid: str) -> None:
        assert self.lock.locked(), "a transaction must not end in the middle of an event"
        self.committed.append(tid)
        self._transaction_producers[tid]._txn_manager.open = False


def test_a_rebalance_commits_every_open_transaction_between_two_events(tmp_path: Path) -> None:
    # partitions a worker keeps through a rebalance would otherwise carry an open transaction into the next
    # generation: the changelog's last stable offset stays behind it and the full recovery would wait for it
    streams = build(tmp_path)
    manager = streams.app.transaction_manager()
    producer = FakeProducer(streams.processing_lock)
    manager.producer = producer  # type: ignore[assignment]
    asyncio.run(manager.on_partitions_revoked(set()))
    assert producer.flushed == 1
    assert producer.committed == ["app-0-0", "app-1-1"]  # the open ones only
    asyncio.run(manager.end_open_transactions())
    assert producer.committed == ["app-0-0", "app-1-1"]


class CommittingProducer:
    """Faust's producer as the commit sees it: ``commit_transactions`` takes a while (its broker round trips)."""

    def __init__(self, lock: asyncio.Lock, fenced: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.lock = lock
        self.fenced = fenced
        self.calls: list[tuple[str, dict[Any, int], bool]] = []
        self.running = self.most_running = 0

    async def commit_transactions(self, by_tid: dict[str, dict[Any, int]], group_id: str,
                                  start_new_transaction: bool = True) -> None:
        assert self.lock.locked(), "a transaction must not end in the middle of an event"
        assert group_id == "rlstream-streams"
        (tid, offsets), = by_tid.items()  # one transaction per call: the calls can run side by side
        self.calls.append((tid, dict(offsets), start_new_transaction))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        await asyncio.sleep(0.05)
        self.running -= 1
        if tid in self.fenced:
            raise ProducerFenced()


def committing_manager(tmp_path: Path, producer_fenced: set[str] = frozenset()  # type: ignore[assignment]
                       ) -> tuple[StreamsApp, Any, CommittingProducer]:
    streams = build(tmp_path)
    manager = streams.app.transaction_manager()
    producer = CommittingProducer(streams.processing_lock, producer_fenced)
    manager.producer = producer  # type: ignore[assignment]
    # the assignor learns the topic groups at the first assignment; inputs are co-partitioned in group 0
    streams.app.assignor.group_for_topic = lambda topic: 0  # type: ignore[method-assign]
    return streams, manager, producer


def test_a_commit_ends_the_transactions_of_its_partitions_side_by_side(tmp_path: Path) -> None:
    streams, manager, producer = committing_manager(tmp_path)
    trajectories, rewards = streams.names.trajectories, streams.names.rewards
    offsets = {TP(trajectories, 0): 5, TP(trajectories, 1): 7, TP(rewards, 1): 3, TP(trajectories, 2): 1}
    assert asyncio.run(manager.commit(offsets)) is True
    by_tid = {tid: (tid_offsets, new) for tid, tid_offsets, new in producer.calls}
    assert by_tid == {
        "rlstream-streams-0-0": ({TP(trajectories, 0): 5}, True),
        "rlstream-streams-0-1": ({TP(trajectories, 1): 7, TP(rewards, 1): 3}, True),
        "rlstream-streams-0-2": ({TP(trajectories, 2): 1}, True)}
    assert producer.most_running == 3  # one after another, the processing lock would be held three times as long


def test_a_fenced_partition_crashes_the_worker_after_the_other_commits_finish(tmp_path: Path) -> None:
    streams, manager, producer = committing_manager(tmp_path, {"rlstream-streams-0-1"})
    crashed: list[BaseException] = []

    async def crash(reason: BaseException) -> None:
        crashed.append(reason)

    streams.app.crash = crash  # type: ignore[method-assign]
    trajectories = streams.names.trajectories
    asyncio.run(manager.commit({TP(trajectories, 0): 5, TP(trajectories, 1): 7}))
    assert len(producer.calls) == 2 and producer.running == 0
    assert len(crashed) == 1 and isinstance(crashed[0], ProducerFenced)


def test_an_aiokafka_producer_without_its_transaction_manager_fails_loudly_at_a_rebalance(tmp_path: Path) -> None:
    streams = build(tmp_path)
    manager = streams.app.transaction_manager()
    producer = FakeProducer(streams.processing_lock)
    del producer._transaction_producers["app-0-0"]._txn_manager  # as a release that renamed it would look
    manager.producer = producer  # type: ignore[assignment]
    with pytest.raises(UnsupportedLibraryVersion, match="_txn_manager"):
        asyncio.run(manager.on_partitions_revoked(set()))
    assert producer.committed == []
