"""One learner step with four ordinary groups and one single response scored against an equal-reward keyed
baseline (two thumbs-up, then a thumbs-down): the single's advantage is -sqrt(3), so the step's loss and gradient
stay those of an ordinary step. Negative control: the advantage that divided by the window's own std, -10,000, makes
the single dominate the step (loss and gradient norm before clipping two to three orders of magnitude larger)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstream.learner import step as learner_step
from rlstream.learner.batch import Sample
from rlstream.learner.policy import load_policy
from rlstream.learner.step import GRPOTrainerStep, StepStats
from rlstream.schemas.config import LearnerConfig, LoraConfig
from rlstream.schemas.models import GroupBaseline
from tests.support.learner_helpers import random_samples, tiny_model

EQUAL_WINDOW = GroupBaseline(key="p|thumbs", method="window", mean=1.0, std=0.0, count=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("keyed"))


def one_step(model_dir: Path, with_single: bool, single_cap: float = 2.4749) -> tuple[StepStats, list[Sample]]:
    torch.manual_seed(0)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), device="cpu", micro_batch_size=4,
                        single_advantage_cap=single_cap)
    samples = random_samples(groups=4, per_group=4, seed=3)
    if with_single:
        single = random_samples(groups=1, per_group=1, seed=9)[0]
        single.reward, single.group, single.baseline = 0.0, 4, EQUAL_WINDOW
        samples.append(single)
    return GRPOTrainerStep(load_policy(cfg), cfg).step(samples), samples


def test_a_single_against_an_equal_reward_window_does_not_dominate_the_step(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ordinary, _ = one_step(model_dir, with_single=False)
    bounded, samples = one_step(model_dir, with_single=True)
    assert samples[-1].advantage == pytest.approx(-(3 ** 0.5), rel=1e-3)
    assert max(abs(s.advantage) for s in samples) <= 2.0  # within the groups' own range (|A| <= 1.5 for 4)
    assert bounded.grad_norm < 3 * ordinary.grad_norm and abs(bounded.loss) < 3 * abs(ordinary.loss) + 1.0

    def divide_by_the_window_std(reward: float, mean: float, std: float, count: int, *_: object) -> float:
        return (reward - mean) / (std + 1e-4) if count >= 2 else 0.0

    monkeypatch.setattr(learner_step, "baseline_advantage", divide_by_the_window_std)
    unbounded, samples = one_step(model_dir, with_single=True, single_cap=1e9)
    assert samples[-1].advantage == pytest.approx(-10_000)
    assert unbounded.grad_norm > 100 * ordinary.grad_norm
