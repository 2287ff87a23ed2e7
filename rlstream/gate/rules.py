"""The promotion rule: paired non-inferiority tests of a candidate against the serving version and the anchor.

Every version is evaluated on the same held-out prompts and seeds, so per-sample results pair by key
(:class:`SampleResult`). A candidate is promoted when it passes every one-sided paired non-inferiority test of
statistics.py (H0: worse by the margin or more; rejected when the ``1 - alpha`` lower confidence bound of the mean
paired difference is above ``-margin``):

* against the serving version (measured fresh for this decision): mean reward (margin ``gate.margin``), and the
  guards: share of answers that parse (``gate.parse_margin``), share of tool calls whose arguments parse
  (``gate.tool_call_margin``; a sample without tool calls counts 1), share of refusals, lower is better
  (``gate.refusal_margin``), task success where both versions' results carry it (``gate.success_margin``), and
  answer length: the mean paired difference of ``log(1 + tokens)`` within
  ``log(1 + gate.length_tolerance)`` either way (two one-sided tests);
* against the anchor, the best version ever promoted, re-measured fresh: mean reward (``gate.margin``). Each
  candidate of a chain may lose less than the margin against the version before it, but not more than the margin
  against the anchor in all, so serving cannot be ratcheted down by small losses.

The anchor moves to a promoted candidate only when it is shown better than the anchor (the lower bound of the
reward difference above 0, :func:`next_anchor`). Without a serving figure (nothing promoted yet and the base weights
not evaluable) the candidate needs ``reward >= gate.min_reward``. A rejection names every test that failed, with its
figures; :meth:`Verdict.evidence` is what a PromotionDecision records.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable

from rlstream.gate.statistics import PairedTest, non_inferiority, paired_differences
from rlstream.schemas.models import Message


@dataclass(frozen=True)
class SampleAnswer:
    """What one held-out episode said, as the gate publishes it (``gate.publish_answers``): the conversation (the
    prompt, the answer, its tool calls and their results), the reward function's components and the sampling seed."""

    messages: tuple[Message, ...]
    components: dict[str, float] = field(default_factory=dict)
    seed: int | None = None


#: the reward component that reports task success (the gate tests it like the reward, where every result has it)
SUCCESS_COMPONENT = "success"


@dataclass(frozen=True)
class SampleResult:
    """One held-out (example, sample) episode of one version: the unit the paired tests compare.

    ``key`` is ``"{example_id}#{sample}"``; the candidate and serving versions are run with the same key, prompt and
    seed, so two versions' results pair by key.
    """

    key: str
    reward: float
    parses: bool
    refusal: bool
    length: int
    tool_calls: int = 0
    tool_calls_parsed: int = 0
    success: float | None = None  # task success (the reward function's ``success`` component), when it has one
    answer: SampleAnswer | None = field(default=None, compare=False)  # the episode's transcript (not a figure)


@dataclass(frozen=True)
class EvalFigures:
    """One version's figures on the held-out set (``samples`` completions)."""

    version: int
    reward_mean: float
    answer_parse_rate: float
    tool_call_parse_rate: float
    refusal_rate: float
    answer_length: float
    samples: int
    tool_calls: int = 0
    seconds: float = 0.0
    task_success: float | None = None  # mean task success, where every result carries one
    results: tuple[SampleResult, ...] = ()

    def metrics(self) -> dict[str, float]:
        """The figures as a PromotionDecision carries them (the per-sample results are not figures; a figure the
        task does not report is left out)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)
                if f.name != "results" and getattr(self, f.name) is not None}


@dataclass(frozen=True)
class DecisionRule:
    """The tests' settings (``gate.*``; see the module docstring)."""

    margin: float = 0.1
    alpha: float = 0.05
    parse_margin: float = 0.1
    tool_call_margin: float = 0.1
    refusal_margin: float = 0.05
    success_margin: float = 0.1
    length_tolerance: float = 3.0
    min_reward: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """``promote``, the reasons it may not be, and every test behind the decision."""

    promote: bool
    failures: list[str] = field(default_factory=list)
    tests: tuple[PairedTest, ...] = ()

    @property
    def reason(self) -> str:
        if self.failures:
            return "; ".join(self.failures)
        passed = [t for t in self.tests if t.figure == "reward"]
        if not passed:
            return "no version to compare with; reward at or above gate.min_reward"
        return "non-inferior to " + ", ".join(
            f"{t.reference} v{t.reference_version} (reward {t.mean_difference:+.3f}, lower bound {t.lower_bound:.3f} "
            f"> -{t.margin:g} at alpha {t.alpha:g}, n {t.n})" for t in passed)

    def test(self, figure: str, reference: str) -> PairedTest | None:
        """The test of ``figure`` against ``reference`` (``serving`` or ``anchor``), if it ran."""
        return next((t for t in self.tests if t.figure == figure and t.reference == reference), None)

    def evidence(self) -> dict[str, float]:
        """Every test's figures (``test.<reference>.<figure>.<name>``) for a PromotionDecision's metrics map."""
        out: dict[str, float] = {}
        for t in self.tests:
            out.update(t.evidence())
        return out


@dataclass(frozen=True)
class _Figure:
    name: str
    value: Callable[[SampleResult], float]
    higher_is_better: bool


def _tool_call_share(r: SampleResult) -> float:
    return r.tool_calls_parsed / r.tool_calls if r.tool_calls else 1.0


def _log_length(r: SampleResult) -> float:
    return math.log1p(max(0, r.length))


REWARD = _Figure("reward", lambda r: r.reward, True)
GUARDS = (
    (_Figure("answers_parse", lambda r: float(r.parses), True), "parse_margin"),
    (_Figure("tool_calls_parse", _tool_call_share, True), "tool_call_margin"),
    (_Figure("refusals", lambda r: float(r.refusal), False), "refusal_margin"),
)
LENGTHS = (_Figure("length_not_longer", _log_length, False), _Figure("length_not_shorter", _log_length, True))
SUCCESS = _Figure("task_success", lambda r: float(r.success or 0.0), True)


def _has_success(figures: EvalFigures) -> bool:
    return bool(figures.results) and all(r.success is not None for r in figures.results)


def paired_test(figure: _Figure, candidate: EvalFigures, reference: EvalFigures, reference_role: str,
                margin: float, alpha: float) -> PairedTest:
    """One figure's paired non-inferiority test of ``candidate`` against ``reference`` on their shared keys."""
    diffs = paired_differences(((r.key, figure.value(r)) for r in candidate.results),
                               ((r.key, figure.value(r)) for r in reference.results), figure.higher_is_better)
    return non_inferiority(diffs, margin, alpha, figure=figure.name, reference=reference_role,
                           reference_version=reference.version)


def _failure(t: PairedTest) -> str:
    if t.n < 2:
        return f"{t.figure} vs {t.reference} v{t.reference_version}: {t.n} paired samples, too few to test"
    return (f"{t.figure} vs {t.reference} v{t.reference_version}: mean difference {t.mean_difference:+.3f} "
            f"(std {t.std:.3f}, n {t.n}), lower bound {t.lower_bound:.3f} <= -{t.margin:.3g} "
            f"(t {t.statistic:.2f}, p {t.p_value:.3f} >= alpha {t.alpha:g})")


def judge(candidate: EvalFigures, serving: EvalFigures | None, rule: DecisionRule,
          anchor: EvalFigures | None = None) -> Verdict:
    """Whether ``candidate`` may replace ``serving`` (None: no serving figure to compare with), also tested against
    ``anchor`` (the best version ever promoted, measured for this decision) when it is another version."""
    if candidate.samples == 0:
        return Verdict(False, ["no held-out completion could be scored"])
    if serving is None:
        if candidate.reward_mean < rule.min_reward:
            return Verdict(False, [f"reward {candidate.reward_mean:.3f} below gate.min_reward {rule.min_reward:.3f} "
                                   "(no serving version to compare with)"])
        return Verdict(True)
    tests = [paired_test(REWARD, candidate, serving, "serving", rule.margin, rule.alpha)]
    tests += [paired_test(f, candidate, serving, "serving", getattr(rule, margin), rule.alpha) for f, margin in GUARDS]
    if serving.answer_length > 0:
        tests += [paired_test(f, candidate, serving, "serving", math.log1p(rule.length_tolerance), rule.alpha)
                  for f in LENGTHS]
    if _has_success(candidate) and _has_success(serving):
        tests.append(paired_test(SUCCESS, candidate, serving, "serving", rule.success_margin, rule.alpha))
    if anchor is not None and anchor.version != serving.version:
        tests.append(paired_test(REWARD, candidate, anchor, "anchor", rule.margin, rule.alpha))
    failures = [_failure(t) for t in tests if not t.passed]
    return Verdict(not failures, failures, tuple(tests))


def next_anchor(verdict: Verdict, candidate: int, anchor: int | None) -> int | None:
    """The anchor after ``verdict`` about ``candidate``: the candidate when it is promoted and shown better than the
    anchor (the reward test's lower bound above 0; against serving when the anchor serves), else ``anchor``."""
    if not verdict.promote:
        return anchor
    test = verdict.test("reward", "anchor") or verdict.test("reward", "serving")
    if anchor is None or test is None or test.superior:
        return candidate
    return anchor
