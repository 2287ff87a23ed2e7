"""A launcher's auxiliary child (``rlstream console`` under ``rlstream up``) that ends never ends the run: the
supervisor logs it with its exit code and log, starts it again after a growing backoff, at most
``AUXILIARY_RESTARTS`` times, then goes on without it; control: the same child started as an essential one is named
by ``dead()`` (what makes ``rlstream up`` stop)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from rlstream.ops import supervisor as supervisor_module
from rlstream.ops.supervisor import AUXILIARY_RESTARTS, Supervisor

pytestmark = pytest.mark.unit
CRASH = [sys.executable, "-c", "import sys; print('console failed', flush=True); sys.exit(3)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def wait_ended(sup: Supervisor, name: str, timeout_s: float = 20.0) -> None:
    child = next(c for c in sup.children if c.name == name)
    deadline = time.monotonic() + timeout_s
    while child.proc.poll() is None:
        assert time.monotonic() < deadline, f"{name} did not end"
        time.sleep(0.05)


def test_an_auxiliary_child_that_ends_is_restarted_with_backoff_then_left_and_never_ends_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "AUXILIARY_BACKOFF_S", 1.0)
    sup = Supervisor(tmp_path)
    try:
        essential = sup.spawn("learner", SLEEP)
        console = sup.spawn("console", CRASH, auxiliary=True)
        started = [console.proc.pid]
        with capture_logs() as logs:
            for restart in range(AUXILIARY_RESTARTS):
                wait_ended(sup, "console")
                assert sup.dead() == []  # an auxiliary child never stops the run
                seen = console.ended_at
                assert seen is not None
                backoff = 1.0 * 2 ** restart
                assert sup.tend_auxiliary(seen + backoff - 0.1) == [console]  # waits out its backoff
                assert console.proc.pid == started[-1]
                assert sup.tend_auxiliary(seen + backoff) == []  # started again
                assert console.restarts == restart + 1 and console.proc.pid != started[-1]
                started.append(console.proc.pid)
            wait_ended(sup, "console")
            for later in range(1, 4):  # after AUXILIARY_RESTARTS, never again
                assert sup.tend_auxiliary(time.monotonic() + 1000.0 * later) == [console] and sup.dead() == []
        assert console.restarts == AUXILIARY_RESTARTS and len(set(started)) == AUXILIARY_RESTARTS + 1
        assert essential.proc.poll() is None
        stopped = [e for e in logs if e["event"].startswith("auxiliary service stopped")]
        assert len(stopped) == AUXILIARY_RESTARTS + 1  # once per ending, not once per poll
        assert all(e["exit_code"] == 3 and e["log"] == str(tmp_path / "console.log") for e in stopped)
        assert stopped[-1]["event"].endswith("without it")
        assert [e["restarts"] for e in logs if e["event"] == "auxiliary service started again"] == [1, 2, 3]
        assert (tmp_path / "console.log").read_text().count("console failed") == AUXILIARY_RESTARTS + 1
    finally:
        sup.stop_all()


def test_control_the_same_child_as_an_essential_one_is_dead_and_is_not_restarted(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    try:
        child = sup.spawn("console", CRASH)
        pid = child.proc.pid
        wait_ended(sup, "console")
        assert sup.dead() == [child]
        assert sup.tend_auxiliary(time.monotonic() + 1000.0) == [] and child.proc.pid == pid
    finally:
        sup.stop_all()
