"""Reward validation shared by every reader of ``rewards`` and ``trajectories`` (pure functions, no Kafka).

A reward and each of its components must be finite (``non_finite_reward``: NaN, +-inf) and inside
``streams.reward_range`` (``reward_out_of_range``: e.g. 1e200, which would otherwise reach the keyed baselines, the
learner and the canary's sequential test). A ``feedback_id`` is 1 to :data:`MAX_FEEDBACK_ID_CHARS` characters, not
blank (``bad_feedback_id``). The stream app dead-letters what fails (rlstream/streams/validation.py); the promotion
gate counts it and leaves it out of the canary's test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rlstream.schemas.models import RewardEvent

# reason codes (DeadLetter.error_type)
MISSING_ID = "missing_id"
NON_FINITE_REWARD = "non_finite_reward"
REWARD_OUT_OF_RANGE = "reward_out_of_range"
BAD_FEEDBACK_ID = "bad_feedback_id"

#: a feedback id is held in the group state until its group is forgotten: bounded
MAX_FEEDBACK_ID_CHARS = 256


@dataclass(frozen=True)
class Invalid:
    """Why an event is rejected: a reason code and a readable message."""

    reason: str
    message: str


@dataclass(frozen=True)
class RewardRange:
    """The closed interval ``[low, high]`` a reward and each of its components must lie in
    (``streams.reward_range``)."""

    low: float
    high: float

    def admits(self, value: float) -> bool:
        """True for a finite ``value`` inside the range (NaN never is)."""
        return math.isfinite(value) and self.low <= value <= self.high

    def __str__(self) -> str:
        return f"[{self.low:g}, {self.high:g}]"


#: streams.reward_range's default (tests/unit/test_streams_reward_range.py keeps the two equal)
DEFAULT_REWARD_RANGE = RewardRange(-10.0, 10.0)


def check_reward_value(name: str, value: float | None, reward_range: RewardRange) -> Invalid | None:
    """A reward (or a component, ``name`` saying which) must be finite and inside ``reward_range``; ``None`` (a
    reward still to come) is fine."""
    if value is None:
        return None
    if not math.isfinite(value):
        return Invalid(NON_FINITE_REWARD, f"{name} is {value}")
    if not reward_range.admits(value):
        return Invalid(REWARD_OUT_OF_RANGE, f"{name} {value:g} is outside streams.reward_range {reward_range}")
    return None


def check_rewards(reward: float | None, components: dict[str, float], reward_range: RewardRange) -> Invalid | None:
    """:func:`check_reward_value` for a reward and each of its components."""
    invalid = check_reward_value("reward", reward, reward_range)
    for name, value in components.items():
        invalid = invalid or check_reward_value(f"reward component {name!r}", value, reward_range)
    return invalid


def validate_reward(event: RewardEvent, reward_range: RewardRange = DEFAULT_REWARD_RANGE) -> Invalid | None:
    """A reward must name its trajectory, group and example, be a finite number inside ``reward_range`` (its
    components too), and carry a usable ``feedback_id`` if any."""
    for name in ("trajectory_id", "group_id", "example_id"):
        if not getattr(event, name).strip():
            return Invalid(MISSING_ID, f"{name} is empty")
    if event.feedback_id is not None:
        problem = feedback_id_problem(event.feedback_id)
        if problem is not None:
            return Invalid(BAD_FEEDBACK_ID, problem)
    return check_rewards(event.reward, event.components, reward_range)


def feedback_id_problem(feedback_id: str) -> str | None:
    """Why ``feedback_id`` is not usable (the gateway answers it 422, streams dead-letter it), or None."""
    if 0 < len(feedback_id) <= MAX_FEEDBACK_ID_CHARS and feedback_id.strip():
        return None
    return (f"feedback_id {feedback_id[:80]!r} ({len(feedback_id)} characters) must be 1 to "
            f"{MAX_FEEDBACK_ID_CHARS} characters, not blank")
