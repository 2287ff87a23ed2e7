"""rlstream <-> ATIF (NAT's ``nat.atif`` models): what ATIF has fields for lands there, the rest round-trips through
``extra``; a trajectory from another ATIF producer imports."""
from __future__ import annotations

import json

import pytest
from nat.atif import Trajectory

from rlstream.ops.atif import AtifConversionError, from_atif, to_atif
from rlstream.schemas.models import Message, ToolCall, TrajectoryEvent, TrajectorySource, Turn
from tests.support.factories import make_trajectory

pytestmark = pytest.mark.unit


def through_json(event: TrajectoryEvent) -> TrajectoryEvent:
    """``event`` -> ATIF -> JSON text -> NAT's model (validated) -> event."""
    text = json.dumps(to_atif(event).to_json_dict())
    return from_atif(Trajectory.model_validate_json(text), default_policy="unused", default_run_id="unused").event


def awkward() -> TrajectoryEvent:
    messages = [
        Message(role="developer", content="rules"),
        Message(role="user", content="hi", name="ana"),
        Message(role="assistant", content=None, tool_calls=[
            ToolCall(id="a", name="f", arguments='{"x":1}'),  # not written the canonical way
            ToolCall(id="b", name="g", arguments="not json"),
            ToolCall(id="c", name="h", arguments="[1, 2]", type="custom"),
            ToolCall(id="d", name="k", arguments=""),
        ]),
        Message(role="tool", content="1", tool_call_id="a", name="f"),
        Message(role="tool", content=None, tool_call_id="zzz"),  # names no call of the step before
        Message(role="assistant", content=""),
        Message(role="environment", content="tick"),
        Message(role="assistant", content="done"),
    ]
    turns = [
        Turn(message_index=7, model="m", prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-0.5],
             trainable=False, finish_reason="stop", policy_version=4, temperature=0.7),
        Turn(message_index=2, model="m", prompt_token_ids=[1], completion_token_ids=[9, 8], completion_logprobs=None),
        Turn(message_index=2, completion_token_ids=[5]),  # a second turn on one message
        Turn(message_index=None, prompt_token_ids=[7]),
        Turn(message_index=5),  # no token data at all
    ]
    return TrajectoryEvent(run_id="r", example_id="e", group_id="g", group_size=3, generation_index=2, policy="p",
                           policy_version=5, source=TrajectorySource.production, messages=messages, turns=turns,
                           reward=None, reward_components={"a": 0.5}, metadata={"task": "t", "k": "v"}, target=None,
                           producer_id="gw")


@pytest.mark.parametrize("event", [awkward(), make_trajectory(turns=3, with_tool_call=True, seed=3),
                                   make_trajectory(turns=1, reward=-2.5, seed=4)], ids=["awkward", "tools", "plain"])
def test_an_export_reads_back_as_the_same_trajectory(event: TrajectoryEvent) -> None:
    assert through_json(event) == event


def test_atif_fields_carry_what_atif_has_fields_for() -> None:
    event = make_trajectory(turns=1, with_tool_call=False, seed=5)
    trajectory = to_atif(event)
    assert [s.source for s in trajectory.steps] == ["system", "user", "agent"]
    agent = trajectory.steps[2]
    turn = event.turns[0]
    assert agent.metrics.prompt_token_ids == turn.prompt_token_ids
    assert agent.metrics.completion_token_ids == turn.completion_token_ids
    assert agent.metrics.logprobs == turn.completion_logprobs
    assert agent.metrics.completion_tokens == len(turn.completion_token_ids) and agent.model_name == turn.model
    assert trajectory.trajectory_id == event.trajectory_id and trajectory.extra["reward"] == event.reward
    assert trajectory.final_metrics.total_completion_tokens == len(turn.completion_token_ids)
    tools = to_atif(make_trajectory(turns=1, with_tool_call=True, seed=5)).steps[2]
    assert tools.tool_calls[0].arguments == {"q": "x"} and tools.tool_calls[0].extra is None
    assert tools.observation.results[0].source_call_id == "call_1" and tools.observation.results[0].content == "42"


def test_a_trajectory_from_another_atif_producer_imports() -> None:
    foreign = {
        "schema_version": "ATIF-v1.6", "session_id": "sess-1",
        "agent": {"name": "calculator", "version": "1.0.0", "model_name": "qwen"},
        "steps": [
            {"step_id": 1, "source": "user", "message": "What is 7 * 8?"},
            {"step_id": 2, "source": "agent", "message": "", "model_name": "qwen",
             "tool_calls": [{"tool_call_id": "t1", "function_name": "multiply", "arguments": {"a": 7, "b": 8}}],
             "observation": {"results": [{"source_call_id": "t1", "content": "56"}]},
             "metrics": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_token_ids": [1, 2, 3],
                         "completion_token_ids": [4, 5], "logprobs": [-0.1, -0.2]}},
            {"step_id": 3, "source": "agent", "message": [{"type": "text", "text": "56"}],
             "metrics": {"prompt_tokens": 5}},
        ],
        "extra": {"reward": 1.0},
    }
    event = from_atif(Trajectory.model_validate(foreign), default_policy="pol", default_run_id="new").event
    assert [(m.role, m.content) for m in event.messages] == [("user", "What is 7 * 8?"), ("assistant", ""),
                                                              ("tool", "56"), ("assistant", "56")]
    assert event.messages[1].tool_calls == [ToolCall(id="t1", name="multiply", arguments='{"a": 7, "b": 8}')]
    assert event.messages[2].tool_call_id == "t1"
    assert event.turns == [Turn(message_index=1, model="qwen", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                                completion_logprobs=[-0.1, -0.2])]
    assert (event.reward, event.example_id, event.group_id, event.run_id, event.policy) == \
        (1.0, "sess-1", "sess-1", "new", "pol")
    assert event.trajectory_id == from_atif(Trajectory.model_validate(foreign), default_policy="pol",
                                            default_run_id="new").event.trajectory_id
    assert event.target == "calculator" and event.policy_version == 0


def test_what_has_no_faithful_counterpart_is_refused_with_the_reason() -> None:
    tool_first = make_trajectory(seed=1).model_copy(update={"messages": [Message(role="tool", content="x")]})
    with pytest.raises(AtifConversionError, match="first message is a tool message"):
        to_atif(tool_first)
    image = {"agent": {"name": "a", "version": "1"}, "session_id": "s", "steps": [
        {"step_id": 1, "source": "user", "message": [{"type": "image",
                                                      "source": {"media_type": "image/png", "path": "x.png"}}]}]}
    with pytest.raises(AtifConversionError, match="image content is not supported"):
        from_atif(Trajectory.model_validate(image), default_policy="p", default_run_id="r")


def test_a_trajectory_without_ids_gets_ids_from_its_content() -> None:
    nameless = {"agent": {"name": "a", "version": "1"}, "steps": [{"step_id": 1, "source": "user", "message": "x"}]}
    first = from_atif(Trajectory.model_validate(nameless), default_policy="p", default_run_id="r").event
    again = from_atif(Trajectory.model_validate(nameless), default_policy="p", default_run_id="r").event
    nameless["steps"][0]["message"] = "y"
    other = from_atif(Trajectory.model_validate(nameless), default_policy="p", default_run_id="r").event
    assert first.trajectory_id == again.trajectory_id == first.example_id != other.trajectory_id
    assert first.group_id == f"r:{first.example_id}"


def test_cli_choices_are_the_export_formats_and_layouts() -> None:
    from rlstream.cli.export import ExportFormatOption, LayoutOption
    from rlstream.ops.export import ExportFormat, ParquetLayout

    assert [f.value for f in ExportFormatOption] == [f.value for f in ExportFormat]
    assert [layout.value for layout in LayoutOption] == [layout.value for layout in ParquetLayout]


def test_import_files_are_json_lines_an_array_or_one_object(tmp_path) -> None:
    from rlstream.ops.export import read_records

    one = to_atif(make_trajectory(seed=1)).to_json_dict()
    two = to_atif(make_trajectory(seed=2)).to_json_dict()
    array = tmp_path / "a.json"
    array.write_text(json.dumps([one, two], indent=2))
    assert [(r.index, r.value) for r in read_records(array)] == [(0, one), (1, two)]
    pretty = tmp_path / "o.json"
    pretty.write_text(json.dumps(one, indent=2))
    assert [(r.index, r.value, r.error) for r in read_records(pretty)] == [(0, one, None)]
    broken_first = tmp_path / "b.jsonl"
    broken_first.write_text("{oops\n\n" + json.dumps(two) + "\n")
    records = list(read_records(broken_first))
    assert [(r.index, r.value) for r in records] == [(0, None), (2, two)]
    assert records[0].error.startswith("line 1 is not JSON") and records[0].raw == b"{oops"
    bad_array = tmp_path / "c.json"
    bad_array.write_text("[1, 2")
    assert [r.error.startswith("the file is not a JSON array") for r in read_records(bad_array)] == [True]


def test_a_missing_export_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import typer

    from rlstream.cli.export import require_export_extra

    require_export_extra("pyarrow", "nat.atif")  # installed: nothing happens
    monkeypatch.setitem(sys.modules, "nat", None)  # as if nvidia-nat-atif were not installed
    monkeypatch.setitem(sys.modules, "nat.atif", None)
    with pytest.raises(typer.Exit):
        require_export_extra("nat.atif")
    with pytest.raises(typer.Exit):
        require_export_extra("no_such_module_here")


@pytest.mark.parametrize("extra", [{"rlstream": "abc"}, {"rlstream": {"unattached_turns": 5}},
                                   {"rlstream": {"unattached_turns": [7]}}, {"rlstream": {"turn_count": "x"}},
                                   {"rlstream": {"group_size": "many"}}, {"reward": "high"}, {"reward": float("nan")}])
def test_hostile_extras_are_rejected_with_a_reason(extra: dict) -> None:
    from rlstream.ops.export import FileRecord, RejectedRecord, atif_event
    from rlstream.schemas.config import load_config

    record = to_atif(make_trajectory(seed=1)).to_json_dict()
    record["extra"] = {**record["extra"], **extra}
    with pytest.raises(RejectedRecord) as rejected:
        atif_event(FileRecord(0, b"", record), "new", load_config(None, []), "f:0")
    assert rejected.value.error_type in {"invalid_atif", "non_finite_reward"} and str(rejected.value)
