"""The sampling settings a workflow is called with (model name, temperature, token limit).

They reach the workflow as its third argument, never as attributes set on the OpenAI client.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlstream.schemas.config import RolloutConfig


@dataclass(frozen=True)
class SamplingSettings:
    """What a workflow passes to ``client.chat.completions.create`` for the policy's calls.

    ``model`` is the plain policy name (``rollout.model``): the runner routes requests for it to the
    policy version being served, so a workflow never names a version itself.
    """

    model: str
    temperature: float
    max_tokens: int

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> SamplingSettings:
        """``rollout.model``, ``rollout.temperature`` and ``rollout.max_tokens``."""
        return cls(model=rollout.model, temperature=rollout.temperature, max_tokens=rollout.max_tokens)

    def with_model(self, model: str) -> SamplingSettings:
        """The same settings for another model name (e.g. one policy version's adapter)."""
        return replace(self, model=model)
