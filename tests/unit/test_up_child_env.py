"""The environment ``rlstream up`` adds to its services."""
from __future__ import annotations

import pytest

from rlstream.ops import up

pytestmark = pytest.mark.unit


def test_the_learner_runs_one_openmp_thread_on_a_small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(up.os, "cpu_count", lambda: 2)
    assert up.child_env("learner") == {"OMP_NUM_THREADS": "1"}
    assert up.child_env("streams") == {}


def test_a_caller_setting_or_a_large_machine_keeps_openmp_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert up.child_env("learner") == {}
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(up.os, "cpu_count", lambda: 32)
    assert up.child_env("learner") == {}
