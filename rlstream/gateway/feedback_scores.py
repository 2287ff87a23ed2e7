"""A score as the observability tools type it, turned into a reward by their own rules.

* Langfuse (``dataType``): NUMERIC takes a number; BOOLEAN a number 0 or 1 (the Python SDK sends ``True`` as 1.0);
  CATEGORICAL a string, through the gateway's categories table (``gateway.feedback_categories``); no data type: a
  number is NUMERIC, a string CATEGORICAL (Langfuse infers it the same way). TEXT and CORRECTION scores, and a value
  of the wrong type, carry no reward: refused (Langfuse answers such a score 400 too).
* LangSmith (``feedback_config``): ``continuous`` with ``min`` / ``max`` puts the score on [0, 1] (4 on 1..5 is 0.75;
  outside the range is refused); ``categorical`` maps a ``value`` label to its category's numeric value (then onto
  [0, 1] when ``min`` / ``max`` are given); ``freeform`` takes a numeric score as it is. Without a config, a number is
  the reward, a boolean 1 / 0, a string goes through the categories table.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FeedbackShapeError(ValueError):
    """A feedback in a known shape that carries no usable reward (answered 4xx)."""


def category_reward(label: str, categories: dict[str, float]) -> float:
    """The reward of a categorical value (case-insensitive), or :class:`FeedbackShapeError`."""
    table = {k.lower(): v for k, v in categories.items()}
    value = table.get(label.strip().lower())
    if value is None:
        known = ", ".join(sorted(categories)) or "none configured"
        raise FeedbackShapeError(f"unknown category {label[:64]!r} (the gateway's feedback_categories: {known})")
    return value


def finite(value: Any) -> float:
    """``value`` (an int or float, not a bool) as a finite float, or :class:`FeedbackShapeError`."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise FeedbackShapeError("a score must be a finite number")
    return number


def reward_of(value: Any, categories: dict[str, float]) -> float:
    """A score's reward: a number as it is, a boolean as 1 / 0, a string through the categories table."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        return finite(value)
    if isinstance(value, str):
        return category_reward(value, categories)
    raise FeedbackShapeError("a score is a number, a boolean or a category")


def langfuse_reward(value: Any, data_type: str | None, categories: dict[str, float]) -> float:
    """The reward of a Langfuse score of ``data_type``, checked as Langfuse checks it."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if data_type is None:
        data_type = "CATEGORICAL" if isinstance(value, str) else "BOOLEAN" if isinstance(value, bool) else "NUMERIC"
    if data_type == "NUMERIC":
        if not number:
            raise FeedbackShapeError("a NUMERIC score's value must be a number")
        return finite(value)
    if data_type == "BOOLEAN":
        if isinstance(value, bool) or number and value in (0, 1):
            return 1.0 if value else 0.0
        raise FeedbackShapeError("a BOOLEAN score's value must be 0 or 1")
    if data_type == "CATEGORICAL":
        if not isinstance(value, str):
            raise FeedbackShapeError("a CATEGORICAL score's value must be a string")
        return category_reward(value, categories)
    if data_type in ("TEXT", "CORRECTION"):
        raise FeedbackShapeError(f"a {data_type} score carries no reward")
    raise FeedbackShapeError(f"unknown dataType {str(data_type)[:32]!r} (NUMERIC, BOOLEAN or CATEGORICAL)")


class FeedbackCategory(BaseModel):
    """One category of a LangSmith ``feedback_config``."""

    model_config = ConfigDict(extra="allow")
    value: float = Field(..., allow_inf_nan=False)
    label: str | None = None


class FeedbackConfig(BaseModel):
    """LangSmith's ``feedback_config`` (``langsmith.schemas.FeedbackConfig``)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["continuous", "categorical", "freeform"]
    min: float | None = Field(None, allow_inf_nan=False)
    max: float | None = Field(None, allow_inf_nan=False)
    categories: list[FeedbackCategory] | None = Field(None, max_length=256)


def _on_unit(score: float, config: FeedbackConfig) -> float:
    """``score`` on [0, 1] by the config's min and max (as it is without them)."""
    if config.min is None or config.max is None:
        return score
    if not config.min < config.max:
        raise FeedbackShapeError("feedback_config: min must be below max")
    if not config.min <= score <= config.max:
        raise FeedbackShapeError(f"score {score:g} is outside the feedback_config range [{config.min:g}, "
                                 f"{config.max:g}]")
    return (score - config.min) / (config.max - config.min)


def langsmith_reward(score: Any, value: Any, config: FeedbackConfig | None, categories: dict[str, float]) -> float:
    """The reward of a LangSmith feedback's ``score`` (else ``value``) under its ``feedback_config``."""
    given = score if score is not None else value
    if given is None:
        raise FeedbackShapeError("a feedback without score or value carries no reward (a correction alone is not "
                                 "one)")
    if config is None:
        return reward_of(given, categories)
    if isinstance(given, str):
        if config.type != "categorical" or not config.categories:
            return _on_unit(reward_of(given, categories), config) if config.type == "continuous" else \
                reward_of(given, categories)
        wanted = given.strip().lower()
        match = [c.value for c in config.categories if (c.label or "").strip().lower() == wanted]
        if not match:
            labels = ", ".join(c.label or str(c.value) for c in config.categories)
            raise FeedbackShapeError(f"value {given[:64]!r} is none of the feedback_config categories ({labels})")
        return _on_unit(match[0], config)
    number = 1.0 if given is True else 0.0 if given is False else reward_of(given, categories)
    if config.type == "categorical" and config.categories and number not in {c.value for c in config.categories}:
        raise FeedbackShapeError(f"score {number:g} is none of the feedback_config categories' values")
    return _on_unit(number, config)
