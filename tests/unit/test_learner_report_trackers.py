"""``learner.report_to`` wandb and mlflow with the real packages: W&B in offline mode, MLflow on a local file
store; what was logged is read back from the run files (W&B) and through MLflow's client."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from rlstream.learner.reporting import Reporters, ReportingError
from rlstream.transport import metric_names as mn
from tests.support.trackers import mlflow_history, offline_tracking_env, wandb_history

STEPS = {1: {mn.LEARNER_LOSS: 0.5, mn.LEARNER_CLIP_FRACTION: 0.25},
         2: {mn.LEARNER_LOSS: -0.125, mn.LEARNER_CLIP_FRACTION: 0.0}}


def test_wandb_offline_run_holds_the_step_figures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    offline_tracking_env(monkeypatch, tmp_path)
    reporters = Reporters.open(["wandb"], log_dir=tmp_path / "logs", run_name="run-a-policy", config={"lr": 1e-5})
    for step, figures in STEPS.items():
        reporters.log(figures, step)
    reporters.close()
    run, history = wandb_history(tmp_path)
    assert run == {"name": "run-a-policy", "project": "rlstream-tests"}
    assert history == STEPS


def test_mlflow_file_store_run_holds_the_step_figures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    offline_tracking_env(monkeypatch, tmp_path)
    reporters = Reporters.open(["mlflow"], log_dir=tmp_path / "logs", run_name="run-a-policy",
                               config={"lr": 1e-5, "lora": {"enabled": True, "r": 8}})
    # a non-finite figure (MLflow refuses NaN/inf) is left out of that step, the others are logged
    reporters.log({**STEPS[1], mn.LEARNER_GRAD_NORM: math.nan}, 1)
    reporters.log(STEPS[2], 2)
    assert [r.name for r in reporters.reporters] == ["mlflow"]  # still there: nothing failed
    reporters.close()
    run, history = mlflow_history(tmp_path)
    assert run["name"] == "run-a-policy" and run["status"] == "FINISHED"
    assert run["lr"] == "1e-05" and run["lora"] == "{'enabled': True, 'r': 8}"
    assert history == STEPS


def test_a_tracker_run_that_cannot_start_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """MLflow 3 refuses a file store without its opt-in: the learner gets a ReportingError naming the tracker and
    the cause (no traceback from inside the tracker), and the trackers opened before it are closed."""
    import wandb

    offline_tracking_env(monkeypatch, tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    with pytest.raises(ReportingError, match=r"learner.report_to 'mlflow': the run could not be started: "
                                             r"MlflowException: .*MLFLOW_ALLOW_FILE_STORE"):
        Reporters.open(["wandb", "mlflow"], log_dir=tmp_path / "logs", run_name="run-a-policy")
    assert wandb.run is None  # the W&B run opened first was finished
