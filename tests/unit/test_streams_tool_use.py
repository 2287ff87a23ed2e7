"""The stream app's tool-use counters, from the tool task's own reward components: an episode whose tool call did
not parse (markup left in the text, or arguments that are not a JSON object) and a tool-task episode without a tool
call each move their counter; control: a good episode, and an episode of a task without tools, move neither."""
from __future__ import annotations

import json

import pytest

from rlstream.ops.tool_task import ToolCallRecord, ToolEpisode, lookup_value, tool_dataset, tool_reward
from rlstream.streams.telemetry import TOOL_CALLS_COMPONENT, Telemetry
from rlstream.transport import metric_names as mn

pytestmark = pytest.mark.unit

EXAMPLE = tool_dataset(1)[0]
VALUE = lookup_value(EXAMPLE["entity"], EXAMPLE["attribute"])
GOOD_CALL = ToolCallRecord("lookup", json.dumps({"entity": EXAMPLE["entity"], "attribute": EXAMPLE["attribute"]}))
COUNTERS = (mn.STREAMS_TOOL_EPISODES, mn.STREAMS_TOOL_CALL_PARSE_FAILURES, mn.STREAMS_TOOL_EPISODES_WITHOUT_CALL)


def counted(episode: ToolEpisode | str) -> tuple[int, int, int]:
    telemetry = Telemetry()
    telemetry.count_tool_use(tool_reward(EXAMPLE, episode))
    figures = telemetry.report()
    return tuple(int(figures[name]) for name in COUNTERS)  # type: ignore[return-value]


def test_a_good_episode_is_counted_as_a_tool_episode_only() -> None:
    assert counted(ToolEpisode(calls=[GOOD_CALL], tool_results=[VALUE], final_answer=f"It is {VALUE}.")) == (1, 0, 0)


def test_a_call_that_did_not_parse_moves_the_parse_failures() -> None:
    markup = f'<tool_call>{{"name": "lookup", "arguments": {{"entity": "{EXAMPLE["entity"]}"</tool_call>'
    assert counted(ToolEpisode(final_answer=markup)) == (1, 1, 0)  # the server's parser left it as text
    bad_arguments = ToolCallRecord("lookup", '{"entity": ')
    assert counted(ToolEpisode(calls=[bad_arguments], final_answer="I do not know.")) == (1, 1, 0)


def test_a_tool_task_episode_without_a_call_moves_the_no_call_counter() -> None:
    assert counted(ToolEpisode(final_answer="It is red.")) == (1, 0, 1)
    assert counted("It is red.") == (1, 0, 1)  # a plain answer text is an episode without a call too


def test_episodes_of_tasks_without_tools_are_not_counted() -> None:
    telemetry = Telemetry()
    telemetry.count_tool_use({"reward": 1.0, "success": 1.0})
    telemetry.count_tool_use({TOOL_CALLS_COMPONENT: float("nan")})
    assert all(telemetry.report()[name] == 0 for name in COUNTERS)
