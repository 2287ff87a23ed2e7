"""The operator's reward rule through the real broker (gateway -> rewards -> streams worker -> groups): two named
scores of a production single combine with their configured weights, a correction inside the correction window
replaces its score (the single waits for the window), and after the window the gateway answers the correction 409
with nothing more on ``rewards``. Negative control: without named scores (the old rule) the first score is the
reward and the second name is dropped as a duplicate. A first single of the task starts its baseline (the first
reward of a baseline key is filtered as zero_variance)."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from bench.canned_upstream import app as canned_upstream
from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import AccessConfig
from rlstream.gateway.config import GatewaySettings
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import RewardEvent
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from tests.support.learner_helpers import read_topic
from tests.support.streams_helpers import Worker, read_groups, wait_for_processing

pytestmark = pytest.mark.integration

KEY = "acme-key-0123456789abcdef"
WINDOW_S = 6.0
WEIGHTS = "{helpfulness: 0.75, correctness: 0.25}"


async def _scores_then_late_correction(cfg: RlstreamConfig, names: TopicNames) -> tuple[str, float, int]:
    """A call, three feedbacks inside the window, one correction after it: (trajectory id, capture time, the late
    correction's status)."""
    publisher = TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards)
    await publisher.start()
    access = AccessConfig(api_keys=[SecretStr(KEY)], feedback_secret=SecretStr("s" * 32), reward_range=(-1.0, 1.0))
    gw = Gateway(GatewaySettings(session_stitching="gateway", policy=cfg.policy, served_model="toy",
                                 run_id=cfg.run_id, correction_window_s=WINDOW_S), publisher, access=access,
                 client=httpx.AsyncClient(transport=httpx.ASGITransport(canned_upstream), base_url="http://up"))
    await gw.start()
    headers = {"authorization": f"Bearer {KEY}", "x-rlstream-task": "echo"}  # one task: one baseline
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gw)), base_url="http://gw") as c:
            async def single() -> str:
                r = await c.post("/v1/chat/completions", headers=headers, json={
                    "model": cfg.policy, "messages": [{"role": "user", "content": "Repeat c."}], "max_tokens": 8})
                assert r.status_code == 200, r.text
                return r.headers["x-rlstream-trajectory-id"]

            async def feedback(name: str, value: float, feedback_id: str, trajectory_id: str = "") -> int:
                answer = await c.post("/v1/feedback", headers=headers, json={
                    "trajectory_id": trajectory_id or tid, "reward": value, "components": {name: value},
                    "feedback_id": feedback_id})
                return answer.status_code

            first = await single()  # starts the task's baseline
            assert await feedback("helpfulness", 0.0, "w-h", first) == 202
            assert await feedback("correctness", 0.0, "w-c", first) == 202
            tid = await single()
            captured = asyncio.get_running_loop().time()

            assert await feedback("helpfulness", 1.0, "h-1") == 202
            assert await feedback("correctness", 0.2, "c-1") == 202
            assert await feedback("helpfulness", 0.6, "h-1") == 202  # the user changed their mind, in the window
            await asyncio.sleep(max(0.0, captured + WINDOW_S + 0.5 - asyncio.get_running_loop().time()))
            late = await feedback("helpfulness", 0.0, "h-1")
    finally:
        await gw.stop()
        await publisher.close()
    return tid, captured, late


@pytest.mark.parametrize("rule, reward, components", [
    ({"streams.reward.scores": WEIGHTS}, 0.75 * 0.6 + 0.25 * 0.2, {"helpfulness": 0.6, "correctness": 0.2}),
    ({}, 0.6, {"helpfulness": 0.6}),  # negative control: the old rule keeps the first score (corrected) only
], ids=["weighted", "old-rule"])
def test_named_scores_combine_a_correction_in_the_window_counts_and_one_after_it_is_409(
        rl_config: RlstreamConfig, tmp_path: Path, rule: dict[str, Any], reward: float,
        components: dict[str, float]) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    worker = Worker(rl_config, "w1", tmp_path, **{"streams.reward_range": "[-1.0, 1.0]",
                                                  "streams.reward.correction_window_s": WINDOW_S,
                                                  "streams.reward.correction_grace_s": 1.0,
                                                  "learner.baseline_min_count": 1, **rule}).start()
    try:
        wait_for_processing(worker, tmp_path, 0)  # the windows count from the calls: the worker is there first
        tid, _, late = asyncio.run(_scores_then_late_correction(rl_config, names))
        assert late == 409  # after the window: refused, never 202
        groups = asyncio.run(read_groups(rl_config, names.groups, expect=1, timeout_s=60, quiet_s=2))
        assert len(groups) == 1, worker.log_tail()
        [member] = groups[0].trajectories
        assert member.trajectory_id == tid
        assert member.reward == pytest.approx(reward) and member.reward_components == pytest.approx(components)
        # the single waited out its correction window before it left
        assert (groups[0].assembled_at - member.created_at).total_seconds() >= WINDOW_S
        published = asyncio.run(read_topic(rl_config, names.rewards, RewardEvent, expect=6, timeout_s=3))
        assert len(published) == 5  # the late correction never reached Kafka
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()
