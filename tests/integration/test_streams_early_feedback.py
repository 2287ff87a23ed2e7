"""A feedback that reaches ``rewards`` before its trajectory reaches ``trajectories`` (an observability tool scoring a
response whose session is still open) is held by the stream app and joins the trajectory once it comes, a correction
of it while held included (real broker, real stream worker)."""
from __future__ import annotations

import asyncio
from pathlib import Path

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.transport import metric_names as mn
from tests.support.factories import make_reward, make_trajectory
from tests.integration.test_streams_assembly import wait_for_metrics
from tests.support.streams_helpers import CODEC, Worker, publish, read_groups


def test_feedback_before_its_trajectory_is_held_corrected_and_joins(rl_config: RlstreamConfig,
                                                                    tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    worker = Worker(rl_config, "w1", tmp_path).start()
    try:
        a, b = (make_trajectory(run_id=rl_config.run_id, example_id="early", group_size=2, generation_index=i,
                                reward=None, policy=rl_config.policy) for i in range(2))

        def feedback(t: object, value: float, feedback_id: str, name: str) -> tuple[str, bytes, bytes]:
            event = make_reward(t, value).model_copy(  # type: ignore[arg-type]
                update={"feedback_id": feedback_id, "components": {name: value}})
            return names.rewards, b"early", CODEC.encode(event)

        asyncio.run(publish(rl_config, [  # both rewards of a, the second a correction, before a exists
            feedback(a, 0.2, "score-1", "quality"), feedback(a, 0.9, "score-1", "quality")]))
        asyncio.run(wait_for_metrics(rl_config, names, {(mn.STREAMS_REWARDS_HELD, ""): 1,
                                                        (mn.STREAMS_REWARDS_CORRECTED, ""): 1}))
        assert asyncio.run(read_groups(rl_config, names.groups, timeout_s=2, quiet_s=1)) == []
        asyncio.run(publish(rl_config, [(names.trajectories, b"early", CODEC.encode(a)),
                                        (names.trajectories, b"early", CODEC.encode(b)),
                                        feedback(b, 0.0, "score-2", "quality")]))
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=1, timeout_s=60, quiet_s=0.5))
        assert len(groups) == 1, worker.log_tail()
        rewards = {t.trajectory_id: (t.reward, t.reward_components) for t in groups[0].trajectories}
        assert rewards == {a.trajectory_id: (0.9, {"quality": 0.9}), b.trajectory_id: (0.0, {"quality": 0.0})}
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()
