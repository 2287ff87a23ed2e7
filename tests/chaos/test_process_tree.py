"""Process trees: every child of a launcher (the Supervisor of `rlstream up` / `finetune`, LocalStack, the
`infra up` supervisor) dies with its parent however the parent ends (SIGKILL, SIGTERM, a closed pipe), its
grandchildren included; `infra down` never signals a PID whose start time differs from the state file."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlstream.cli.app import app
from rlstream.ops.infra import STATE_FILE, LocalStack, ServiceProcess
from rlstream.ops.processes import boot_id, pid_alive, process_start_time, stop_pid

ROOT = Path(__file__).resolve().parents[2]

#: A launcher like `rlstream up`: the real Supervisor (and optionally LocalStack). Each child starts a grandchild
#: in its process group; the "stubborn" child ignores SIGTERM. Prints the PIDs, then writes ticks to stdout.
PARENT = r"""
import signal, sys, time
from pathlib import Path
from rlstream.ops import children, infra
from rlstream.ops.supervisor import Supervisor
children.REAPER_GRACE_S = 1.0  # the stubborn child is SIGKILLed after this
log_dir, with_stack = Path(sys.argv[1]), sys.argv[2] == "stack"
pids = []
if with_stack:
    stack = infra.LocalStack.start(log_dir / "infra")
    pids += [stack.kafka.pid, stack.redis.pid]
sup = Supervisor(log_dir)
child = ("import signal, subprocess, sys, time\n"
         "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
         "print('GRANDCHILD', g.pid, flush=True)\n"
         "time.sleep(120)\n")
for name in ("plain", "stubborn"):
    proc = sup.spawn(name, [sys.executable, "-c", child, name]).proc
    pids.append(proc.pid)
deadline = time.monotonic() + 30
for name in ("plain", "stubborn"):  # wait for the grandchildren
    log = log_dir / f"{name}.log"
    while "GRANDCHILD" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    pids.append(int(log.read_text().split("GRANDCHILD")[1].split()[0]))
print("PIDS", *pids, flush=True)
while True:  # a closed stdout ends this process with BrokenPipeError
    print("tick", flush=True)
    time.sleep(0.05)
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def _start_parent(tmp_path: Path, with_stack: bool) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), "stack" if with_stack else "-"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = ""
    while not line.startswith("PIDS"):
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the parent exited before starting its children"
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == (6 if with_stack else 4) and all(pid_alive(p) for p in pids)
    return proc, pids


@pytest.mark.parametrize("how", ["sigkill", "sigterm", "closed-pipe"])
def test_children_and_grandchildren_die_with_their_parent(tmp_path: Path, how: str) -> None:
    proc, pids = _start_parent(tmp_path, with_stack=how == "sigkill")
    try:
        if how == "closed-pipe":
            proc.stdout.close()  # type: ignore[union-attr]
        else:
            proc.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
        proc.wait(timeout=30)
        survivors = _wait_gone(pids, timeout_s=15)
    finally:
        proc.kill()
        proc.wait()
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert survivors == [], f"outlived their parent ({how}): {survivors}"


def test_stop_pid_stops_the_whole_process_group() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "g = subprocess.Popen(['sleep', '60']); print(g.pid, flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(child.stdout.readline())  # type: ignore[union-attr]
    stop_pid(child.pid, timeout_s=5)
    assert _wait_gone([child.pid, grandchild], 5) == []


def test_stop_pid_stops_the_members_a_killed_and_reaped_leader_left_behind() -> None:
    # a vLLM API server SIGKILLed (and reaped by its supervisor) leaves its engine process running in its group
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "g = subprocess.Popen(['sleep', '60']); print(g.pid, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    member = int(leader.stdout.readline())  # type: ignore[union-attr]
    leader.kill()
    leader.wait()  # reaped: its pid is free, its group lives on in the member
    try:
        assert pid_alive(member) and os.getpgid(member) == leader.pid  # control: the member outlived its leader
        stop_pid(leader.pid, timeout_s=5)
        assert _wait_gone([member], 5) == []
    finally:
        if pid_alive(member):
            os.kill(member, signal.SIGKILL)


def test_stop_pid_returns_the_exit_code_of_the_child_it_reaps() -> None:
    exits_3 = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                                "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3)); print('ready', flush=True); "
                                "time.sleep(60)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert exits_3.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    assert stop_pid(exits_3.pid, timeout_s=5) == 3
    # Popen cannot tell it any more (the status was collected by stop_pid): what `up` logged before
    assert exits_3.poll() == 0
    killed = subprocess.Popen(["sleep", "60"], start_new_session=True)
    assert stop_pid(killed.pid, timeout_s=5) == -signal.SIGTERM
    assert stop_pid(killed.pid, timeout_s=5) is None  # already gone and collected


#: SIGTERM ends the main thread alone (the raw exit system call, not exit_group); another thread exits the process
#: with 7 a moment later. Between the two the leader is a zombie whose status cannot be collected yet, as a learner's
#: or a streams worker's is while their other threads finish.
MAIN_THREAD_EXITS_FIRST = r"""
import ctypes, os, platform, signal, threading, time
SYS_EXIT = {"x86_64": 60, "aarch64": 93}[platform.machine()]
def on_term(*_):
    threading.Thread(target=lambda: (time.sleep(0.5), os._exit(7))).start()
    ctypes.CDLL(None).syscall(SYS_EXIT, 0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(60)
"""


def test_stop_pid_waits_for_the_status_of_a_process_whose_main_thread_ends_first() -> None:
    child = subprocess.Popen([sys.executable, "-c", MAIN_THREAD_EXITS_FIRST], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    # without the wait stop_pid saw a zombie (gone for pid_alive) and returned None, leaving the status uncollected
    assert stop_pid(child.pid, timeout_s=5) == 7


# --- infra down: start times -------------------------------------------------------------------------------
def _state(tmp_path: Path, pid: int, start_time: int | None, boot: str | None) -> Path:
    state_dir = tmp_path / "infra"
    stack = LocalStack(kafka=ServiceProcess("kafka", "127.0.0.1:1", pid, str(tmp_path / "kafka"), start_time=start_time,
                                            boot_id=boot),
                       redis=ServiceProcess("redis", "redis://127.0.0.1:2/0", external=True), root=str(state_dir))
    stack.save(state_dir / STATE_FILE)
    return state_dir


@pytest.mark.parametrize("identity", ["other start time", "other boot", "no start time, other command line"])
def test_infra_down_refuses_a_pid_whose_start_time_differs(tmp_path: Path, identity: str) -> None:
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        start = process_start_time(victim.pid)
        assert start is not None
        recorded = {"other start time": (start - 1, boot_id()), "other boot": (start, "another-boot"),
                    "no start time, other command line": (None, None)}[identity]
        state_dir = _state(tmp_path, victim.pid, *recorded)
        result = CliRunner().invoke(app, ["infra", "down", "--state-dir", str(state_dir)])
        assert result.exit_code == 0, result.output
        assert "not signalled" in result.output
        time.sleep(0.3)
        assert pid_alive(victim.pid) and victim.poll() is None, "a PID of another process was signalled"
        assert not (state_dir / STATE_FILE).exists()
    finally:
        victim.kill()
        victim.wait()


def test_infra_down_stops_the_pid_when_its_start_time_matches(tmp_path: Path) -> None:
    """The negative control of the refusal above: the same state file with the right start time stops it."""
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        state_dir = _state(tmp_path, victim.pid, process_start_time(victim.pid), boot_id())
        result = CliRunner().invoke(app, ["infra", "down", "--state-dir", str(state_dir)])
        assert result.exit_code == 0, result.output
        assert "kafka (pid" in result.output and "stopped" in result.output
        assert _wait_gone([victim.pid], 5) == []
    finally:
        victim.kill()
        victim.wait()


# --- the `infra up` supervisor ------------------------------------------------------------------------------
def _serve(state_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", "from rlstream.ops.infra_daemon import main; main()", "serve",
                             "--state-dir", str(state_dir)], cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)


def test_infra_services_die_when_infra_up_ends_before_the_hand_over(tmp_path: Path) -> None:
    state_dir = tmp_path / "infra"
    daemon = _serve(state_dir)
    try:
        assert daemon.stdout.readline().strip() == "READY"  # type: ignore[union-attr]
        state = json.loads((state_dir / STATE_FILE).read_text())
        pids = [state["kafka"]["pid"], state["redis"]["pid"]]
        assert all(pid_alive(p) for p in pids)
        daemon.stdin.close()  # type: ignore[union-attr]  # `infra up` ended without saying OK
        assert daemon.wait(timeout=60) == 1
        assert _wait_gone(pids, 10) == []
        assert not (state_dir / STATE_FILE).exists()
    finally:
        daemon.kill()
        daemon.wait()


def test_infra_services_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    state_dir = tmp_path / "infra"
    daemon = _serve(state_dir)
    try:
        assert daemon.stdout.readline().strip() == "READY"  # type: ignore[union-attr]
        daemon.stdin.write("OK\n")  # type: ignore[union-attr]
        daemon.stdin.flush()  # type: ignore[union-attr]
        stack = LocalStack.load(state_dir / STATE_FILE)
        assert stack.supervisor is not None and stack.supervisor.pid == daemon.pid and stack.running()
        daemon.kill()
        daemon.wait()
        assert _wait_gone([stack.kafka.pid, stack.redis.pid], 15) == []  # type: ignore[list-item]
        result = CliRunner().invoke(app, ["infra", "down", "--state-dir", str(state_dir)])
        assert result.exit_code == 0 and "not running" in result.output, result.output
    finally:
        daemon.kill()
        daemon.wait()
