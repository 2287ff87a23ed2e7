"""Reading back what ``learner.report_to`` wrote: a W&B offline run's history and an MLflow run's metrics."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

# Imported at collection, in the main thread, before any test starts a thread: pydantic parses class sources with
# `ast` while wandb loads, and CPython 3.11 (before 3.11.8) keeps the AST constructor's recursion counter per
# interpreter, not per thread, so a parse in another thread at the same moment fails the import (cpython gh-106905)
# and leaves wandb half-imported for every later test of the worker.
import wandb

#: a W&B transaction log: a 7-byte header (":W&B", magic, version), then LevelDB-log records in 32 KiB blocks:
#: crc32 (4 bytes), length (2, little-endian), kind (1: full, 2: first, 3: middle, 4: last), payload
_WANDB_HEADER, _BLOCK, _RECORD_HEADER = 7, 32768, 7


def offline_tracking_env(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """W&B offline under ``root/wandb``; MLflow's local file store under ``root/mlruns``."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(root))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "rlstream-tests")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (root / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this opt-in
    wandb.teardown()  # W&B reads its settings (WANDB_DIR) once per process: the next run reads these


def wandb_history(root: Path, timeout_s: float = 30.0) -> tuple[dict[str, str], dict[int, dict[str, float]]]:
    """(the run's name and project, ``{step: {metric: value}}``) of the one offline run under ``root``, once its
    file holds the run's exit record (W&B's service process writes the file after ``finish()`` returns)."""
    from wandb.proto import wandb_internal_pb2

    files = list(root.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    deadline = time.monotonic() + timeout_s
    while True:
        records = [wandb_internal_pb2.Record.FromString(payload) for payload in _wandb_payloads(files[0])]
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            break
        assert time.monotonic() < deadline, f"no exit record in {files[0]} after {timeout_s} s"
        time.sleep(0.2)
    run: dict[str, str] = {}
    history: dict[int, dict[str, float]] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"name": record.run.display_name, "project": record.run.project}
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[int(items.pop("_step"))] = {k: float(v) for k, v in items.items() if not k.startswith("_")}
    return run, history


def _wandb_payloads(path: Path) -> list[bytes]:
    """The complete records of a W&B transaction log (a record still being written is left out)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    payloads, pending, pos = [], b"", _WANDB_HEADER
    while pos + _RECORD_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _RECORD_HEADER])
        pending += data[pos + _RECORD_HEADER:pos + _RECORD_HEADER + length]
        pos += _RECORD_HEADER + length
        if pos > len(data):  # cut short: the writer is not done with it
            break
        if kind in (1, 4):
            payloads.append(pending)
            pending = b""
    return payloads


def mlflow_history(root: Path) -> tuple[dict[str, str], dict[int, dict[str, float]]]:
    """(the run's name and params, ``{step: {metric: value}}``) of the one MLflow run under ``root/mlruns``,
    read with MLflow's client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(root / "mlruns").as_uri())
    runs = [run for experiment in client.search_experiments()
            for run in client.search_runs([experiment.experiment_id])]
    assert len(runs) == 1, runs
    run = runs[0]
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            history.setdefault(metric.step, {})[key] = metric.value
    return {"name": run.info.run_name, "status": run.info.status, **run.data.params}, history
