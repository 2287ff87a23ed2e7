"""The stream worker's producer settings reach the producers Faust builds (``streams.producer_linger_ms``,
``streams.producer_batch_bytes``), with Kafka's defaults when not set."""
from __future__ import annotations

import pytest

from rlstream.schemas.config import load_config
from rlstream.streams.app import faust_settings
from rlstream.streams.exactly_once.transactions import SourcePartitionApp

pytestmark = pytest.mark.unit


def producer_options(*overrides: tuple[str, str]) -> dict[str, object]:
    cfg = load_config(None, [("kafka.bootstrap_servers", "broker:9092"), *overrides])
    app = SourcePartitionApp("producer-settings", **faust_settings(cfg, "w"))
    return {"linger_ms": app.producer.linger_ms, "max_batch_size": app.producer.max_batch_size}


def test_the_producers_linger_and_batch_size_come_from_the_config() -> None:
    assert producer_options() == {"linger_ms": 0, "max_batch_size": 16384}
    assert producer_options(("streams.producer_linger_ms", "5"), ("streams.producer_batch_bytes", "1048576")) == {
        "linger_ms": 5, "max_batch_size": 1048576}
