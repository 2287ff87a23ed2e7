"""The README's OpenAI Agents SDK example, run as written (a separate process with only OPENAI_BASE_URL and
OPENAI_API_KEY set) against the gateway with an API key in front of real vLLM started as rlstream starts it (tool
calling on): the streamed Responses calls of its tool round trip become one trajectory with exact token ids."""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import httpx

from rlstream.ops.vllm import VllmServer
from rlstream.gateway.app import Gateway
from rlstream.gateway.auth import AccessConfig
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from tests.e2e.vllm_support import SERVED_MODEL, vllm_fixture
from tests.support.learner_helpers import read_topic

vllm = vllm_fixture()
DOC = Path(__file__).resolve().parents[2] / "README.md"
KEY = "example-gateway-key-0123456789"
SESSION = "letters-demo-1"


def documented_example() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- agents-example:start -->\s*```python\n(.*?)```\s*<!-- agents-example:end -->", text,
                      re.S)
    assert match, "the README lost its agents example"
    return match.group(1)


async def test_the_documented_agents_sdk_example_runs_as_written_and_is_captured(
        vllm: VllmServer, rl_config: Any, created_topics: Any, tmp_path: Path) -> None:
    script = tmp_path / "agent_example.py"
    script.write_text(documented_example())
    assert 'model="policy"' in script.read_text() and SERVED_MODEL == "policy"
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    config = GatewaySettings(session_stitching="gateway",
                             port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                           policy_version=1, session_idle_s=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "RLSTREAM_"))}
    async with serving(Gateway(config, publisher, access=AccessConfig(api_keys=[KEY]))) as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), env={**env, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": KEY},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=300)
        assert proc.returncode == 0, err.decode()[-3000:]
        async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {KEY}"}) as http:
            stats = (await http.get(f"{url}/rlstream/stats")).json()
            assert stats["open_sessions"] == 1, stats
            assert (await http.post(f"{url}/v1/sessions/{SESSION}/end")).status_code == 200
            fb = await http.post(f"{url}/v1/feedback", json={"session_id": SESSION, "reward": 1})
            assert fb.status_code == 202, fb.text
    await publisher.close()
    assert out.decode().strip(), err.decode()[-2000:]  # the agent's final answer was printed

    (event,) = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=1)
    assert event.metadata["session_id"].endswith(SESSION)
    assert [m.role for m in event.messages] == ["user", "assistant", "tool", "assistant"]
    (call,) = event.messages[1].tool_calls
    assert call.name == "pick_letter"
    assert event.messages[2].content == json.loads(call.arguments)["letter"] * 3  # the tool's output
    assert len(event.turns) == 2
    for turn in event.turns:  # vLLM's exact tokens, the second prompt extending the first call
        assert turn.prompt_token_ids and turn.completion_token_ids
    assert len(event.turns[1].prompt_token_ids) > len(event.turns[0].prompt_token_ids)
    (reward,) = await read_topic(rl_config, created_topics.rewards, RewardEvent, expect=1)
    assert reward.trajectory_id == event.trajectory_id and reward.reward == 1.0
