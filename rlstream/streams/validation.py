"""Ingest validation of trajectory and reward events (pure functions, no Kafka).

Each check returns an :class:`Invalid` with a stable reason code (the dead letter's ``error_type``)
and a message a person can act on, or ``None`` when the event is fine.

Rewards follow rlstream/schemas/rewards.py (finite, inside ``streams.reward_range``, a usable ``feedback_id``):
the same rules every reader of ``rewards`` applies.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rlstream.schemas.codec import AvroCodec, CodecError, CorruptPayloadError, IncompatibleSchemaError, PayloadTooLargeError, UnknownSchemaError
from rlstream.schemas.models import TrajectoryEvent, Turn, WireModel
# the reward rules live in schemas so that every reader of rewards (the gate too) applies the same ones
from rlstream.schemas.rewards import (BAD_FEEDBACK_ID, DEFAULT_REWARD_RANGE, MAX_FEEDBACK_ID_CHARS, MISSING_ID,  # noqa: F401
                                      NON_FINITE_REWARD, REWARD_OUT_OF_RANGE, Invalid, RewardRange, check_reward_value,
                                      check_rewards, validate_reward)
from rlstream.schemas.sampling import (DEFAULT_TEMPERATURE_RANGE, TEMPERATURE_OUT_OF_RANGE, TemperatureRange,
                                       temperature_problem)
from rlstream.schemas.skim import SkippedNumbers

T = TypeVar("T")

ROLES = frozenset({"system", "user", "assistant", "tool", "function", "environment", "other"})

# reason codes (DeadLetter.error_type)
EMPTY_VALUE = "empty_value"
CORRUPT_PAYLOAD = "corrupt_payload"
UNKNOWN_SCHEMA = "unknown_schema"
WRONG_EVENT_TYPE = "wrong_event_type"
TOO_LARGE = "payload_too_large"
KEY_MISMATCH = "key_mismatch"
NO_MESSAGES = "no_messages"
UNKNOWN_ROLE = "unknown_role"
BAD_FIRST_ROLE = "bad_first_role"
CONSECUTIVE_ASSISTANT = "consecutive_assistant"
TOKEN_LOGPROB_MISMATCH = "token_logprob_mismatch"
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
CORRECTION_AFTER_EMIT = "correction_after_emit"  # a feedback correction that came after its group left (recorded)

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
    return _checked(lambda: codec.decode(value, model))


def _checked(decode: Callable[[], T]) -> T:
    """``decode()``, its codec errors turned into :class:`Rejected` with their reason."""
    try:
        return decode()
    except UnknownSchemaError as exc:
        raise Rejected(Invalid(UNKNOWN_SCHEMA, str(exc))) from exc
    except IncompatibleSchemaError as exc:
        raise Rejected(Invalid(WRONG_EVENT_TYPE, str(exc))) from exc
    except PayloadTooLargeError as exc:
        raise Rejected(Invalid(TOO_LARGE, str(exc))) from exc
    except (CorruptPayloadError, CodecError) as exc:
        raise Rejected(Invalid(CORRUPT_PAYLOAD, str(exc))) from exc


@dataclass(frozen=True)
class TurnCounts:
    """How many completion token ids and logprobs a turn holds (``None``: the field is null)."""

    completion_token_ids: int | None
    completion_logprobs: int | None

    @classmethod
    def of(cls, turn: Turn) -> "TurnCounts":
        ids, lps = turn.completion_token_ids, turn.completion_logprobs
        return cls(None if ids is None else len(ids), None if lps is None else len(lps))


@dataclass(frozen=True)
class IngestedTrajectory:
    """A trajectory record as the stream reads it: the event without its turns' token data, and their counts.

    The stream keeps the record's bytes as they came and never re-encodes ``event``; its turns' ``prompt_token_ids``,
    ``completion_token_ids`` and ``completion_logprobs`` are ``None`` when the record was skimmed."""

    event: TrajectoryEvent
    turn_counts: list[TurnCounts]


_TOKEN_FIELDS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs")


def _count(value: object) -> int | None:
    return value.count if isinstance(value, SkippedNumbers) else None


def decode_trajectory(codec: AvroCodec, value: bytes | None) -> IngestedTrajectory:
    """Decode a trajectory record, counting its token data instead of building it when the record was written with the
    codec's own schema (schemas/skim.py); a record of another schema version is decoded whole. Raises
    :class:`Rejected` with the reason."""
    record = _checked(lambda: None if not value else codec.skim_record(value, TrajectoryEvent.avro_name))
    if record is None:
        event = decode_event(codec, value, TrajectoryEvent)
        assert isinstance(event, TrajectoryEvent)
        return IngestedTrajectory(event, [TurnCounts.of(turn) for turn in event.turns])
    counts = []
    for turn in record.get("turns") or []:
        counts.append(TurnCounts(_count(turn["completion_token_ids"]), _count(turn["completion_logprobs"])))
        turn.update(dict.fromkeys(_TOKEN_FIELDS))
    try:
        event = TrajectoryEvent.model_validate(record)
    except ValueError as exc:
        raise Rejected(Invalid(CORRUPT_PAYLOAD, f"decoded {TrajectoryEvent.avro_name} is not valid: {exc}")) from exc
    return IngestedTrajectory(event, counts)


def check_key(key: bytes | None, example_id: str) -> Invalid | None:
    """Records are keyed by example_id so that a group stays in one partition."""
    if key is not None and key != example_id.encode():
        return Invalid(KEY_MISMATCH, f"record key {key[:80]!r} is not the example_id {example_id!r}; "
                                     "key trajectories and rewards by example_id")
    return None


def validate_trajectory(event: TrajectoryEvent, min_group_size: int = 1, max_group_size: int = 256,
                        turn_counts: list[TurnCounts] | None = None,
                        reward_range: RewardRange = DEFAULT_REWARD_RANGE,
                        temperature_range: TemperatureRange = DEFAULT_TEMPERATURE_RANGE) -> Invalid | None:
    """Check one trajectory against DESIGN.md's ingest rules; the first problem found is returned. ``turn_counts``
    (from :func:`decode_trajectory`) stand for the turns' token data when the event was read without it."""
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
    counts = turn_counts if turn_counts is not None else [TurnCounts.of(turn) for turn in event.turns]
    for i, count in enumerate(counts):
        ids, lps = count.completion_token_ids, count.completion_logprobs
        if ids is not None and lps is not None and ids != lps:
            return Invalid(TOKEN_LOGPROB_MISMATCH, f"turn {i}: {ids} completion token ids but {lps} logprobs")
        if lps is not None and ids is None:
            return Invalid(TOKEN_LOGPROB_MISMATCH, f"turn {i}: {lps} logprobs without completion token ids")
    for i, turn in enumerate(event.turns):
        problem = temperature_problem(turn.temperature, temperature_range)
        if problem:
            return Invalid(TEMPERATURE_OUT_OF_RANGE, f"turn {i}: {problem}")
    return check_rewards(event.reward, event.reward_components, reward_range)
