"""The broker watch's reading of ``kafka.bootstrap_servers``."""
from __future__ import annotations

import pytest

from rlstream.streams.exactly_once.broker_watch import first_bootstrap_address


@pytest.mark.parametrize(("servers", "address"), [
    ("127.0.0.1:9092", ("127.0.0.1", 9092)),
    ("kafka-0:19092, kafka-1:19092", ("kafka-0", 19092)),
    ("SASL_SSL://broker.example:9094", ("broker.example", 9094)),
    ("[::1]:9092", ("::1", 9092)),
])
def test_the_first_bootstrap_server_is_watched(servers: str, address: tuple[str, int]) -> None:
    assert first_bootstrap_address(servers) == address


@pytest.mark.parametrize("servers", ["kafka", "kafka:port", ":9092", ""])
def test_a_malformed_bootstrap_server_is_a_clear_error(servers: str) -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        first_bootstrap_address(servers)
