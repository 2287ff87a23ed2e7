"""The promotion rule: a candidate's held-out figures against the serving version's, on the same prompts.

A candidate is promoted when it is not worse than the serving version beyond the configured tolerances
(``gate.*``), on every figure:

* mean reward: ``candidate >= serving - reward_tolerance``;
* share of answers that parse (match ``gate.answer_pattern``): ``candidate >= serving - rate_tolerance``;
* share of tool calls whose arguments parse as a JSON object: ``candidate >= serving - rate_tolerance``;
* share of refusals (``gate.refusal_patterns``): ``candidate <= serving + rate_tolerance``;
* mean answer length (completion tokens): within a factor ``1 + length_tolerance`` of the serving version's,
  either way.

Without a serving figure (nothing promoted yet and the base weights not evaluable) the candidate needs
``reward >= min_reward``. A rejection names every figure that failed, with both values.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    results: tuple[SampleResult, ...] = ()

    def metrics(self) -> dict[str, float]:
        """The figures as a PromotionDecision carries them (the per-sample results are not figures)."""
        return {k: float(v) for k, v in asdict(self).items() if k != "results"}


@dataclass(frozen=True)
class Tolerances:
    """How much worse than serving a candidate may be (see the module docstring)."""

    reward_tolerance: float = 0.05
    rate_tolerance: float = 0.05
    length_tolerance: float = 3.0
    min_reward: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """``promote``, or the reasons it may not be."""

    promote: bool
    failures: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return "; ".join(self.failures) if self.failures else "not worse than serving within the tolerances"


def judge(candidate: EvalFigures, serving: EvalFigures | None, tolerances: Tolerances) -> Verdict:
    """Whether ``candidate`` may replace ``serving`` (None: no serving figure to compare with)."""
    failures: list[str] = []
    if candidate.samples == 0:
        return Verdict(False, ["no held-out completion could be scored"])
    if serving is None:
        if candidate.reward_mean < tolerances.min_reward:
            failures.append(f"reward {candidate.reward_mean:.3f} below gate.min_reward {tolerances.min_reward:.3f} "
                            "(no serving version to compare with)")
        return Verdict(not failures, failures)
    c, s, t = candidate, serving, tolerances
    if c.reward_mean < s.reward_mean - t.reward_tolerance:
        failures.append(f"reward {c.reward_mean:.3f} < serving v{s.version} {s.reward_mean:.3f} - "
                        f"{t.reward_tolerance:g}")
    if c.answer_parse_rate < s.answer_parse_rate - t.rate_tolerance:
        failures.append(f"answers that parse {c.answer_parse_rate:.3f} < serving {s.answer_parse_rate:.3f} - "
                        f"{t.rate_tolerance:g}")
    if c.tool_call_parse_rate < s.tool_call_parse_rate - t.rate_tolerance:
        failures.append(f"tool calls that parse {c.tool_call_parse_rate:.3f} < serving "
                        f"{s.tool_call_parse_rate:.3f} - {t.rate_tolerance:g}")
    if c.refusal_rate > s.refusal_rate + t.rate_tolerance:
        failures.append(f"refusals {c.refusal_rate:.3f} > serving {s.refusal_rate:.3f} + {t.rate_tolerance:g}")
    factor = 1.0 + t.length_tolerance
    low, high = s.answer_length / factor, s.answer_length * factor
    if s.answer_length > 0 and not low <= c.answer_length <= high:
        failures.append(f"answer length {c.answer_length:.1f} tokens outside [{low:.1f}, {high:.1f}] "
                        f"(serving {s.answer_length:.1f} x/÷ {factor:g})")
    return Verdict(not failures, failures)
