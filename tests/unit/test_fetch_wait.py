"""The empty-fetch wait (rlstream/transport/fetch_wait.py): installed once, its wait adjustable, refused when negative,
and an aiokafka release without the patched method fails at start-up naming it."""
from __future__ import annotations

import pytest
from aiokafka.consumer import fetcher

from rlstream.transport import fetch_wait


def test_install_wraps_the_fetcher_once_and_later_calls_only_change_the_wait() -> None:
    fetch_wait.install(20)
    patched = fetcher.Fetcher._proc_fetch_request
    fetch_wait.install(35)
    assert fetcher.Fetcher._proc_fetch_request is patched
    assert fetch_wait.min_round_trip_s() == pytest.approx(0.035)
    fetch_wait.install(20)
    with pytest.raises(ValueError, match=">= 0"):
        fetch_wait.install(-1)


def test_an_aiokafka_without_the_method_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_wait, "_installed", False)
    monkeypatch.delattr(fetcher.Fetcher, "_proc_fetch_request")
    with pytest.raises(RuntimeError, match="Fetcher._proc_fetch_request"):
        fetch_wait.install(20)
