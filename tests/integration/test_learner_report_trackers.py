"""A learner with ``learner.report_to: [wandb, mlflow]`` (W&B offline, MLflow local file store): each step's figures
reach both trackers, equal to what the learner put on the ``metrics`` topic, under the run's name, with the learner
config as the run's config / params."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlstream.learner.service import Learner
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import MetricEvent
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from tests.support.learner_helpers import produce_groups, random_group, read_whole_topic, tiny_model
from tests.support.trackers import mlflow_history, offline_tracking_env, wandb_history

STEPS = 2


def test_learner_steps_reach_wandb_and_mlflow(rl_config: RlstreamConfig, created_topics: TopicNames,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_tracking_env(monkeypatch, tmp_path / "trackers")
    cfg = rl_config.model_copy(update={"learner": rl_config.learner.model_copy(update={
        "model": str(tiny_model(tmp_path)), "device": "cpu", "groups_per_step": 1, "total_steps": STEPS,
        "publish_every": STEPS, "lease_ttl_s": 3.0, "report_to": ["wandb", "mlflow"]})})
    asyncio.run(produce_groups(cfg, [random_group(cfg.policy, cfg.run_id, i) for i in range(STEPS)]))
    state = asyncio.run(Learner(cfg, holder="tracked").run())
    assert state.step == STEPS

    # what the learner emitted on the metrics topic, per step (learner step figures only)
    emitted: dict[int, dict[str, float]] = {}
    for event in asyncio.run(read_whole_topic(cfg, created_topics.metrics, MetricEvent)):
        if event.source == "learner" and event.tags.get(mn.STEP_TAG) == mn.STEP_LEARNER and event.step is not None:
            emitted.setdefault(event.step, {})[event.name] = event.value
    assert sorted(emitted) == list(range(1, STEPS + 1)) and mn.LEARNER_LOSS in emitted[1]

    run_name = f"{cfg.run_id}-{cfg.policy}"
    wandb_run, wandb_steps = wandb_history(tmp_path / "trackers")
    mlflow_run, mlflow_steps = mlflow_history(tmp_path / "trackers")
    assert wandb_run["name"] == run_name and mlflow_run["name"] == run_name
    assert mlflow_run["status"] == "FINISHED" and mlflow_run["model"] == cfg.learner.model
    for step, figures in emitted.items():
        for name, value in figures.items():
            assert wandb_steps[step][name] == pytest.approx(value, rel=1e-6), (step, name)
            assert mlflow_steps[step][name] == pytest.approx(value, rel=1e-6), (step, name)
