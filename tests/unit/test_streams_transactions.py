"""The streams app configures its own transaction manager; nothing is stored on Faust's objects."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlstream.schemas.config import RlstreamConfig
from rlstream.streams.app import StreamsApp
from rlstream.streams.exactly_once.transactions import SourcePartitionTransactionManager, SourcePartitionTransport


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
def test_transaction_manager_gets_explicit_settings(tmp_path: Path, guarantee: str) -> None:
    cfg = RlstreamConfig()
    cfg.kafka.bootstrap_servers = "localhost:9092"  # never contacted: the app is only built
    cfg.streams.data_dir = str(tmp_path)
    cfg.streams.processing_guarantee = guarantee  # type: ignore[assignment]
    streams = StreamsApp(cfg, "w0")
    manager = streams.app.consumer.transactions
    assert isinstance(streams.app.transport, SourcePartitionTransport)
    assert isinstance(manager, SourcePartitionTransactionManager) and manager.settings is not None
    assert manager.settings.source_topic == streams.names.trajectories
    assert manager.settings.buffer_tracker is not None
    expected_lock = streams.processing_lock if guarantee == "exactly_once" else None
    assert manager.settings.processing_lock is expected_lock
    assert not [name for name in vars(streams.app) if name.startswith("rlstream")]
