"""Two callers of ``ensure_vllm_venv`` on a fresh machine (two test workers, two ``rlstream up``): one installs, the
other waits for it and then uses its virtualenv instead of installing into the same directory at the same time."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from filelock import FileLock

from rlstream.ops import vllm


def test_a_second_caller_waits_for_the_install_and_reuses_it(tmp_path: Path, monkeypatch: object) -> None:
    venv = tmp_path / "venv-vllm"
    installs: list[Path] = []

    def no_install(venv_dir: Path, python: Path, log_file: object, timeout_s: float) -> Path:
        installs.append(venv_dir)  # would be minutes of pip: must not happen while the first install holds the lock
        return python

    monkeypatch.setattr(vllm, "_install_vllm_venv", no_install)  # type: ignore[attr-defined]
    first = FileLock(str(vllm.install_lock_path(venv)))
    first.acquire()  # the first installer is at work
    result: list[Path] = []
    waiter = threading.Thread(target=lambda: result.append(vllm.ensure_vllm_venv(venv)))
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and not result, "the second caller did not wait for the install under way"
    # the first install finishes: its python and its ready marker are there
    python = vllm.venv_python(venv)
    python.parent.mkdir(parents=True)
    python.write_text("")
    (venv / vllm.READY_MARKER).write_text(vllm._requirements_text())
    first.release()
    waiter.join(10)
    assert result == [python] and installs == []  # it used the finished venv, it installed nothing


def test_without_a_finished_install_the_caller_installs_under_the_lock(tmp_path: Path, monkeypatch: object) -> None:
    """The control: nobody else installs, so the caller does (holding the lock while it does)."""
    venv = tmp_path / "venv-vllm"
    held: list[bool] = []

    def install(venv_dir: Path, python: Path, log_file: object, timeout_s: float) -> Path:
        other = FileLock(str(vllm.install_lock_path(venv_dir)), timeout=0.1)
        try:
            other.acquire()
            other.release()
            held.append(False)
        except Exception:
            held.append(True)
        return python

    monkeypatch.setattr(vllm, "_install_vllm_venv", install)  # type: ignore[attr-defined]
    assert vllm.ensure_vllm_venv(venv) == vllm.venv_python(venv)
    assert held == [True]
