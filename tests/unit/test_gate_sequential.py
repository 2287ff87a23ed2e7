"""The canary's sequential test (rlstream/gate/sequential.py): hand-computed cases and its error rates by simulation."""
from __future__ import annotations

import math
import random

import pytest

from rlstream.gate.sequential import RewardStats, SequentialOutcome, SprtSettings, log_likelihood_ratio, sprt

pytestmark = pytest.mark.unit


def arm(zeros: int, ones: int) -> RewardStats:
    stats = RewardStats()
    for reward in [0.0] * zeros + [1.0] * ones:
        stats.add(reward)
    return stats


def test_wald_bounds_and_llr_by_hand() -> None:
    settings = SprtSettings(alpha=0.05, beta=0.2, delta=0.1)
    assert settings.upper == pytest.approx(math.log(16))  # log((1 - 0.2) / 0.05)
    assert settings.lower == pytest.approx(math.log(0.2 / 0.95))
    # d = -0.5, v = 0.02, delta 0.1: -0.1 * (-0.5 + 0.05) / 0.02 = 2.25
    assert log_likelihood_ratio(-0.5, 0.02, 0.1) == pytest.approx(2.25)


def test_worse_canary_rolls_back_by_hand() -> None:
    # canary 10/40 rewarded, serving 30/40: pooled variance (7.5 + 7.5) / 78, v = that * (1/40 + 1/40)
    state = sprt(arm(30, 10), arm(10, 30), SprtSettings(alpha=0.05, beta=0.2, delta=0.1))
    variance = 15 / 78 * (2 / 40)
    assert state.variance == pytest.approx(variance)
    assert state.llr == pytest.approx(0.1 * 0.45 / variance)  # 4.68 >= log 16
    assert state.outcome == SequentialOutcome.rollback
    # the same means on 20 per arm are not enough evidence yet: llr 2.28 < 2.77
    assert sprt(arm(15, 5), arm(5, 15), SprtSettings()).outcome == SequentialOutcome.wait


def test_as_good_canary_finishes_by_hand() -> None:
    # equal halves on 200 per arm: llr = -0.1 * 0.05 / (100 / 398 * 0.01) = -1.99 <= log(0.2 / 0.95) = -1.56
    state = sprt(arm(100, 100), arm(100, 100), SprtSettings())
    assert state.llr == pytest.approx(-0.005 / (100 / 398 * 0.01))
    assert state.outcome == SequentialOutcome.finish
    # on 40 per arm it waits (-0.39)
    assert sprt(arm(20, 20), arm(20, 20), SprtSettings()).outcome == SequentialOutcome.wait


def test_no_decision_before_min_samples_and_truncation() -> None:
    settings = SprtSettings(min_samples=20, max_samples=30)
    assert sprt(arm(19, 0), arm(0, 19), settings).outcome == SequentialOutcome.wait  # 19 < 20 per arm
    # at max_samples, between the bounds: undecided, whichever way the llr leans (never a promotion)
    leaning = sprt(arm(16, 14), arm(14, 16), settings)
    assert settings.lower < leaning.llr < settings.upper and leaning.llr > 0
    assert leaning.outcome == SequentialOutcome.undecided
    better = sprt(arm(16, 14), arm(15, 15), settings)
    assert settings.lower < better.llr < 0 and better.outcome == SequentialOutcome.undecided
    # below max_samples the same figures wait
    assert sprt(arm(16, 14), arm(14, 16), SprtSettings(min_samples=20, max_samples=31)).outcome == \
        SequentialOutcome.wait


def test_corrected_reward_is_taken_back() -> None:
    stats = arm(3, 3)
    stats.add(0.2)
    stats.remove(0.2)
    reference = arm(3, 3)
    assert stats.count == reference.count
    assert stats.mean == pytest.approx(reference.mean)
    assert stats.m2 == pytest.approx(reference.m2)


def _run(rng: random.Random, canary_p: float, serving_p: float, settings: SprtSettings) -> SequentialOutcome:
    canary, serving = RewardStats(), RewardStats()
    while True:
        canary.add(float(rng.random() < canary_p))
        serving.add(float(rng.random() < serving_p))
        outcome = sprt(canary, serving, settings).outcome
        if outcome != SequentialOutcome.wait:
            return outcome


def test_false_alarm_rate_by_simulation() -> None:
    """An as-good canary (both arms Bernoulli(0.5)) is rolled back at most about alpha / (1 - beta) of the time, and
    one worse by delta is rolled back at least 1 - beta of the time (fixed seed, 400 runs each)."""
    settings = SprtSettings(alpha=0.05, beta=0.2, delta=0.1, min_samples=20)
    rng = random.Random(1234)
    runs = 400
    false_alarms = sum(_run(rng, 0.5, 0.5, settings) == SequentialOutcome.rollback for _ in range(runs)) / runs
    caught = sum(_run(rng, 0.4, 0.5, settings) == SequentialOutcome.rollback for _ in range(runs)) / runs
    print(f"false alarms {false_alarms:.3f}, rollbacks of a canary worse by delta {caught:.3f}")
    assert false_alarms <= settings.alpha / (1 - settings.beta) + 0.02
    assert caught >= 1 - settings.beta - 0.05
