"""The canary's sequential test: a one-sided Wald SPRT on the difference of mean online rewards.

The canary's rewards ``x`` and the serving version's rewards ``y`` (user feedback on production trajectories of
each version) are read as they arrive. With ``d = mean(x) - mean(y)`` and ``v = s^2 (1/n_x + 1/n_y)`` (``s^2`` the
pooled sample variance, at least ``min_variance``), ``d`` is approximately normal with mean ``theta`` (the true
difference) and variance ``v``. The test weighs

* H0: ``theta = 0`` (the canary is as good), against
* H1: ``theta = -delta`` (the canary is worse by ``delta``, the smallest harm worth a rollback)

by the log-likelihood ratio of ``d``::

    llr = log N(d; -delta, v) - log N(d; 0, v) = -delta * (d + delta / 2) / v

and Wald's bounds ``A = log((1 - beta) / alpha)`` and ``B = log(beta / (1 - alpha))``: ``llr >= A`` rolls back,
``llr <= B`` finishes the promotion, anything between waits for more feedback. ``alpha`` bounds the false-alarm rate
(rolling back a canary that is as good) and ``beta`` the rate of keeping a canary worse by ``delta``; Wald's bounds
keep both at most about ``alpha / (1 - beta)`` and ``beta / (1 - alpha)``. No decision is taken before each arm has
``min_samples`` rewards (the variance estimate needs them). At ``max_samples`` per arm without a decision the test is
``undecided``: the gate never promotes on that (the canary is rejected, or held for an operator: ``gate.canary_undecided``),
whichever way the llr leans; so is a canary still waiting at ``gate.canary_max_s``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class SequentialOutcome(str, Enum):
    """What the test says after the rewards seen so far."""

    wait = "wait"
    finish = "finish"  # as good: finish the promotion
    rollback = "rollback"  # worse by delta: roll back
    undecided = "undecided"  # max_samples per arm and still between the bounds: never a promotion


@dataclass(frozen=True)
class SprtSettings:
    """``alpha``: false-alarm rate (rollback of an as-good canary); ``beta``: rate of missing a harm of ``delta``;
    ``delta``: the smallest drop of the mean reward worth a rollback."""

    alpha: float = 0.05
    beta: float = 0.2
    delta: float = 0.1
    min_samples: int = 20
    max_samples: int = 2000
    min_variance: float = 1e-4

    def __post_init__(self) -> None:
        if not (0 < self.alpha < 1 and 0 < self.beta < 1 and self.alpha + self.beta < 1):
            raise ValueError(f"alpha {self.alpha} and beta {self.beta} must lie in (0, 1) with alpha + beta < 1")
        if self.delta <= 0:
            raise ValueError(f"delta {self.delta} must be above 0")

    @property
    def upper(self) -> float:
        """Wald's rollback bound A = log((1 - beta) / alpha)."""
        return math.log((1 - self.beta) / self.alpha)

    @property
    def lower(self) -> float:
        """Wald's finish bound B = log(beta / (1 - alpha))."""
        return math.log(self.beta / (1 - self.alpha))


@dataclass
class RewardStats:
    """Running count, mean and sum of squared deviations of one arm's rewards (Welford)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, reward: float) -> None:
        self.count += 1
        delta = reward - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (reward - self.mean)

    def remove(self, reward: float) -> None:
        """Take back one reward added before (a corrected piece of feedback)."""
        if self.count <= 1:
            self.count, self.mean, self.m2 = 0, 0.0, 0.0
            return
        old_mean = (self.mean * self.count - reward) / (self.count - 1)
        self.m2 = max(0.0, self.m2 - (reward - old_mean) * (reward - self.mean))
        self.count -= 1
        self.mean = old_mean


@dataclass(frozen=True)
class SequentialState:
    """The test's figures after the rewards seen so far."""

    outcome: SequentialOutcome
    llr: float
    difference: float
    variance: float
    canary_n: int
    serving_n: int

    def figures(self) -> dict[str, float]:
        return {"llr": self.llr, "difference": self.difference, "variance": self.variance,
                "canary_n": float(self.canary_n), "serving_n": float(self.serving_n)}


def log_likelihood_ratio(difference: float, variance: float, delta: float) -> float:
    """``-delta * (difference + delta / 2) / variance``: log N(d; -delta, v) - log N(d; 0, v)."""
    return -delta * (difference + delta / 2) / variance


def pooled_variance(canary: RewardStats, serving: RewardStats) -> float:
    """The pooled sample variance of the two arms."""
    dof = canary.count + serving.count - 2
    return (canary.m2 + serving.m2) / dof if dof > 0 else 0.0


def sprt(canary: RewardStats, serving: RewardStats, settings: SprtSettings) -> SequentialState:
    """The test after ``canary``'s and ``serving``'s rewards (see the module docstring)."""
    n_c, n_s = canary.count, serving.count
    if min(n_c, n_s) < max(2, settings.min_samples):
        return SequentialState(SequentialOutcome.wait, 0.0, canary.mean - serving.mean, math.inf, n_c, n_s)
    variance = max(pooled_variance(canary, serving), settings.min_variance) * (1 / n_c + 1 / n_s)
    difference = canary.mean - serving.mean
    llr = log_likelihood_ratio(difference, variance, settings.delta)
    if llr >= settings.upper:
        outcome = SequentialOutcome.rollback
    elif llr <= settings.lower:
        outcome = SequentialOutcome.finish
    elif min(n_c, n_s) >= settings.max_samples:
        outcome = SequentialOutcome.undecided
    else:
        outcome = SequentialOutcome.wait
    return SequentialState(outcome, llr, difference, variance, n_c, n_s)
