"""Ingest validation: each rule gives its own reason code."""
from __future__ import annotations

import math

import pytest

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import Message, RewardEvent, TrajectoryEvent, Turn
from rlstream.streams import validation as v
from tests.support.factories import make_reward, make_trajectory

CODEC = AvroCodec()


def reason_of(event: TrajectoryEvent) -> str | None:
    invalid = v.validate_trajectory(event, 1, 16)
    return invalid.reason if invalid else None


def test_good_trajectory_and_reward_pass() -> None:
    t = make_trajectory(turns=3, with_tool_call=True)
    assert v.validate_trajectory(t) is None
    assert v.validate_reward(make_reward(t, 0.5)) is None
    assert v.check_key(t.example_id.encode(), t.example_id) is None


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"trajectory_id": ""}, v.MISSING_ID),
        ({"group_id": "  "}, v.MISSING_ID),
        ({"group_size": 0}, v.GROUP_SIZE_OUT_OF_BOUNDS),
        ({"group_size": 17}, v.GROUP_SIZE_OUT_OF_BOUNDS),
        ({"generation_index": 4}, v.GENERATION_INDEX_OUT_OF_RANGE),
        ({"policy_version": -1}, v.NEGATIVE_POLICY_VERSION),
        ({"messages": []}, v.NO_MESSAGES),
        ({"messages": [Message(role="assistant", content="hi")]}, v.BAD_FIRST_ROLE),
        ({"messages": [Message(role="user", content="q"), Message(role="robot", content="x")]}, v.UNKNOWN_ROLE),
        ({"messages": [Message(role="user", content="q"), Message(role="assistant", content="a"),
                       Message(role="assistant", content="b")]}, v.CONSECUTIVE_ASSISTANT),
        ({"turns": [Turn(completion_token_ids=[1, 2, 3], completion_logprobs=[-0.1, -0.2])]}, v.TOKEN_LOGPROB_MISMATCH),
        ({"turns": [Turn(completion_logprobs=[-0.1])]}, v.TOKEN_LOGPROB_MISMATCH),
        ({"reward": math.nan}, v.NON_FINITE_REWARD),
        ({"reward": math.inf}, v.NON_FINITE_REWARD),
        ({"reward_components": {"x": -math.inf}}, v.NON_FINITE_REWARD),
    ],
)
def test_each_rule_names_its_reason(change: dict, reason: str) -> None:
    t = make_trajectory(group_size=4).model_copy(update=change)
    assert reason_of(t) == reason


def test_turns_without_token_data_are_accepted() -> None:
    t = make_trajectory().model_copy(update={"turns": [Turn(model="m")]})
    assert reason_of(t) is None


def test_reward_rules() -> None:
    t = make_trajectory()
    assert v.validate_reward(make_reward(t, math.nan)).reason == v.NON_FINITE_REWARD  # type: ignore[union-attr]
    bad = RewardEvent(trajectory_id="", group_id="g", example_id="e", reward=1.0)
    assert v.validate_reward(bad).reason == v.MISSING_ID  # type: ignore[union-attr]
    comp = RewardEvent(trajectory_id="t", group_id="g", example_id="e", reward=1.0, components={"a": math.inf})
    assert v.validate_reward(comp).reason == v.NON_FINITE_REWARD  # type: ignore[union-attr]


def test_key_must_be_the_example_id() -> None:
    assert v.check_key(b"other", "ex-1").reason == v.KEY_MISMATCH  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value, reason",
    [
        (None, v.EMPTY_VALUE),
        (b"", v.EMPTY_VALUE),
        (b"{\"json\": true}", v.CORRUPT_PAYLOAD),
        (b"\xc3\x01" + b"\x00" * 8 + b"body", v.UNKNOWN_SCHEMA),
    ],
)
def test_decode_reasons(value: bytes | None, reason: str) -> None:
    with pytest.raises(v.Rejected) as info:
        v.decode_event(CODEC, value, TrajectoryEvent)
    assert info.value.invalid.reason == reason


def test_decode_wrong_type_and_truncation() -> None:
    t = make_trajectory()
    with pytest.raises(v.Rejected) as info:
        v.decode_event(CODEC, CODEC.encode(make_reward(t, 1.0)), TrajectoryEvent)
    assert info.value.invalid.reason == v.WRONG_EVENT_TYPE
    with pytest.raises(v.Rejected) as info:
        v.decode_event(CODEC, CODEC.encode(t)[:-7], TrajectoryEvent)
    assert info.value.invalid.reason == v.CORRUPT_PAYLOAD
    assert v.decode_event(CODEC, CODEC.encode(t), TrajectoryEvent) == t
