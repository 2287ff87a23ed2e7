"""The rules that keep the serving fleet up through version churn: when an unloaded LoRA version's files may go, when
a replica counts as down, and the supervisor that restarts a dead server (on a real process)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx

from rlstream.inference.health import HealthChange, HealthTracker
from rlstream.inference.retention import RetiredFiles, deletable
from rlstream.ops.live import LiveFigures, engine_restarts_text
from rlstream.ops.ports import LOOPBACK, free_port
from rlstream.ops.processes import pid_alive, stop_pid
from rlstream.ops.vllm import EngineRestart, VllmServer, VllmSupervisor


def test_files_go_only_when_unlisted_and_the_grace_has_passed(tmp_path: Path) -> None:
    retired = [RetiredFiles(3, tmp_path / "v3", retired_at=100.0), RetiredFiles(4, tmp_path / "v4", retired_at=100.0),
               RetiredFiles(5, tmp_path / "v5", retired_at=150.0)]
    # within the grace nothing goes, listed or not
    assert deletable(retired, listed=set(), now=159.0, grace_s=60.0) == []
    # past the grace: the unlisted ones go, a version the server still lists stays
    assert [r.version for r in deletable(retired, listed={4}, now=161.0, grace_s=60.0)] == [3]
    assert [r.version for r in deletable(retired, listed=set(), now=210.0, grace_s=60.0)] == [3, 4, 5]
    # grace 0 is the immediate rule: whatever the server does not list goes at once
    assert [r.version for r in deletable(retired, listed={5}, now=150.0, grace_s=0.0)] == [3, 4]


def test_a_replica_is_down_after_failures_in_a_row_and_up_at_the_first_pass() -> None:
    tracker = HealthTracker(failures=2)
    assert [tracker.observe(ok) for ok in (False, True, False)] == [None, None, None]  # never two in a row
    assert tracker.observe(False) == HealthChange.down
    assert [tracker.observe(False) for _ in range(3)] == [None, None, None]  # counted once
    assert tracker.observe(True) == HealthChange.up
    assert tracker.observe(True) is None


def _health_server(port: int, workdir: Path) -> VllmServer:
    """A process that answers ``GET /health`` with 200 on ``port`` (vLLM's health surface), in its own group."""
    (workdir / "health").write_text("ok")
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", LOOPBACK], cwd=workdir,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://{LOOPBACK}:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return VllmServer(url=url, model="policy", model_dir="", pid=proc.pid, log_file="", port=port)
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("the health server did not start")


def test_the_supervisor_restarts_a_killed_server_on_its_port_and_without_it_the_server_stays_gone(
        tmp_path: Path) -> None:
    port = free_port()
    start = partial(_health_server, port, tmp_path)
    supervisor = VllmSupervisor("vllm", start(), start, interval_s=0.1, health_failures=2)
    first = supervisor.server
    try:
        assert supervisor.check_once() is None  # healthy: nothing happens
        os.kill(first.pid, signal.SIGKILL)
        time.sleep(0.3)
        restart = supervisor.check_once()
        assert isinstance(restart, EngineRestart) and restart.reason.startswith("process exited")
        assert restart.old_pid == first.pid and restart.new_pid == supervisor.server.pid != first.pid
        assert httpx.get(f"{supervisor.server.url}/health", timeout=2).status_code == 200  # same URL, back
        assert supervisor.restarts == [restart]

        # control: the same kill with nobody checking leaves the server gone
        second = supervisor.server
        os.kill(second.pid, signal.SIGKILL)
        time.sleep(1.0)
        assert not pid_alive(second.pid)
        try:
            httpx.get(f"{second.url}/health", timeout=1)
            raise AssertionError("the killed server still answers")
        except httpx.HTTPError:
            pass
    finally:
        stop_pid(supervisor.server.pid, timeout_s=5)


def test_a_server_that_stops_answering_health_is_stopped_and_restarted(tmp_path: Path) -> None:
    port = free_port()
    start = partial(_health_server, port, tmp_path)
    supervisor = VllmSupervisor("vllm", start(), start, interval_s=0.1, health_failures=3, health_timeout_s=0.5)
    hung = supervisor.server
    try:
        os.kill(hung.pid, signal.SIGSTOP)  # alive, but answers nothing (a wedged engine)
        assert supervisor.check_once() is None and supervisor.check_once() is None  # two failures: not yet
        restart = supervisor.check_once()
        assert restart is not None and "/health failed 3 times" in restart.reason
        assert not pid_alive(hung.pid)  # the old process group was stopped, not left behind
        assert httpx.get(f"{supervisor.server.url}/health", timeout=2).status_code == 200
    finally:
        stop_pid(supervisor.server.pid, timeout_s=5)
        if pid_alive(hung.pid):
            os.kill(hung.pid, signal.SIGKILL)


def test_the_live_view_shows_restarts_and_a_server_being_restarted() -> None:
    figures = LiveFigures()
    assert engine_restarts_text(figures) == "0"
    figures.engines_down["vllm"] = ("process exited (code -9)", time.monotonic() - 5)
    assert "vllm DOWN" in engine_restarts_text(figures) and "restarting" in engine_restarts_text(figures)
    figures.engines_down.clear()
    figures.engine_restarts.append(EngineRestart("vllm", "process exited (code -9)", time.time(), 10, 11, 61.2))
    text = engine_restarts_text(figures)
    assert text.startswith("1 ") and "back after 61s" in text
    assert figures.engine_restarts[0].summary()["down_s"] == 61.2
