"""Schema evolution of the per-turn ``policy_version`` and ``temperature`` of :class:`Turn`: records written
before the fields existed decode with them null, and readers of the previous schema read records that carry them."""
from __future__ import annotations

import json
from typing import Any

import pytest

from rlstream.schemas.codec import HISTORY_DIR, AvroCodec
from rlstream.schemas.models import TrajectoryEvent, TrajectoryGroup
from tests.support.factories import make_trajectory

CODEC = AvroCodec()
TRAJECTORY, GROUP = TrajectoryEvent.avro_name, TrajectoryGroup.avro_name
#: the last schema of each record before Turn had the two fields
PREVIOUS = {TRAJECTORY: "rlstream.v1.TrajectoryEvent.2.json", GROUP: "rlstream.v1.TrajectoryGroup.3.json"}


def previous_schema(name: str) -> dict[str, Any]:
    return json.loads((HISTORY_DIR / PREVIOUS[name]).read_text())


def tagged_trajectory() -> TrajectoryEvent:
    traj = make_trajectory(turns=2, completion_tokens=4, policy_version=7)
    traj.turns[0].policy_version, traj.turns[0].temperature = 6, 0.7
    traj.turns[1].policy_version, traj.turns[1].temperature = 7, 1.3
    return traj


def group_of(traj: TrajectoryEvent) -> TrajectoryGroup:
    return TrajectoryGroup(group_id="g", run_id=traj.run_id, example_id=traj.example_id, policy=traj.policy,
                           min_policy_version=6, max_policy_version=7, expected_size=1, trajectories=[traj],
                           reward_mean=1.0, reward_std=0.0, reward_min=1.0, reward_max=1.0)


def without_turn_fields(record: dict[str, Any]) -> dict[str, Any]:
    """The record as a writer of the previous schema would have it (the turns lack the two fields)."""
    def strip(traj: dict[str, Any]) -> None:
        for turn in traj["turns"]:
            turn.pop("policy_version")
            turn.pop("temperature")

    if "trajectories" in record:
        for traj in record["trajectories"]:
            strip(traj)
    else:
        strip(record)
    return record


def test_turn_fields_round_trip() -> None:
    decoded = CODEC.decode(CODEC.encode(tagged_trajectory()), TrajectoryEvent)
    assert [(t.policy_version, t.temperature) for t in decoded.turns] == [(6, 0.7), (7, 1.3)]


@pytest.mark.parametrize("name", [TRAJECTORY, GROUP])
def test_records_of_the_previous_schema_decode_with_null_turn_fields(name: str) -> None:
    schema = previous_schema(name)
    turn_fields = {f["name"] for f in _turn_schema(schema)["fields"]}
    assert not {"policy_version", "temperature"} & turn_fields
    event = tagged_trajectory() if name == TRAJECTORY else group_of(tagged_trajectory())
    record = without_turn_fields(CODEC.decode_record(CODEC.encode(event), name))
    old_bytes = CODEC.encode_record(record, schema)
    decoded = CODEC.decode(old_bytes, type(event))
    trajs = [decoded] if isinstance(decoded, TrajectoryEvent) else decoded.trajectories
    turns = trajs[0].turns
    assert [(t.policy_version, t.temperature) for t in turns] == [(None, None), (None, None)]
    assert trajs[0].policy_version == 7 and turns[0].completion_token_ids == event_turns(event)[0].completion_token_ids


@pytest.mark.parametrize("name", [TRAJECTORY, GROUP])
def test_a_reader_of_the_previous_schema_reads_records_with_turn_fields(name: str) -> None:
    event = tagged_trajectory() if name == TRAJECTORY else group_of(tagged_trajectory())
    data = CODEC.encode(event)
    old_reader = AvroCodec()
    old_reader.add_schema(previous_schema(name), reader=True)
    record = old_reader.decode_record(data, name)
    traj = record if name == TRAJECTORY else record["trajectories"][0]
    assert "policy_version" not in traj["turns"][0] and "temperature" not in traj["turns"][0]
    assert traj["turns"][1]["completion_token_ids"] == event_turns(event)[1].completion_token_ids


def event_turns(event: TrajectoryEvent | TrajectoryGroup) -> list[Any]:
    return event.turns if isinstance(event, TrajectoryEvent) else event.trajectories[0].turns


def _turn_schema(schema: Any) -> dict[str, Any]:
    """The Turn record defined inline somewhere in an expanded schema."""
    if isinstance(schema, dict):
        if schema.get("type") == "record" and schema.get("name") == "Turn":
            return schema
        children = list(schema.values())
    elif isinstance(schema, list):
        children = schema
    else:
        children = []
    for child in children:
        found = _turn_schema(child) if isinstance(child, (dict, list)) else None
        if found:
            return found
    return {}
