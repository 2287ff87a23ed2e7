"""The gate's statistical tests: one-sided paired non-inferiority tests on per-sample results, and sample sizes.

Two versions answer the same held-out prompts with the same seeds, so their per-sample results pair by key. For a
figure where higher is better, the paired differences are ``d_i = candidate_i - reference_i`` (for a figure where
lower is better, ``reference_i - candidate_i``). With ``n`` pairs, mean ``d``, sample standard deviation ``s`` and
standard error ``se = s / sqrt(n)``:

* H0: ``mean(d) <= -margin`` (the candidate is worse than the reference by the margin or more);
* H1: ``mean(d) > -margin`` (non-inferior);
* statistic ``t = (d + margin) / se``, Student t with ``n - 1`` degrees of freedom under the H0 boundary;
* the one-sided ``1 - alpha`` lower confidence bound ``L = d - t_{1-alpha, n-1} * se``;
* H0 is rejected (the candidate passes) when ``L > -margin``, equivalently when the p-value
  ``P(T_{n-1} >= t) < alpha``.

The t distribution is computed exactly: its CDF through the regularized incomplete beta function (Lentz's continued
fraction, Numerical Recipes 6.4), its quantiles by bisection on that CDF (no scipy).

The sample size for power ``1 - beta`` when the true difference is 0 (an equal candidate passes with probability
``1 - beta``) is the smallest ``n`` with ``n >= ((t_{1-alpha, n-1} + t_{1-beta, n-1}) * sigma / margin)^2``, ``sigma``
the standard deviation of the paired differences (a configured prior or a pilot's estimate).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Iterable, Sequence


@dataclass(frozen=True)
class PairedTest:
    """One paired non-inferiority test of a candidate against a reference version on one figure.

    ``mean_difference`` and ``lower_bound`` are oriented so that higher is better for the candidate."""

    figure: str
    reference: str  # "serving" or "anchor"
    reference_version: int
    mean_difference: float
    std: float
    n: int
    statistic: float
    p_value: float
    lower_bound: float
    margin: float
    alpha: float

    @property
    def passed(self) -> bool:
        """H0 (worse by ``margin`` or more) is rejected: the lower bound is above ``-margin``."""
        return self.n >= 2 and self.lower_bound > -self.margin

    @property
    def superior(self) -> bool:
        """The candidate is shown better than the reference at level ``alpha``: the lower bound is above 0."""
        return self.n >= 2 and self.lower_bound > 0.0

    def evidence(self) -> dict[str, float]:
        """The test's figures, keyed ``test.<reference>.<figure>.<name>`` (a PromotionDecision's metrics map)."""
        prefix = f"test.{self.reference}.{self.figure}."
        return {prefix + k: float(v) for k, v in (
            ("mean_difference", self.mean_difference), ("std", self.std), ("n", self.n),
            ("statistic", self.statistic), ("p_value", self.p_value), ("lower_bound", self.lower_bound),
            ("margin", self.margin), ("alpha", self.alpha), ("passed", self.passed),
            ("reference_version", self.reference_version))}


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes ``betacf``)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)``, the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, dof: int) -> float:
    """``P(T <= t)`` for Student's t with ``dof`` degrees of freedom: ``1 - I_{dof/(dof+t^2)}(dof/2, 1/2) / 2`` for
    ``t >= 0``, symmetric below."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_beta(dof / 2.0, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t >= 0 else tail


@lru_cache(maxsize=4096)
def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile of Student's t with ``dof`` degrees of freedom (bisection on :func:`t_cdf` to 1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level {p} is not within (0, 1)")
    if dof < 1:
        raise ValueError(f"degrees of freedom {dof} below 1")
    if p < 0.5:
        return -t_quantile(1.0 - p, dof)
    low, high = 0.0, 1.0
    while t_cdf(high, dof) < p:
        high *= 2.0
    while high - low > 1e-10:
        mid = (low + high) / 2.0
        if t_cdf(mid, dof) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


def paired_differences(candidate: Iterable[tuple[str, float]], reference: Iterable[tuple[str, float]],
                       higher_is_better: bool = True) -> list[float]:
    """``candidate - reference`` (``reference - candidate`` when lower is better) for every key both hold, in key
    order; a key only one side holds is left out."""
    ref = dict(reference)
    cand = dict(candidate)
    sign = 1.0 if higher_is_better else -1.0
    return [sign * (cand[k] - ref[k]) for k in sorted(cand.keys() & ref.keys())]


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``n - 1`` in the denominator; 0 below two values)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def non_inferiority(differences: Sequence[float], margin: float, alpha: float, *, figure: str = "reward",
                    reference: str = "serving", reference_version: int = -1) -> PairedTest:
    """The one-sided paired t test of H0 ``mean(d) <= -margin`` at level ``alpha`` (see the module docstring).

    Fewer than two pairs cannot be tested: the result does not pass. Identical differences (``std`` 0) give an exact
    bound: the mean itself."""
    n = len(differences)
    mean, std = mean_and_std(differences)
    if n < 2:
        return PairedTest(figure, reference, reference_version, mean, std, n, 0.0, 1.0, -math.inf, margin, alpha)
    se = std / math.sqrt(n)
    if se == 0.0:
        above = mean > -margin
        return PairedTest(figure, reference, reference_version, mean, 0.0, n, math.inf if above else -math.inf,
                          0.0 if above else 1.0, mean, margin, alpha)
    statistic = (mean + margin) / se
    p_value = 1.0 - t_cdf(statistic, n - 1)
    lower = mean - t_quantile(1.0 - alpha, n - 1) * se
    return PairedTest(figure, reference, reference_version, mean, std, n, statistic, p_value, lower, margin, alpha)


def sample_size(std: float, margin: float, alpha: float, power: float, max_n: int = 1_000_000) -> int:
    """Paired samples needed so that a candidate equal to its reference passes :func:`non_inferiority` with
    probability ``power``: the smallest ``n >= 2`` with ``n >= ((t_{1-alpha,n-1} + t_{power,n-1}) std / margin)^2``."""
    if margin <= 0 or std < 0 or not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"sample size needs margin > 0, std >= 0, alpha and power in (0, 1): {margin}, {std}, "
                         f"{alpha}, {power}")
    if std == 0:
        return 2

    def needed(n: int) -> float:
        return ((t_quantile(1 - alpha, n - 1) + t_quantile(power, n - 1)) * std / margin) ** 2

    # the normal-quantile size is a lower bound (t quantiles are above the normal's); needed(n) falls with n
    z = NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(power)
    n = max(2, math.ceil((z * std / margin) ** 2))
    while n < max_n and n < needed(n):
        n += 1
    return n

