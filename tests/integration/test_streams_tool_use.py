"""The stream app on the real broker counts how tool-task episodes used their tool, from the tool task's own reward
components (on the trajectory, or on feedback that comes later): a trajectory whose tool call did not parse moves
``streams.tool_call_parse_failures``, an episode without a tool call (scored by late feedback) moves
``streams.tool_episodes_without_call``; control: a good episode moves neither, and a re-sent trajectory is not
counted twice."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rlstream.ops.tool_task import ToolCallRecord, ToolEpisode, lookup_value, tool_dataset, tool_reward
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.transport import metric_names as mn
from tests.integration.test_streams_assembly import wait_for_metrics
from tests.support.factories import make_reward, make_trajectory
from tests.support.streams_helpers import CODEC, Worker, publish

pytestmark = pytest.mark.integration


def test_tool_call_parse_failures_and_episodes_without_a_call_are_counted(rl_config: RlstreamConfig,
                                                                          tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    example = tool_dataset(1)[0]
    value = lookup_value(example["entity"], example["attribute"])
    good = ToolEpisode(calls=[ToolCallRecord("lookup", json.dumps({"entity": example["entity"],
                                                                   "attribute": example["attribute"]}))],
                       tool_results=[value], final_answer=f"It is {value}.")
    unparsed = ToolEpisode(final_answer='<tool_call>{"name": "lookup", "arguments": {"entity": </tool_call>')
    no_call = ToolEpisode(final_answer="It is red.")

    def scored(index: int, episode: ToolEpisode | None):  # type: ignore[no-untyped-def]
        components = tool_reward(example, episode) if episode is not None else {}
        event = make_trajectory(run_id=rl_config.run_id, example_id="tools", group_size=3, generation_index=index,
                                policy=rl_config.policy, reward=components.get("reward"))
        return event.model_copy(update={"reward_components": {k: v for k, v in components.items() if k != "reward"}})

    first, second, late = scored(0, good), scored(1, unparsed), scored(2, None)
    feedback = make_reward(late, tool_reward(example, no_call)["reward"]).model_copy(
        update={"components": {k: v for k, v in tool_reward(example, no_call).items() if k != "reward"}})
    worker = Worker(rl_config, "w1", tmp_path).start()
    try:
        asyncio.run(publish(rl_config, [(names.trajectories, b"tools", CODEC.encode(t))
                                        for t in (first, second, second, late)]))
        asyncio.run(wait_for_metrics(rl_config, names, {
            (mn.STREAMS_TOOL_EPISODES, ""): 2, (mn.STREAMS_TOOL_CALL_PARSE_FAILURES, ""): 1,
            (mn.STREAMS_TOOL_EPISODES_WITHOUT_CALL, ""): 0, (mn.STREAMS_DUPLICATE_TRAJECTORY, ""): 1}))
        asyncio.run(publish(rl_config, [(names.rewards, b"tools", CODEC.encode(feedback))]))
        asyncio.run(wait_for_metrics(rl_config, names, {
            (mn.STREAMS_TOOL_EPISODES, ""): 3, (mn.STREAMS_TOOL_CALL_PARSE_FAILURES, ""): 1,
            (mn.STREAMS_TOOL_EPISODES_WITHOUT_CALL, ""): 1}))
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()
