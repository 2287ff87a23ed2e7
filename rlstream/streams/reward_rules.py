"""The operator's reward rule (``streams.reward``): named scores combined into a trajectory's reward, and the
correction window of production singles. Pure functions over a member's scores; the assembler applies them.

A RewardEvent's scores are its components (a Langfuse score name, a LangSmith key, a ``gen_ai.evaluation.name``);
one without components is a single score named ``feedback``. Each score remembers the feedback id that set it: the
same id again is a correction (last write wins), another id for a name already scored is a duplicate (first wins).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rlstream.schemas.models import RewardEvent

#: the score name of a RewardEvent that names none (the gateway's component of an unnamed feedback)
UNNAMED_SCORE = "feedback"


@dataclass(frozen=True)
class RewardRules:
    """``streams.reward`` as the assembler uses it."""

    scores: dict[str, float] = field(default_factory=dict)  # name -> weight; empty: the first reward wins
    score_window_s: float = 60.0
    correction_window_s: float = 0.0
    correction_grace_s: float = 5.0

    @property
    def combines(self) -> bool:
        return bool(self.scores)

    def hold_s(self) -> float:
        """How long after its capture a rewarded single waits before it leaves (0: it leaves at its reward)."""
        return self.correction_window_s + self.correction_grace_s if self.correction_window_s > 0 else 0.0

    @classmethod
    def from_config(cls, section: Any) -> "RewardRules":
        """From a :class:`rlstream.schemas.config.RewardRulesConfig`."""
        return cls(scores=dict(section.scores), score_window_s=section.score_window_s,
                   correction_window_s=section.correction_window_s, correction_grace_s=section.correction_grace_s)


class ScoreTaken(str, Enum):
    """What a score did to a trajectory's scores."""

    NEW = "new"
    CORRECTED = "corrected"
    DUPLICATE = "duplicate"


#: a trajectory's scores: name -> [value, feedback id that set it (or None)] (JSON-ready)
Scores = dict[str, list[Any]]


def event_scores(event: RewardEvent) -> dict[str, float]:
    """The scores a RewardEvent carries."""
    return dict(event.components) if event.components else {UNNAMED_SCORE: event.reward}


def take_scores(scores: Scores, given: dict[str, float], feedback_id: str | None) -> ScoreTaken:
    """Merge ``given`` (one RewardEvent's scores) into ``scores``: names not scored yet are added, names scored by
    the same feedback id are corrected, names scored by another id (or without one) are duplicates (kept as they
    are). The event counts as what its most significant name did (corrected > new > duplicate)."""
    taken = ScoreTaken.DUPLICATE
    for name, value in given.items():
        held = scores.get(name)
        if held is None:
            scores[name] = [float(value), feedback_id]
            taken = ScoreTaken.NEW if taken is ScoreTaken.DUPLICATE else taken
        elif feedback_id is not None and held[1] == feedback_id:
            scores[name] = [float(value), feedback_id]
            taken = ScoreTaken.CORRECTED
    return taken


def all_named_in(rules: RewardRules, scores: Scores) -> bool:
    return all(name in scores for name in rules.scores)


def combined(rules: RewardRules, scores: Scores) -> float | None:
    """The weighted mean of the named scores present (None: none of them is)."""
    present = [(weight, float(scores[name][0])) for name, weight in rules.scores.items() if name in scores]
    if not present:
        return None
    total = sum(weight for weight, _ in present)
    return sum(weight * value for weight, value in present) / total


def components(scores: Scores) -> dict[str, float]:
    """Every score as a reward component."""
    return {name: float(held[0]) for name, held in scores.items()}


def feedback_ids(scores: Scores) -> list[str]:
    """The feedback ids that set any of ``scores``."""
    return sorted({str(held[1]) for held in scores.values() if held[1] is not None})
