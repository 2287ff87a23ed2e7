"""Production feedback that arrives while the streams worker is down: single responses captured before a SIGKILL,
their users' feedback sent while no worker runs, a restarted worker: every rewarded single comes out once, with the
baseline of the rewards before it (the waiting singles and the keyed baseline survive the crash in the changelogs)."""
from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from tests.support.factories import make_reward, make_trajectory
from tests.support.streams_helpers import CODEC, Worker, publish, read_dead_letters, read_groups, wait_for_count

REWARDS = [0.2, 0.8, 0.5, 0.9, 0.1, 0.6]
#: a single with one earlier reward trains too (learner.baseline_min_count 1): every single after the first is emitted
SETTINGS = {"streams.group_timeout_s": 2, "streams.min_reward_diff": 0, "learner.baseline_min_count": 1}


def test_feedback_sent_while_the_worker_is_down_joins_after_its_restart(rl_config: RlstreamConfig,
                                                                         tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    singles = [make_trajectory(run_id=rl_config.run_id, example_id="letters", group_id=f"req-{i}", group_size=1,
                               reward=None).model_copy(update={"metadata": {"task": "letters"}})
               for i in range(len(REWARDS))]
    feedback = [(names.rewards, b"letters", CODEC.encode(make_reward(t, r))) for t, r in zip(singles, REWARDS)]
    worker = Worker(rl_config, "w1", tmp_path, **SETTINGS).start()
    restarted = None
    try:
        asyncio.run(publish(rl_config, [(names.trajectories, b"letters", CODEC.encode(t)) for t in singles]))
        asyncio.run(publish(rl_config, feedback[:3]))  # req-0 starts the baseline (filtered), req-1, req-2 emitted
        asyncio.run(wait_for_count(rl_config, names.groups, 2, timeout_s=60))
        worker.kill()
        asyncio.run(publish(rl_config, feedback[3:]))  # the late feedback: no worker running
        restarted = Worker(rl_config, "w1", tmp_path, **SETTINGS).start()
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=5, timeout_s=120, quiet_s=4))
        assert restarted.alive(), restarted.log_tail()
    finally:
        worker.stop()
        if restarted:
            restarted.stop()
    assert sorted(g.group_id for g in groups) == [f"req-{i}" for i in range(1, 6)]  # each once
    for group in groups:
        index = int(group.group_id.split("-")[1])
        before = REWARDS[:index]  # the baseline of the rewards that came before this one
        assert group.baseline is not None and group.baseline.count == len(before)
        assert group.baseline.mean == pytest.approx(statistics.mean(before))
        assert group.baseline.std == pytest.approx(statistics.stdev(before) if len(before) > 1 else 0.0, abs=1e-4)
        assert [t.reward for t in group.trajectories] == [REWARDS[index]]
    assert asyncio.run(read_dead_letters(rl_config, names.dlq, timeout_s=2, quiet_s=1)) == []
