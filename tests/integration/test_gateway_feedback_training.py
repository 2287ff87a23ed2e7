"""Feedback from the door to the learner: the gateway (real ASGI app, keyed) refuses NaN, infinities, 1e200,
strings, booleans and out-of-range rewards; a correction before its group leaves is what trains, one after it is
recorded on ``dlq`` and never trains; the task keeps training (gateway -> Kafka -> streams worker -> learner)."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rlstream.learner.service import Learner
from rlstream.ops.lineage import version_lineage
from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import AccessConfig
from rlstream.gateway.config import GatewaySettings
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import PolicyVersion, RewardEvent
from rlstream.schemas.topics import TopicNames
from rlstream.streams import validation as v
from rlstream.streams.app import prepare_topics
from tests.support.learner_helpers import read_topic, tiny_model
from tests.support.streams_helpers import Worker, read_dead_letters, read_groups

pytestmark = pytest.mark.integration

KEY = "acme-key-0123456789abcdef"
PROMPT_IDS = list(range(1, 19))


async def n_choices(request: Request) -> Response:
    """A vLLM-shaped answer with ``n`` distinct choices, token ids and logprobs (ids inside the tiny vocabulary)."""
    body = json.loads(await request.body())
    choices = [{"index": i, "message": {"role": "assistant", "content": f"answer {i}"},
                "logprobs": {"content": [{"token": "c", "logprob": -0.5, "bytes": [99], "top_logprobs": []}] * 4},
                "finish_reason": "stop", "token_ids": [40 + i] * 4} for i in range(int(body.get("n", 1)))]
    return JSONResponse({"id": f"chatcmpl-{os.urandom(4).hex()}", "object": "chat.completion", "created": 0,
                         "model": body["model"], "choices": choices, "prompt_token_ids": PROMPT_IDS,
                         "usage": {"prompt_tokens": 18, "completion_tokens": 8, "total_tokens": 26}})


def bearer() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


async def ask_for_a_group(client: httpx.AsyncClient, prompt: str) -> list[str]:
    r = await client.post("/v1/chat/completions", headers=bearer(), json={
        "model": "policy", "n": 2, "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]})
    assert r.status_code == 200, r.text
    return r.headers["x-rlstream-trajectory-ids"].split(",")


async def feedback(client: httpx.AsyncClient, body: dict[str, Any] | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return await client.post("/v1/feedback", headers={**bearer(), "content-type": "application/json"},
                             content=content)


def test_rewards_validated_at_the_door_and_corrected_until_the_group_leaves_train_once(
        rl_config: RlstreamConfig, tmp_path: Path) -> None:
    cfg = rl_config.model_copy(update={
        "streams": rl_config.streams.model_copy(update={"reward_range": (-1.0, 1.0)}),
        "learner": rl_config.learner.model_copy(update={
            "model": str(tiny_model(tmp_path)), "lora": rl_config.learner.lora.model_copy(update={"enabled": True}),
            "groups_per_step": 1, "publish_every": 1, "total_steps": 2, "device": "cpu", "lease_ttl_s": 5.0,
            "run_ids": [rl_config.run_id], "output_dir": tmp_path / "learner"})})
    asyncio.run(prepare_topics(cfg))
    names = TopicNames.from_config(cfg.topics)
    worker = Worker(cfg, "w1", tmp_path, **{"streams.reward_range": "[-1.0, 1.0]"}).start()
    try:
        first, second, rewards_sent = asyncio.run(_traffic(cfg, names))
        groups = asyncio.run(read_groups(cfg, names.groups, expect=2, timeout_s=90, quiet_s=1))
        assert len(groups) == 2, worker.log_tail()
        by_id = {t.trajectory_id: t.reward for g in groups for t in g.trajectories}
        assert by_id == {first[0]: 1.0, first[1]: 0.0, second[0]: 1.0, second[1]: 0.0}  # the correction won

        letters = asyncio.run(read_dead_letters(cfg, names.dlq, expect=1, timeout_s=30, quiet_s=1))
        assert [d.error_type for d in letters] == [v.CORRECTION_AFTER_EMIT], worker.log_tail()
        # only what the door let through reached Kafka: three rewards of the first group, one correction, two more
        published = asyncio.run(read_topic(cfg, names.rewards, RewardEvent, expect=rewards_sent))
        assert sorted(r.reward for r in published) == [0.0, 0.0, 0.0, 0.5, 1.0, 1.0]

        state = asyncio.run(Learner(cfg, holder="door-to-learner").run())
        assert state.step == 2 and state.groups_trained == 2
        versions = asyncio.run(read_topic(cfg, names.policy_versions, PolicyVersion, expect=3))
        assert [x.version for x in versions] == [0, 1, 2]  # the base weights, then one version per step
        trained = [g.group_id for x in versions for g in asyncio.run(version_lineage(cfg, x.version)).groups]
        assert sorted(trained) == sorted(g.group_id for g in groups)  # each group trained once, the task goes on
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()


async def _traffic(cfg: RlstreamConfig, names: TopicNames) -> tuple[list[str], list[str], int]:
    publisher = TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards)
    await publisher.start()
    upstream = Starlette(routes=[Route("/v1/chat/completions", n_choices, methods=["POST"])])
    access = AccessConfig(api_keys=[SecretStr(KEY)], feedback_secret=SecretStr("s" * 32),
                          feedback_token_ttl_s=600, reward_range=cfg.streams.reward_range)
    gateway = Gateway(GatewaySettings(session_stitching="gateway",
                                      policy=cfg.policy, served_model="policy", run_id=cfg.run_id, session_idle_s=60),
                      publisher, client=httpx.AsyncClient(transport=httpx.ASGITransport(upstream),
                                                          base_url="http://upstream"), access=access)
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            first = await ask_for_a_group(c, "Answer with the letter a.")
            # refused at the door: not JSON numbers (400) or not a valid reward (422); none reaches Kafka
            for raw in ('{"trajectory_id": "%s", "reward": NaN}', '{"trajectory_id": "%s", "reward": Infinity}',
                        '{"trajectory_id": "%s", "reward": -Infinity}'):
                assert (await feedback(c, raw % first[0])).status_code == 400
            for bad in (1e200, "1.0", True, 5.0, -3.0):
                r = await feedback(c, {"trajectory_id": first[0], "reward": bad})
                assert r.status_code == 422, (bad, r.text)
            r = await feedback(c, {"trajectory_id": first[0], "reward": 0.5, "components": {"thumbs": 1e200}})
            assert r.status_code == 422, r.text

            sent = 0
            for body in ({"trajectory_id": first[0], "reward": 0.0, "feedback_id": "thumb-a"},
                         {"trajectory_id": first[0], "reward": 1.0, "feedback_id": "thumb-a"},  # correction
                         {"trajectory_id": first[1], "reward": 0.0, "feedback_id": "thumb-b"}):  # completes it
                assert (await feedback(c, body)).status_code == 202
                sent += 1
            await _until_group_left(cfg, names, first)
            # after the group left: recorded (dlq) and counted, never trained
            assert (await feedback(c, {"trajectory_id": first[0], "reward": 0.5,
                                       "feedback_id": "thumb-a"})).status_code == 202
            sent += 1
            second = await ask_for_a_group(c, "Answer with the letter b.")
            for tid, reward in zip(second, (1.0, 0.0)):
                assert (await feedback(c, {"trajectory_id": tid, "reward": reward})).status_code == 202
                sent += 1
            return first, second, sent
    finally:
        await gateway.stop()
        await publisher.close()


async def _until_group_left(cfg: RlstreamConfig, names: TopicNames, ids: list[str]) -> None:
    for _ in range(90):
        groups = await read_groups(cfg, names.groups, timeout_s=2, quiet_s=0.5)
        if any({t.trajectory_id for t in g.trajectories} == set(ids) for g in groups):
            return
    raise AssertionError("the first group never left the stream")
