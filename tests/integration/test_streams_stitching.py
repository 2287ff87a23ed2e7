"""Session stitching in the stream app over the real broker: a session's calls on ``calls`` become one trajectory on
``trajectories`` (explicit end, idle close), a re-sent call is dropped, a feedback after the trajectory becomes a
RewardEvent for it, a record that is not a CallEvent goes to ``dlq``, and the worker keeps running."""
from __future__ import annotations

import asyncio
from pathlib import Path

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import CallEvent, CallKind, RewardEvent, TrajectoryEvent
from rlstream.schemas.sessions import session_trajectory_id
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from tests.support.streams_helpers import CODEC, Worker, publish, read_all, read_dead_letters
from tests.unit.test_streams_stitching import conversation


def test_calls_become_one_trajectory_per_session(rl_config: RlstreamConfig, tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    worker = Worker(rl_config, "w1", tmp_path, **{"streams.session_idle_s": 2.0}).start()
    try:
        ended = [c.model_copy(update={"session_id": "ended", "run_id": rl_config.run_id}) for c in conversation()]
        idle = [c.model_copy(update={"session_id": "idle", "run_id": rl_config.run_id}) for c in conversation()[:2]]

        def record(c: CallEvent) -> tuple[str, bytes, bytes]:
            return names.calls, c.session_id.encode(), CODEC.encode(c)

        asyncio.run(publish(rl_config, [
            record(ended[0]), record(idle[0]), record(ended[1]), record(ended[1]),  # re-sent by a gateway
            record(idle[1]), record(ended[2]),
            record(CallEvent(session_id="ended", kind=CallKind.end)),
            (names.calls, b"junk", b"not a call event")]))
        got = asyncio.run(read_all(rl_config, names.trajectories, TrajectoryEvent, expect=2, timeout_s=60,
                                   quiet_s=1))
        trajs = {t.metadata["session_id"]: t for _, t in got}
        assert sorted(trajs) == ["ended", "idle"], worker.log_tail()
        assert len(got) == 2
        assert [len(trajs["ended"].turns), len(trajs["idle"].turns)] == [3, 2]
        assert trajs["ended"].trajectory_id == session_trajectory_id("ended", 0)
        assert [t.completion_token_ids for t in trajs["ended"].turns] == [[3], [5], [7]]

        asyncio.run(publish(rl_config, [record(CallEvent(session_id="ended", kind=CallKind.feedback, reward=1.0,
                                                         feedback_id="thumbs", run_id=rl_config.run_id))]))
        rewards = asyncio.run(read_all(rl_config, names.rewards, RewardEvent, expect=1, timeout_s=30, quiet_s=1))
        assert [(r.trajectory_id, r.reward) for _, r in rewards] == [(trajs["ended"].trajectory_id, 1.0)]
        letters = asyncio.run(read_dead_letters(rl_config, names.dlq, expect=1, timeout_s=30, quiet_s=0.5))
        assert [d.source_topic for d in letters] == [names.calls]
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()
