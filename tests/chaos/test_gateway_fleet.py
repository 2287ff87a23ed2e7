"""Two gateways (`rlstream gateway serve`, real processes) behind a round-robin load balancer, a session's calls
alternating between them, one gateway SIGKILLed in the middle of every session: with sessions stitched in the stream
app (a real worker over the real broker) every session is one whole trajectory, none lost, none twice. The control
holds sessions in each gateway's memory: the same traffic gives broken trajectories and loses the killed gateway's
open sessions."""
from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest

from rlstream.ops.ports import free_port
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.sessions import session_trajectory_id
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from tests.chaos.test_gateway_spool import GatewayProcess, eventually, explained, stats, stub_upstream
from tests.support.fleet_support import RoundRobinProxy
from tests.support.streams_helpers import Worker, read_all

SESSIONS = 7  # odd: with one connection per call, round robin alternates each session's calls between the gateways
TURNS = 4
KILLED_AFTER = 2  # turns of every session before the first gateway is SIGKILLed


async def converse(http: httpx.AsyncClient, url: str, session: str, history: list[dict[str, str]], turn: int) -> None:
    """One call of ``session`` on a new connection (so the balancer picks the next gateway); the reply joins the
    history the next call sends, as an agent's client does."""
    history.append({"role": "user", "content": f"step {turn}"})
    answer = await http.post(f"{url}/v1/chat/completions", headers={"x-session-id": session, "connection": "close"},
                             json={"model": "policy", "messages": history})
    assert answer.status_code == 200, answer.text
    history.append(answer.json()["choices"][0]["message"])


async def captured_all(http: httpx.AsyncClient, gateway: GatewayProcess) -> bool:
    capture = (await stats(http, gateway.url))["capture"]
    return capture["acknowledged"] >= capture["queued"]


@pytest.mark.parametrize("stitching", ["streams", "gateway"], ids=["streams", "in-gateway-control"])
async def test_two_gateways_one_killed_mid_session(rl_config: RlstreamConfig, tmp_path: Path, stitching: str) -> None:
    await prepare_topics(rl_config)
    names = TopicNames.from_config(rl_config.topics)
    worker = Worker(rl_config, "w1", tmp_path, **{"streams.session_idle_s": 120}).start() if (
        stitching == "streams") else None
    gateways: list[GatewayProcess] = []
    try:
        with explained(lambda: tuple(gateways)):
            async with stub_upstream() as upstream, httpx.AsyncClient(timeout=30) as http:
                ports = [free_port(), free_port()]
                gateways = [GatewayProcess(rl_config, upstream, port, tmp_path / f"gateway-{i}.log",
                                           "-o", "gateway.session_stitching", stitching, "--gateway-id", f"g{i}",
                                           "-o", "gateway.session_idle_s", "600", "-o", "gateway.spool", "false"
                                           ).start()
                            for i, port in enumerate(ports)]
                for gateway in gateways:
                    await gateway.ready(http)
                sessions = {f"fleet-{stitching}-{i}": [{"role": "system", "content": "be brief"}]
                            for i in range(SESSIONS)}
                async with RoundRobinProxy([("127.0.0.1", p) for p in ports]).running() as proxy:
                    for turn in range(TURNS):
                        if turn == KILLED_AFTER:  # mid-session: its calls so far acknowledged, then SIGKILL
                            await eventually(lambda: captured_all(http, gateways[0]), "g0's calls on Kafka", 30)
                            gateways[0].kill()
                        for session, history in sessions.items():
                            await converse(http, proxy.url, session, history, turn)
                    assert proxy.connections[0] >= SESSIONS and proxy.connections[1] >= SESSIONS
                    for session in sessions:
                        ended = await http.post(f"{proxy.url}/v1/sessions/{session}/end",
                                                headers={"connection": "close"})
                        assert ended.status_code in (200, 202), ended.text
                got = await read_all(rl_config, names.trajectories, TrajectoryEvent, expect=SESSIONS, timeout_s=60,
                                     quiet_s=3)
                trajectories = [t for _, t in got if t.metadata.get("session_id") in sessions]
                per_session = Counter(t.metadata["session_id"] for t in trajectories)
                whole = [t for t in trajectories if len(t.turns) == TURNS]
                if stitching == "gateway":  # the control: sessions broken into pieces, the killed gateway's lost
                    assert len(whole) < SESSIONS and sum(len(t.turns) for t in trajectories) < SESSIONS * TURNS
                    return
                assert per_session == Counter({s: 1 for s in sessions}), per_session
                assert len(whole) == SESSIONS
                for t in trajectories:
                    assert t.trajectory_id == session_trajectory_id(t.metadata["session_id"])
                    assert t.metadata["gateways"] == "g0,g1"  # its calls went through both gateways
                    assert [m.content for m in t.messages if m.role == "user"] == [f"step {i}" for i in range(TURNS)]
                assert worker is not None and worker.alive(), worker.log_tail()
    finally:
        for gateway in gateways:
            gateway.stop()
        if worker is not None:
            worker.stop()
