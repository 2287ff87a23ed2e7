"""Production for NAT users: a workflow served by the real ``nat serve`` whose ``training_llm`` is the rlstream
gateway (``_type: rlstream_gateway``) is captured one NAT request per gateway session; feedback by session
id rewards it (tier ``nat``)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rlstream.ops.ports import free_port
from rlstream.ops.vllm import VllmServer
from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from tests.e2e.vllm_support import SERVED_MODEL, vllm_fixture
from tests.support.learner_helpers import read_topic

pytestmark = pytest.mark.nat
vllm = vllm_fixture()
REQUESTS = {"nat-request-1": "Repeat the letter c.", "nat-request-2": "Say d again and again."}


async def wait_serving(url: str, proc: subprocess.Popen[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"nat serve exited with {proc.returncode}"
            try:
                if (await http.get(f"{url}/health")).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"nat serve did not answer at {url}")


async def test_nat_serve_requests_are_captured_one_per_session_and_rewarded(
    vllm: VllmServer, rl_config: Any, created_topics: Any, tmp_path: Path,
) -> None:
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    gateway = GatewaySettings(session_stitching="gateway",
                              port=0, upstream_url=vllm.url, run_id=rl_config.run_id, policy=rl_config.policy,
                            served_model=SERVED_MODEL, session_idle_s=120)
    async with serving(Gateway(gateway, publisher)) as gateway_url:
        config = tmp_path / "serve.yml"
        config.write_text(yaml.safe_dump({
            "llms": {"training_llm": {"_type": "rlstream_gateway", "model_name": SERVED_MODEL,
                                      "base_url": f"{gateway_url}/v1", "api_key": "default", "temperature": 1.0,
                                      "task": "letters"}},
            "workflow": {"_type": "rlstream_toy_letters", "llm": "training_llm", "max_tokens": 6}}))
        port = free_port()
        nat = Path(sys.executable).with_name("nat")
        log = (tmp_path / "nat-serve.log").open("w")
        proc = subprocess.Popen([str(nat), "serve", "--config_file", str(config), "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            await wait_serving(f"http://127.0.0.1:{port}", proc)
            async with httpx.AsyncClient(timeout=120) as http:
                for run_id, question in REQUESTS.items():
                    r = await http.post(f"http://127.0.0.1:{port}/generate", json={"question": question},
                                        headers={"workflow-run-id": run_id})
                    assert r.status_code == 200, r.text
                for run_id in REQUESTS:  # close the sessions now rather than after session_idle_s
                    assert (await http.post(f"{gateway_url}/v1/sessions/{run_id}/end")).status_code == 200
                fb = await http.post(f"{gateway_url}/v1/feedback",
                                     json={"session_id": "nat-request-1", "reward": 0.75})
                assert fb.status_code == 202, fb.text
                unknown = await http.post(f"{gateway_url}/v1/feedback", json={"session_id": "never", "reward": 1})
                assert unknown.status_code == 404
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
    await publisher.close()

    events = [e for e in await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, len(REQUESTS))
              if e.run_id == rl_config.run_id]
    by_session = {e.metadata.get("session_id"): e for e in events}
    assert len(events) == len(REQUESTS) and set(by_session) == set(REQUESTS)  # one trajectory per NAT request
    for run_id, question in REQUESTS.items():
        event = by_session[run_id]
        assert event.messages[0].content == question and event.messages[-1].role == "assistant"
        turn = event.turns[0]
        assert turn.prompt_token_ids and turn.completion_token_ids  # the gateway's token-in, token-out
        assert len(turn.completion_logprobs) == len(turn.completion_token_ids)
    rewards = [r for r in await read_topic(rl_config, created_topics.rewards, RewardEvent, 1)
               if r.trajectory_id == by_session["nat-request-1"].trajectory_id]
    assert [r.reward for r in rewards] == [0.75]
