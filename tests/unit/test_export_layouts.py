"""Export rows TRL trains on: DPO and KTO rows from a group, tool-call arguments as JSON objects, the captured tool
schemas as a column, and Parquet rows that import back to the same trajectory."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlstream.ops.export import (ImportFormat, ParquetLayout, _schema, argument_json, event_from_row, parquet_row,
                                 parquet_schema, preference_rows, read_parquet_records)
from rlstream.rollout.capture import RecordedCall, Recording, request_tools
from rlstream.schemas.models import merged_tools
from rlstream.schemas.models import TOOLS_METADATA_KEY, Message, ToolCall, TrajectoryEvent, Turn
from tests.support.factories import make_trajectory

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}


def group(rewards: list[float | None], answers: list[str] | None = None) -> list[TrajectoryEvent]:
    out = []
    for i, reward in enumerate(rewards):
        event = make_trajectory(example_id="ex", group_id="g", group_size=len(rewards), generation_index=i,
                                reward=reward, seed=i)
        event.messages[-1].content = (answers or [f"answer of {i}" for _ in rewards])[i]
        out.append(event)
    return out


def test_dpo_row_pairs_the_best_and_the_worst_member_of_a_group() -> None:
    # rewards 0.2, 0.9, -0.5, 0.9, None: best = generation 1 (0.9, the lower index of the tie), worst = 2 (-0.5)
    members = group([0.2, 0.9, -0.5, 0.9, None])
    [row] = preference_rows(list(reversed(members)), ParquetLayout.dpo)
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][1]["content"] == "question ex"
    assert [m["content"] for m in row["chosen"]] == ["answer of 1"]
    assert [m["content"] for m in row["rejected"]] == ["answer of 2"]
    assert (row["chosen_reward"], row["rejected_reward"]) == (0.9, -0.5)
    assert (row["chosen_trajectory_id"], row["rejected_trajectory_id"]) == \
        (members[1].trajectory_id, members[2].trajectory_id)
    assert row["group_id"] == "g" and row["task"] == "test"


@pytest.mark.parametrize("rewards", [[0.5, 0.5, 0.5], [1.0], [1.0, None], [None, None], [float("nan"), 1.0]])
def test_groups_without_a_preference_give_no_rows(rewards: list[float | None]) -> None:
    members = group(rewards)
    for event in members:  # NaN cannot be built through make_trajectory's components
        event.reward_components = {}
    assert preference_rows(members, ParquetLayout.dpo) == []
    assert preference_rows(members, ParquetLayout.kto) == []


def test_kto_labels_are_rewards_above_the_group_mean() -> None:
    # mean of 1.0, 0.0, 0.0, 0.5 = 0.375: labels True, False, False, True; the unrewarded member has no row
    members = group([1.0, 0.0, 0.0, 0.5, None])
    rows = preference_rows(members, ParquetLayout.kto)
    assert [r["label"] for r in rows] == [True, False, False, True]
    assert [r["trajectory_id"] for r in rows] == [e.trajectory_id for e in members[:4]]
    assert {r["group_mean_reward"] for r in rows} == {0.375}
    assert [[m["content"] for m in r["completion"]] for r in rows] == [[f"answer of {i}"] for i in range(4)]
    assert all([m["role"] for m in r["prompt"]] == ["system", "user"] for r in rows)


def test_argument_json_keeps_json_and_wraps_the_rest_as_a_string() -> None:
    assert argument_json('{"q": "x"}') == '{"q": "x"}'
    assert json.loads(argument_json("not json {")) == "not json {"
    assert json.loads(argument_json("NaN")) == "NaN"  # Python's json would read it; JSON has no NaN
    assert json.loads(argument_json("")) == ""


def test_recording_keeps_each_offered_tool_schema_once_in_order() -> None:
    class SdkTool:  # what an SDK's pydantic tool param dumps to
        def model_dump(self, exclude_none: bool = False) -> dict:
            return CLOCK

    assert request_tools({"tools": [WEATHER, SdkTool()]}) == [WEATHER, CLOCK]
    assert request_tools({}) == request_tools({"tools": "weather"}) == []
    assert merged_tools([[WEATHER], [CLOCK, WEATHER], []]) == [WEATHER, CLOCK]

    recording = Recording()
    turn = Turn(model="m", prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-0.1])
    user = [Message(role="user", content="hi")]
    recording.add(RecordedCall(user, Message(role="assistant", content="a"), turn, "m", tools=[WEATHER]))
    recording.add(RecordedCall(user, Message(role="assistant", content="b"), turn, "m", tools=[CLOCK, WEATHER]))
    event = recording.to_event(run_id="r", example_id="e", group_id="g", group_size=1, generation_index=0,
                               policy="p", policy_version=0)
    assert json.loads(event.metadata[TOOLS_METADATA_KEY]) == [WEATHER, CLOCK]
    bare = Recording()
    bare.add(RecordedCall(user, Message(role="assistant", content="a"), turn, "m"))
    assert TOOLS_METADATA_KEY not in bare.to_event(run_id="r", example_id="e", group_id="g", group_size=1,
                                                   generation_index=0, policy="p", policy_version=0).metadata


def test_gateway_call_records_the_request_tools() -> None:
    from rlstream.gateway.sessions import recorded_call

    call = recorded_call({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]},
                         {"role": "assistant", "content": "ok"}, [1], [2], [-0.1], "stop", "m")
    assert call.tools == [WEATHER]


def tooled(arguments: str) -> TrajectoryEvent:
    event = make_trajectory(with_tool_call=True, turns=2, seed=3)
    event.messages[2].tool_calls = [ToolCall(id="call_1", name="weather", arguments=arguments)]
    event.metadata[TOOLS_METADATA_KEY] = json.dumps([WEATHER, CLOCK])
    return event


def write(rows: list[dict], layout: ParquetLayout, path: Path) -> Path:
    table = pa.Table.from_pylist(rows, schema=_schema(layout, pa.string())).cast(parquet_schema(layout))
    pq.write_table(table, str(path))
    return path


@pytest.mark.parametrize("layout", [ParquetLayout.messages, ParquetLayout.prompt_completion])
def test_parquet_rows_import_back_to_the_same_trajectory(tmp_path: Path, layout: ParquetLayout) -> None:
    events = [tooled('{"city": "Paris"}'), tooled("not json {"), make_trajectory(seed=4, reward=None)]
    path = write([parquet_row(e, None, layout) for e in events], layout, tmp_path / "t.parquet")
    records = list(read_parquet_records(path))
    assert [r.index for r in records] == [0, 1, 2]
    back = [event_from_row(r.value, "p", "r") for r in records]
    assert [e.model_dump() for e in back] == [e.model_dump() for e in events]


def test_a_foreign_parquet_row_needs_only_messages(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
             "tools": [json.dumps(WEATHER)]}]
    schema = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("tools", pa.list_(pa.string()))])
    path = tmp_path / "foreign.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))
    [record] = read_parquet_records(path)
    event = event_from_row(record.value, "policy-x", "run-x")
    again = event_from_row(next(read_parquet_records(path)).value, "policy-x", "run-x")
    assert event.trajectory_id == again.trajectory_id == event.example_id == event.group_id
    assert (event.run_id, event.policy, event.group_size, event.turns) == ("run-x", "policy-x", 1, [])
    assert json.loads(event.metadata[TOOLS_METADATA_KEY]) == [WEATHER]
    with pytest.raises(ValueError, match="no messages"):
        event_from_row({"text": "hello"}, "p", "r")


def test_import_formats() -> None:
    from rlstream.cli.export import ImportFormatOption

    assert [f.value for f in ImportFormatOption] == [f.value for f in ImportFormat]
