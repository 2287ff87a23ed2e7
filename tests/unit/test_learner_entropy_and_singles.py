"""The learner's entropy figure, the bound on single-response advantages and advantage statistics that include
single responses."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlstream.learner.grpo import baseline_advantage, token_entropy
from rlstream.learner.policy import load_policy
from rlstream.learner.step import GRPOTrainerStep, assign_advantages
from rlstream.schemas.config import LearnerConfig, LoraConfig
from rlstream.schemas.models import GroupBaseline
from tests.support.learner_helpers import random_samples, tiny_model

#: The largest |A| a member of a group of 8 gets: one differing reward among eight, (G - 1) / sqrt(G).
GROUP_OF_8_MAX = 7 / math.sqrt(8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("entropy"))


def test_token_entropy_equals_the_dense_formula_per_row_temperature_and_chunk() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0])
    dense = torch.log_softmax(logits / temperature.view(-1, 1, 1), -1)
    expected = -(dense.exp() * dense).sum(-1)
    for chunk in (1, 4, 1024):
        assert torch.allclose(token_entropy(logits, temperature, chunk), expected, atol=1e-5)
    uniform = token_entropy(torch.zeros(1, 2, 11))
    assert torch.allclose(uniform, torch.full((1, 2), math.log(11)), atol=1e-6)  # hand-computed: log V


def test_a_single_after_a_long_run_of_successes_weighs_no_more_than_a_group_member() -> None:
    window = GroupBaseline(key="p|t", method="window", mean=1.0, std=0.0, count=64)
    raw = baseline_advantage(0.0, window.mean, window.std, window.count, "group")
    assert raw == pytest.approx(-math.sqrt(65), rel=1e-3)  # the unbounded figure: 8.06
    samples = random_samples(groups=1, per_group=1, seed=1)
    samples[0].reward, samples[0].baseline = 0.0, window
    assign_advantages(samples, "group", 2, single_cap=GROUP_OF_8_MAX)
    assert samples[0].advantage == pytest.approx(-GROUP_OF_8_MAX)
    assign_advantages(samples, "group", 2, single_cap=None)  # control: without the bound
    assert samples[0].advantage == pytest.approx(raw)
    assign_advantages(samples, "none", 2, single_cap=GROUP_OF_8_MAX)  # unscaled: r - mean, already in reward units
    assert samples[0].advantage == pytest.approx(-1.0)


def test_a_step_reports_entropy_and_advantage_figures_of_single_responses(model_dir: Path) -> None:
    torch.manual_seed(0)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), device="cpu", micro_batch_size=4)
    singles = random_samples(groups=4, per_group=1, seed=5)
    for i, single in enumerate(singles):  # production traffic only: no group of its own
        single.group, single.reward = i, float(i % 2)
        single.baseline = GroupBaseline(key="p|t", method="window", mean=0.5, std=0.5, count=10)
    stats = GRPOTrainerStep(load_policy(cfg), cfg).step(singles)
    expected = [baseline_advantage(s.reward, 0.5, 0.5, 10, "group") for s in singles]
    assert stats.advantage_std == pytest.approx(float(torch.tensor(expected, dtype=torch.float64).std()), rel=1e-6)
    assert stats.advantage_std > 0.5  # the group statistics of four one-member groups would say 0
    vocab = load_policy(cfg).vocab_size or 2
    assert 0.0 < stats.entropy <= math.log(vocab) + 1e-4
    assert stats.figures()["entropy"] == stats.entropy


@pytest.mark.parametrize("temperature", [1e-38, 1e-39])
def test_one_poisoned_row_is_dropped_and_the_step_still_applies(model_dir: Path, temperature: float) -> None:
    """A turn recorded at a near-zero temperature (no behaviour logprobs) makes the gradient non-finite: the row is
    found, dropped and counted, and the step applies on the other seven (every one of its optimizer steps)."""
    def run(samples: list) -> object:
        torch.manual_seed(0)
        cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), device="cpu", micro_batch_size=16)
        return GRPOTrainerStep(load_policy(cfg), cfg).step(samples)

    def poisoned() -> list:
        samples = random_samples(groups=2, per_group=4, seed=3)
        samples[0].temperature, samples[0].behaviour_logprobs = temperature, None
        return samples

    stats = run(poisoned())
    assert stats.optimizer_steps == 3 and stats.nonfinite_skipped == 0  # the default's 3, the row left out of each
    assert stats.rows_dropped_nonfinite == 1 and math.isfinite(stats.grad_norm)
    assert stats.figures()["rows_dropped_nonfinite"] == 1.0

    # control: the same row, without the per-row guard, costs the whole step
    import rlstream.learner.step as step_module

    original = step_module.GRPOTrainerStep.nonfinite_rows
    step_module.GRPOTrainerStep.nonfinite_rows = lambda self, samples: []  # type: ignore[method-assign]
    try:
        unguarded = run(poisoned())
    finally:
        step_module.GRPOTrainerStep.nonfinite_rows = original  # type: ignore[method-assign]
    assert unguarded.optimizer_steps == 0 and unguarded.nonfinite_skipped == 1
    assert not math.isfinite(unguarded.grad_norm)


def test_rows_without_logprobs_are_counted_and_beyond_the_lag_not_trained(model_dir: Path) -> None:
    """Two groups of four; group 1 has no behaviour logprobs and was sampled 3 versions before the learner's 5.
    Within learner.max_lag_without_logprobs (1) nothing would be marked; at lag 3 its rows count in the group
    statistics (same advantages) but are not trained."""
    from rlstream.learner.batch import mark_stale_rows_without_logprobs

    def batch() -> list:
        samples = random_samples(groups=2, per_group=4, seed=11)
        for s in samples:
            s.policy_version = 4
            if s.group == 1:
                s.behaviour_logprobs, s.policy_version = None, 2
        return samples

    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), device="cpu", micro_batch_size=16)
    samples = batch()
    assert mark_stale_rows_without_logprobs(samples, version=3, max_lag=1) == 0  # control: lag 1, all train
    assert mark_stale_rows_without_logprobs(samples, version=5, max_lag=None) == 0  # no bound
    assert mark_stale_rows_without_logprobs(samples, version=5, max_lag=1) == 4
    torch.manual_seed(0)
    stats = GRPOTrainerStep(load_policy(cfg), cfg).step(samples)
    assert stats.rows_without_logprobs == 4 and stats.rows_without_logprobs_dropped == 4
    assert stats.sequences == 4 and stats.trained
    reference = batch()
    assign_advantages(reference, "group")
    assert [s.advantage for s in samples] == pytest.approx([s.advantage for s in reference])
    torch.manual_seed(0)
    everything = GRPOTrainerStep(load_policy(cfg), cfg).step(batch())  # control: unmarked, all eight train
    assert everything.sequences == 8 and everything.rows_without_logprobs == 4
    assert everything.rows_without_logprobs_dropped == 0
    all_marked = batch()
    for s in all_marked:
        s.trainable = False
    untrained = GRPOTrainerStep(load_policy(cfg), cfg).step(all_marked)
    assert not untrained.trained and untrained.rows_without_logprobs_dropped == 8


def test_entropy_is_measured_on_a_strided_sample_of_positions(model_dir: Path) -> None:
    def entropy(positions: int) -> float:
        torch.manual_seed(0)
        cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), device="cpu", micro_batch_size=16,
                            entropy_positions=positions)
        return GRPOTrainerStep(load_policy(cfg), cfg).step(random_samples(groups=2, per_group=4, seed=2)).entropy

    every, sampled, off = entropy(10_000), entropy(8), entropy(0)
    assert every > 0 and off == 0.0
    assert sampled > 0 and sampled != every and abs(sampled - every) < 0.5 * every  # an estimate of the same mean
