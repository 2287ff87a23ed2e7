"""Feedback corrections through the real broker: a reward repeating its feedback_id replaces the earlier one while
the group is open (the group leaves with the corrected reward), and once the group has left the correction is
recorded on ``dlq`` (correction_after_emit) and counted, and the group never trains twice."""
from __future__ import annotations

import asyncio
from pathlib import Path

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.streams import validation as v
from rlstream.streams.app import prepare_topics
from rlstream.transport import metric_names as mn
from tests.support.factories import make_reward, make_trajectory
from tests.integration.test_streams_assembly import wait_for_metrics
from tests.support.streams_helpers import CODEC, Worker, publish, read_dead_letters, read_groups


def test_a_correction_before_and_after_the_group_left(rl_config: RlstreamConfig, tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    worker = Worker(rl_config, "w1", tmp_path).start()
    try:
        a, b = (make_trajectory(run_id=rl_config.run_id, example_id="fb", group_size=2, generation_index=i,
                                reward=None, policy=rl_config.policy) for i in range(2))

        def feedback(t: object, value: float, feedback_id: str | None, **comps: float) -> tuple[str, bytes, bytes]:
            event = make_reward(t, value).model_copy(update={"feedback_id": feedback_id, "components": comps})  # type: ignore[arg-type]
            return names.rewards, b"fb", CODEC.encode(event)

        asyncio.run(publish(rl_config, [
            (names.trajectories, b"fb", CODEC.encode(a)), (names.trajectories, b"fb", CODEC.encode(b)),
            feedback(a, 0.0, "thumb-a", thumbs=0.0),
            feedback(a, 1.0, "thumb-a", thumbs=1.0),  # the user changed their mind: last write wins
            feedback(a, 0.3, None),  # no feedback id: first reward wins, a duplicate
            feedback(b, 0.0, "thumb-b"),  # completes the group
        ]))
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=1, timeout_s=60, quiet_s=0.5))
        assert len(groups) == 1, worker.log_tail()
        rewards = {t.trajectory_id: (t.reward, t.reward_components) for t in groups[0].trajectories}
        assert rewards == {a.trajectory_id: (1.0, {"thumbs": 1.0}), b.trajectory_id: (0.0, {})}

        asyncio.run(publish(rl_config, [feedback(a, 0.5, "thumb-a", thumbs=0.5)]))  # after the group left
        letters = asyncio.run(read_dead_letters(rl_config, names.dlq, expect=1, timeout_s=30, quiet_s=1))
        assert [d.error_type for d in letters] == [v.CORRECTION_AFTER_EMIT], worker.log_tail()
        assert letters[0].source_topic == names.rewards and "thumb-a" in letters[0].error_message
        asyncio.run(wait_for_metrics(rl_config, names, {
            (mn.STREAMS_REWARDS_CORRECTED, ""): 1, (mn.STREAMS_REWARDS_CORRECTED_AFTER_EMIT, ""): 1,
            (mn.STREAMS_DUPLICATE_REWARD, ""): 1, (mn.STREAMS_DLQ, v.CORRECTION_AFTER_EMIT): 1}))
        assert asyncio.run(read_groups(rl_config, names.groups, timeout_s=3, quiet_s=2)) == groups  # trained once
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()
