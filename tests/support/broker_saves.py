"""When the embedded broker (noida-db) has saved what it acknowledged.

noida-db keeps its whole state in memory and saves it to one file, ``<data dir>/data/kafka.json`` (written to a
temporary file, then renamed), on a one-second tick when anything changed. A SIGKILL loses whatever was acknowledged
after the last save (``tests/integration/test_broker_transaction_restart.py`` pins it). Apache Kafka writes every
acknowledged batch to its log before answering (the page cache outlives a killed process), so tests that SIGKILL
the broker wait for a save first: what they then check is the client's behaviour, not this broker's save interval.
This is the one place that knows the file's name."""
from __future__ import annotations

import time
from pathlib import Path


def _save_identity(state_file: Path) -> tuple[int, int] | None:
    """(inode, mtime) of the saved state: each save renames a new file over the old one."""
    try:
        stat = state_file.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def wait_for_broker_save(broker_data_dir: Path, timeout_s: float = 30.0, settle_s: float = 2.5) -> None:
    """Return once everything the broker acknowledged before this call is on disk.

    The first save after the call may have taken its snapshot just before the call; a save that follows it took its
    snapshot after the call. When no second save comes within ``settle_s`` nothing changed after the first one's
    snapshot, so the first holds everything. ``broker_data_dir`` is the directory given to ``start_kafka``."""
    state_file = broker_data_dir / "data" / "kafka.json"
    before = _save_identity(state_file)
    deadline = time.monotonic() + timeout_s
    while (first := _save_identity(state_file)) == before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broker did not save its state to {state_file} within {timeout_s:.0f} s")
        time.sleep(0.02)
    settle_deadline = time.monotonic() + settle_s
    while time.monotonic() < settle_deadline:
        if _save_identity(state_file) != first:
            return
        time.sleep(0.02)
