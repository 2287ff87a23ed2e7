"""Ingest validation of trajectory and reward events (pure functions, no Kafka).

Each check returns an :class:`Invalid` with a stable reason code (the dead letter's ``error_type``)
and a message a person can act on, or ``None`` when the event is fine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rlstream.schemas.codec import AvroCodec, CodecError, CorruptPayloadError, IncompatibleSchemaError, PayloadTooLargeError, UnknownSchemaError
from rlstream.schemas.models import RewardEvent, TrajectoryEvent, WireModel

ROLES = frozenset({"system", "user", "assistant", "tool", "function", "environment", "other"})

# reason codes (DeadLetter.error_type)
EMPTY_VALUE = "empty_value"
CORRUPT_PAYLOAD = "corrupt_payload"
UNKNOWN_SCHEMA = "unknown_schema"
WRONG_EVENT_TYPE = "wrong_event_type"
TOO_LARGE = "payload_too_large"
KEY_MISMATCH = "key_mismatch"
MISSING_ID = "missing_id"
NO_MESSAGES = "no_messages"
UNKNOWN_ROLE = "unknown_role"
BAD_FIRST_ROLE = "bad_first_role"
CONSECUTIVE_ASSISTANT = "consecutive_assistant"
TOKEN_LOGPROB_MISMATCH = "token_logprob_mismatch"
NON_FINITE_REWARD = "non_finite_reward"
GROUP_SIZE_OUT_OF_BOUNDS = "group_size_out_of_bounds"
GENERATION_INDEX_OUT_OF_RANGE = "generation_index_out_of_range"
NEGATIVE_POLICY_VERSION = "negative_policy_version"
# assembly-time reasons
GROUP_SIZE_MISMATCH = "group_size_mismatch"
REWARD_GROUP_MISMATCH = "reward_group_mismatch"
GROUP_EXPIRED = "group_expired"
REWARD_TIMEOUT = "reward_timeout"
ORPHAN_REWARD = "orphan_reward"
GROUP_TOO_LARGE = "group_too_large"
STATE_TOO_LARGE = "state_too_large"  # holding the record would need a changelog record over the size limit
PAYLOAD_UNAVAILABLE = "payload_unavailable"  # a waiting member's record could not be read back by its offset


@dataclass(frozen=True)
class Invalid:
    """Why an event is rejected: a reason code and a readable message."""

    reason: str
    message: str


class Rejected(Exception):
    """Raised by :func:`decode_event` for a record that cannot become an event."""

    def __init__(self, invalid: Invalid) -> None:
        super().__init__(f"{invalid.reason}: {invalid.message}")
        self.invalid = invalid


def decode_event(codec: AvroCodec, value: bytes | None, model: type[WireModel]) -> WireModel:
    """Decode a record value into ``model`` or raise :class:`Rejected` with the reason."""
    if value is None:
        raise Rejected(Invalid(EMPTY_VALUE, "record has no value (a tombstone); events are never deleted by key"))
    if len(value) == 0:
        raise Rejected(Invalid(EMPTY_VALUE, "record value is empty (0 bytes)"))
    try:
        return codec.decode(value, model)
    except UnknownSchemaError as exc:
        raise Rejected(Invalid(UNKNOWN_SCHEMA, str(exc))) from exc
    except IncompatibleSchemaError as exc:
        raise Rejected(Invalid(WRONG_EVENT_TYPE, str(exc))) from exc
    except PayloadTooLargeError as exc:
        raise Rejected(Invalid(TOO_LARGE, str(exc))) from exc
    except (CorruptPayloadError, CodecError) as exc:
        raise Rejected(Invalid(CORRUPT_PAYLOAD, str(exc))) from exc


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def check_key(key: bytes | None, example_id: str) -> Invalid | None:
    """Records are keyed by example_id so that a group stays in one partition."""
    if key is not None and key != example_id.encode():
        return Invalid(KEY_MISMATCH, f"record key {key[:80]!r} is not the example_id {example_id!r}; "
                                     "key trajectories and rewards by example_id")
    return None


def validate_trajectory(event: TrajectoryEvent, min_group_size: int = 1, max_group_size: int = 256) -> Invalid | None:
    """Check one trajectory against DESIGN.md's ingest rules; the first problem found is returned."""
    for name in ("trajectory_id", "group_id", "example_id", "run_id", "policy"):
        if not getattr(event, name).strip():
            return Invalid(MISSING_ID, f"{name} is empty")
    if not min_group_size <= event.group_size <= max_group_size:
        return Invalid(GROUP_SIZE_OUT_OF_BOUNDS,
                       f"group_size {event.group_size} outside [{min_group_size}, {max_group_size}]")
    if not 0 <= event.generation_index < event.group_size:
        return Invalid(GENERATION_INDEX_OUT_OF_RANGE,
                       f"generation_index {event.generation_index} outside [0, {event.group_size})")
    if event.policy_version < 0:
        return Invalid(NEGATIVE_POLICY_VERSION, f"policy_version {event.policy_version} is negative")
    if not event.messages:
        return Invalid(NO_MESSAGES, "trajectory has no messages")
    for i, msg in enumerate(event.messages):
        if msg.role not in ROLES:
            return Invalid(UNKNOWN_ROLE, f"message {i} has role {msg.role!r}; expected one of {sorted(ROLES)}")
    if event.messages[0].role not in ("user", "system"):
        return Invalid(BAD_FIRST_ROLE, f"first message has role {event.messages[0].role!r}; expected user or system")
    for i in range(1, len(event.messages)):
        if event.messages[i].role == "assistant" and event.messages[i - 1].role == "assistant":
            return Invalid(CONSECUTIVE_ASSISTANT, f"messages {i - 1} and {i} are both assistant messages")
    for i, turn in enumerate(event.turns):
        ids, lps = turn.completion_token_ids, turn.completion_logprobs
        if ids is not None and lps is not None and len(ids) != len(lps):
            return Invalid(TOKEN_LOGPROB_MISMATCH,
                           f"turn {i}: {len(ids)} completion token ids but {len(lps)} logprobs")
        if lps is not None and ids is None:
            return Invalid(TOKEN_LOGPROB_MISMATCH, f"turn {i}: {len(lps)} logprobs without completion token ids")
    if not _finite(event.reward):
        return Invalid(NON_FINITE_REWARD, f"reward is {event.reward}")
    for name, value in event.reward_components.items():
        if not _finite(value):
            return Invalid(NON_FINITE_REWARD, f"reward component {name!r} is {value}")
    return None


def validate_reward(event: RewardEvent) -> Invalid | None:
    """A reward must name its trajectory, group and example and be a finite number."""
    for name in ("trajectory_id", "group_id", "example_id"):
        if not getattr(event, name).strip():
            return Invalid(MISSING_ID, f"{name} is empty")
    if not math.isfinite(event.reward):
        return Invalid(NON_FINITE_REWARD, f"reward is {event.reward}")
    for name, value in event.components.items():
        if not math.isfinite(value):
            return Invalid(NON_FINITE_REWARD, f"reward component {name!r} is {value}")
    return None
