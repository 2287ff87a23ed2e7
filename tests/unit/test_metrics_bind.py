"""Prometheus endpoints bind loopback unless the config's metrics_host says otherwise."""
from __future__ import annotations

from typing import Iterator

import pytest

from rlstream.cli.common import load_or_exit
from rlstream.transport.metrics import (DEFAULT_PROMETHEUS_ADDR, default_prometheus_addr, set_default_prometheus_addr,
                                        start_prometheus, stop_prometheus)


@pytest.fixture
def restored_default() -> Iterator[None]:
    yield
    set_default_prometheus_addr(DEFAULT_PROMETHEUS_ADDR)


def test_endpoints_bind_loopback_by_default_and_metrics_host_when_set(restored_default: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = start_prometheus(0)
    try:
        assert endpoint.server.server_address[0] == "127.0.0.1"
    finally:
        stop_prometheus(endpoint)
    load_or_exit(None, [("metrics_host", "0.0.0.0")])  # what every service's CLI does with its config
    assert default_prometheus_addr() == "0.0.0.0"
    endpoint = start_prometheus(0)
    try:
        assert endpoint.server.server_address[0] == "0.0.0.0"
    finally:
        stop_prometheus(endpoint)
    monkeypatch.setenv("RLSTREAM_METRICS_HOST", "127.0.0.1")
    load_or_exit(None, None)
    assert default_prometheus_addr() == "127.0.0.1"
