"""``num_iterations`` optimizer steps per batch against the batch-start policy (the clip acts), and the
non-finite guard: a NaN/inf loss or gradient skips the optimizer step, is counted and logged, and changes nothing."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from rlstream.learner.policy import load_policy
from rlstream.learner.step import STEP_METRICS, GRPOTrainerStep, step_figures
from rlstream.schemas.config import LearnerConfig, LoraConfig
from rlstream.transport import metric_names as mn
from tests.support.learner_helpers import random_samples, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("iters"))


def _trainer(model_dir: Path, **knobs: object) -> GRPOTrainerStep:
    torch.manual_seed(0)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), device="cpu", learning_rate=2e-2,
                        micro_batch_size=4, **knobs)  # type: ignore[arg-type]
    return GRPOTrainerStep(load_policy(cfg), cfg)


def _weights(trainer: GRPOTrainerStep) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters() if p.requires_grad}


def test_num_iterations_steps_against_the_batch_start_policy_and_the_clip_acts(model_dir: Path) -> None:
    once = _trainer(model_dir, num_iterations=1).step(random_samples(seed=5))
    assert once.optimizer_steps == 1 and once.clip_fraction == 0.0  # one step per batch: ratio 1, no clipping

    trainer = _trainer(model_dir)  # the default: learner.num_iterations 3
    stats = trainer.step(random_samples(seed=5))
    assert stats.optimizer_steps == 3 and stats.nonfinite_skipped == 0 and stats.trained
    assert stats.clip_fraction > 0  # the policy moved away from the batch-start policy within the batch
    assert trainer.scheduler.last_epoch == 3  # one scheduler step per optimizer step
    figures = step_figures(stats, n_groups=2, policy_lag=[0])
    assert figures[mn.LEARNER_OPTIMIZER_STEPS] == 3 and figures[mn.LEARNER_CLIP_FRACTION] == stats.clip_fraction
    assert set(STEP_METRICS.values()) <= set(figures)


def test_a_non_finite_loss_skips_the_optimizer_step_and_is_reported(model_dir: Path) -> None:
    trainer = _trainer(model_dir, num_iterations=2)
    before = _weights(trainer)
    samples = random_samples(groups=1, seed=6)
    samples[0].reward = float("nan")  # poisons the group's advantages, so the loss of every row (none can be dropped)
    with capture_logs() as logs:
        stats = trainer.step(samples)
    assert stats.optimizer_steps == 0 and stats.nonfinite_skipped == 1 and not stats.trained
    assert any(e["event"].startswith("non-finite loss or gradient") and e["log_level"] == "warning" for e in logs)
    assert step_figures(stats, 2, [])[mn.LEARNER_NONFINITE_SKIPPED] == 1.0
    for name, value in _weights(trainer).items():
        assert torch.equal(value, before[name]), name
    assert trainer.scheduler.last_epoch == 0 and not trainer.optimizer.state  # Adam's moments untouched
    assert all(p.grad is None for p in trainer.policy.trainable_parameters())

    # the next batch trains normally
    assert trainer.step(random_samples(seed=7)).optimizer_steps == 2


def test_a_non_finite_gradient_skips_the_step(model_dir: Path) -> None:
    trainer = _trainer(model_dir)
    before = _weights(trainer)
    param = next(p for p in trainer.policy.model.parameters() if p.requires_grad)
    handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        stats = trainer.step(random_samples(seed=8))
    finally:
        handle.remove()
    assert stats.nonfinite_skipped == 1 and stats.optimizer_steps == 0
    assert all(torch.equal(v, before[n]) for n, v in _weights(trainer).items())
