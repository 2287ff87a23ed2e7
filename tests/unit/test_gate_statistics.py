"""The gate's paired non-inferiority test and sample size (rlstream/gate/statistics.py), against hand-computed values
and by simulation; the evaluation plan the sample size gives (rlstream/gate/service.py)."""
from __future__ import annotations

import math
import random

import pytest

from rlstream.gate.service import evaluation_plan
from rlstream.gate.statistics import (mean_and_std, non_inferiority, paired_differences, sample_size, t_cdf,
                                      t_quantile)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("p, dof, table", [
    (0.95, 1, 6.3138), (0.95, 3, 2.3534), (0.95, 10, 1.8125), (0.975, 30, 2.0423), (0.975, 120, 1.9799),
    (0.8, 5, 0.9195), (0.05, 10, -1.8125)])
def test_t_quantiles_match_the_table(p: float, dof: int, table: float) -> None:
    assert t_quantile(p, dof) == pytest.approx(table, abs=1e-4)


def test_t_cdf_matches_closed_forms() -> None:
    # dof 1 is Cauchy: 1/2 + atan(t)/pi; dof 2: 1/2 + t / (2 sqrt(2 + t^2))
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_paired_differences_pair_by_key_and_orient() -> None:
    candidate = [("a", 1.0), ("b", 0.0), ("c", 0.5), ("only-candidate", 9.0)]
    reference = [("b", 0.5), ("a", 0.5), ("c", 0.5), ("only-reference", -9.0)]
    assert paired_differences(candidate, reference) == [0.5, -0.5, 0.0]
    assert paired_differences(candidate, reference, higher_is_better=False) == [-0.5, 0.5, -0.0]


def test_the_test_by_hand() -> None:
    # d = (0.1, -0.1, 0.0, 0.2): mean 0.05, s = sqrt(0.05 / 3) = 0.129099, se = 0.064550, t_{0.95,3} = 2.353363
    diffs = [0.1, -0.1, 0.0, 0.2]
    mean, std = mean_and_std(diffs)
    assert (mean, std) == (pytest.approx(0.05), pytest.approx(math.sqrt(0.05 / 3)))
    test = non_inferiority(diffs, margin=0.1, alpha=0.05)
    se = math.sqrt(0.05 / 3) / 2
    assert test.statistic == pytest.approx(0.15 / se)  # 2.3238
    assert test.lower_bound == pytest.approx(0.05 - 2.353363 * se, abs=1e-6)  # -0.10191
    assert test.p_value == pytest.approx(0.05136, abs=1e-4)  # just above alpha: agrees with the bound
    assert not test.passed
    wider = non_inferiority(diffs, margin=0.11, alpha=0.05)
    assert wider.passed and wider.p_value < 0.05


def test_degenerate_samples() -> None:
    assert non_inferiority([0.0, 0.0, 0.0], 0.1, 0.05).passed  # identical answers: the bound is the mean
    assert not non_inferiority([-0.2, -0.2, -0.2], 0.1, 0.05).passed
    assert not non_inferiority([0.5], 0.1, 0.05).passed  # one pair cannot be tested
    assert not non_inferiority([], 0.1, 0.05).passed
    assert non_inferiority([0.3, 0.2, 0.4], 0.1, 0.05).superior
    assert not non_inferiority([0.0, 0.01, -0.01], 0.1, 0.05).superior


def test_sample_size_by_hand() -> None:
    # normal approximation ((z_0.975 + z_0.95) * 0.5 / 0.1)^2 = 324.7; t quantiles add a few
    n = sample_size(0.5, 0.1, 0.025, 0.95)
    assert 325 <= n <= 335

    def needed(k: int) -> float:
        return ((t_quantile(0.975, k - 1) + t_quantile(0.95, k - 1)) * 0.5 / 0.1) ** 2

    assert n >= needed(n) and n - 1 < needed(n - 1)  # the smallest that suffices
    assert sample_size(0.5, 0.05, 0.025, 0.95) > 3.9 * n  # half the margin: four times the samples
    assert sample_size(0.0, 0.1, 0.05, 0.9) == 2


def test_the_sample_size_gives_the_power_and_the_level_by_simulation() -> None:
    """Normal paired differences with std 0.5: at the sample size for power 0.9, an equal candidate passes about
    90 % of the time and one worse by the margin about alpha of the time (800 runs each, seed 7)."""
    rng = random.Random(7)
    std, margin, alpha, power = 0.5, 0.1, 0.05, 0.9
    n = sample_size(std, margin, alpha, power)
    runs = 800

    def passes(true_difference: float) -> float:
        return sum(non_inferiority([rng.gauss(true_difference, std) for _ in range(n)], margin, alpha).passed
                   for _ in range(runs)) / runs

    assert 0.86 <= passes(0.0) <= 0.94
    assert passes(-margin) <= alpha + 0.025


def test_the_evaluation_plan_uses_examples_first_and_all_of_a_small_set() -> None:
    plan = evaluation_plan(needed=100, available_examples=24, max_samples=16)
    assert (plan.examples, plan.samples) == (24, 5) and plan.pairs >= 100
    small = evaluation_plan(needed=1000, available_examples=24, max_samples=16)
    assert (small.examples, small.samples, small.pairs) == (24, 16, 384)  # too small: everything
    few = evaluation_plan(needed=10, available_examples=24, max_samples=16)
    assert (few.examples, few.samples) == (10, 1)
