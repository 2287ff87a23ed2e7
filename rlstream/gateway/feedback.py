"""``POST /v1/feedback``: the body, validated at the door, and the index of response ids.

A reward is a strict JSON number (not a string, not a boolean), finite and within the task's reward range; so is
every component. Anything else is answered 422 with the field and the problem, before anything reaches Kafka: a
NaN or a 1e200 taken in would poison a trajectory's group baseline or throw the trajectory away downstream.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rlstream.gateway.tenants import PerTenantLru
from rlstream.schemas.rewards import feedback_id_problem

#: context key of ``Feedback.model_validate(..., context=...)``: the (low, high) range rewards must lie in
RANGE_CONTEXT = "reward_range"
MAX_COMPONENTS = 64
MAX_NAME_CHARS = 128
MAX_ID_CHARS = 256

StrictFinite = Annotated[float, Field(strict=True, allow_inf_nan=False)]


def _in_range(value: float, info: ValidationInfo, what: str) -> float:
    bounds = (info.context or {}).get(RANGE_CONTEXT)
    if bounds is not None:
        low, high = bounds
        if not low <= value <= high:
            raise ValueError(f"{what} {value!r} is outside the task's reward range [{low}, {high}]")
    return value


class Feedback(BaseModel):
    """Body of ``POST /v1/feedback``: what it rewards (a trajectory id, a response id of the body such as
    ``chatcmpl-...`` / ``resp_...``, a session id, or nothing when a feedback token names it), the reward, its
    components, and an optional ``feedback_id`` (a repeated id corrects the earlier reward)."""

    model_config = ConfigDict(extra="forbid")
    trajectory_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    response_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    session_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    reward: StrictFinite
    components: dict[Annotated[str, Field(max_length=MAX_NAME_CHARS)], StrictFinite] = Field(
        default_factory=dict, max_length=MAX_COMPONENTS)
    feedback_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    feedback_token: str | None = Field(None, max_length=2048, description="a feedback token in the body (also "
                                       "accepted as the x-rlstream-feedback-token header or the bearer credential)")

    @field_validator("reward")
    @classmethod
    def _reward_in_range(cls, value: float, info: ValidationInfo) -> float:
        return _in_range(value, info, "reward")

    @field_validator("feedback_id")
    @classmethod
    def _usable_feedback_id(cls, value: str | None) -> str | None:
        problem = feedback_id_problem(value) if value is not None else None
        if problem is not None:  # the stream app's rule: refused here instead of dead-lettered there
            raise ValueError(problem)
        return value

    @field_validator("components")
    @classmethod
    def _components_in_range(cls, value: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        for name, component in value.items():
            _in_range(component, info, f"component {name!r}")
        return value

    @model_validator(mode="after")
    def _at_most_one_target(self) -> "Feedback":
        named = [n for n in (self.trajectory_id, self.response_id, self.session_id) if n]
        if len(named) > 1:
            raise ValueError("name one of trajectory_id, response_id, session_id")
        return self


def validation_problems(errors: list[Any]) -> list[dict[str, str]]:
    """Readable ``{field, problem}`` pairs of a pydantic ``ValidationError.errors()`` (the input values are not
    echoed: a huge or hostile value stays out of the answer)."""
    return [{"field": ".".join(str(p) for p in e["loc"]) or "(body)",
             "problem": str(e["msg"]).removeprefix("Value error, ")} for e in errors]


class FeedbackIndex:
    """Who owns each recent trajectory (its tenant), and the trajectory each recent response id (the upstream's
    ``chatcmpl-...`` / ``resp_...``) was captured into: for clients that see the body but not the response headers
    (the OpenAI Agents SDK). Bounded per tenant (``capacity`` trajectories and ``capacity`` response ids each,
    oldest out first): one tenant's traffic never pushes out another tenant's entries."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owned: PerTenantLru[str, None] = PerTenantLru(capacity)
        self._owner_of: dict[str, str] = {}
        self._responses: PerTenantLru[str, str] = PerTenantLru(capacity)

    def __len__(self) -> int:
        return len(self._owner_of)

    def own(self, tenant: str, trajectory_id: str) -> list[str]:
        """Record ``tenant`` as the owner of ``trajectory_id``; the trajectory ids of ``tenant`` pushed out."""
        previous = self._owner_of.get(trajectory_id)
        if previous is not None and previous != tenant:
            return []  # an id is owned once; another tenant never takes it over
        self._owner_of[trajectory_id] = tenant
        out = [old for old, _ in self._owned.put(tenant, trajectory_id, None)]
        for old in out:
            self._owner_of.pop(old, None)
        return out

    def owner(self, trajectory_id: str) -> str | None:
        return self._owner_of.get(trajectory_id)

    def add_response(self, tenant: str, response_id: Any, trajectory_id: str) -> None:
        if not isinstance(response_id, str) or not response_id or len(response_id) > MAX_ID_CHARS:
            return
        self._responses.put(tenant, response_id, trajectory_id)

    def response(self, tenant: str, response_id: str) -> str | None:
        return self._responses.get(tenant, response_id)
