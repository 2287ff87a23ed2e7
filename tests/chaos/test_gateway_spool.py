"""The capture gateway's durable capture against a real broker (noida-db) that goes away: trajectories wait in the
on-disk spool and reach their topic exactly once when the broker is back, also when the gateway itself was SIGKILLed
meanwhile. The gateway runs as a process (`rlstream gateway serve`), so every step of a test is bounded by the test's
own waits and a process stop (an earlier in-process version of the outage test hung past pytest's limit once). The
upstream is a tiny OpenAI-compatible stub (the thing under test is the gateway's capture, not vLLM)."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rlstream.ops.infra import ServiceProcess, start_kafka
from rlstream.ops.ports import free_port
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from rlstream.transport.kafka import create_topics
from tests.support.child_process import ChildProcess
from tests.support.learner_helpers import read_whole_topic

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say ok."}]


# --- the upstream: a fixed chat completion with vLLM's token fields -------------------------------------------
async def _completion(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({
        "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": body.get("model", "stub"),
        "prompt_token_ids": [1, 2, 3, 4],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                     "token_ids": [5, 6], "logprobs": {"content": [{"token": "o", "logprob": -0.5},
                                                                   {"token": "k", "logprob": -0.25}]}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}})


async def _models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})


@contextlib.asynccontextmanager
async def stub_upstream() -> AsyncIterator[str]:
    app = Starlette(routes=[Route("/v1/chat/completions", _completion, methods=["POST"]),
                            Route("/v1/models", _models, methods=["GET"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "stub upstream did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


# --- a broker of the test's own (stopped and restarted on the same port and data dir) -------------------------
class Broker:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir, self.port = data_dir, free_port()
        self.proc: ServiceProcess | None = None

    async def start(self) -> "Broker":
        self.proc = await asyncio.to_thread(start_kafka, self.data_dir, self.port)
        return self

    async def stop(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop)
            self.proc = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def own_broker(rl_config: RlstreamConfig, tmp_path: Path) -> tuple[Broker, RlstreamConfig, TopicNames]:
    broker = await Broker(tmp_path / "broker").start()
    cfg = rl_config.model_copy(deep=True)
    cfg.kafka.bootstrap_servers = broker.address
    cfg.kafka.request_timeout_ms = 5000
    await create_topics(cfg.kafka, cfg.topics)
    return broker, cfg, TopicNames.from_config(cfg.topics)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not reached within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.2)


async def stats(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    return (await http.get(f"{url}/rlstream/stats")).json()


async def chat_burst(http: httpx.AsyncClient, url: str, n: int, concurrency: int = 20) -> tuple[list[str], float]:
    """``n`` chat completions, ``concurrency`` at a time; every one must be a 200. Returns the trajectory ids and
    the slowest response's seconds."""
    ids: list[str] = []
    slowest = 0.0
    for start in range(0, n, concurrency):
        async def one() -> tuple[str, float]:
            t0 = time.monotonic()
            r = await http.post(f"{url}/v1/chat/completions", json={"model": "stub", "messages": MESSAGES})
            assert r.status_code == 200, r.text
            return r.headers["x-rlstream-trajectory-id"], time.monotonic() - t0
        for tid, seconds in await asyncio.gather(*(one() for _ in range(min(concurrency, n - start)))):
            ids.append(tid)
            slowest = max(slowest, seconds)
    return ids, slowest


async def _acked(http: httpx.AsyncClient, url: str, n: int) -> bool:
    return (await stats(http, url))["capture"]["acknowledged"] >= n


async def _spool_empty(http: httpx.AsyncClient, url: str) -> bool:
    spool = (await stats(http, url))["spool"]
    return spool["pending"] == 0 and not spool["spooling"]


# --- the gateway as a process, SIGKILLed ------------------------------------------------------------------------
class GatewayProcess(ChildProcess):
    """``rlstream gateway serve`` as a child process in its own session."""

    def __init__(self, cfg: RlstreamConfig, upstream: str, port: int, log_path: Path, *extra: str) -> None:
        overrides = {"kafka.bootstrap_servers": cfg.kafka.bootstrap_servers, "kafka.request_timeout_ms": "5000",
                     "topics.prefix": cfg.topics.prefix, "topics.partitions": str(cfg.topics.partitions),
                     "run_id": cfg.run_id, "policy": cfg.policy}
        cmd = [sys.executable, "-m", "rlstream.cli", "--log-format", "json", "gateway", "serve",
               "--upstream", upstream, "--port", str(port), "-o", "gateway.route_versions", "false",
               "-o", "gateway.spool_after_s", "1", *extra]
        for key, value in overrides.items():
            cmd += ["-o", key, value]
        super().__init__(cmd, log_path, env={"XDG_STATE_HOME": str(log_path.parent / "state")})
        self.url = f"http://127.0.0.1:{port}"

    async def ready(self, http: httpx.AsyncClient, timeout_s: float = 40.0) -> None:
        async def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log_tail()
            with contextlib.suppress(httpx.HTTPError):
                return (await http.get(f"{self.url}/health")).status_code == 200
            return False
        await eventually(up, "the gateway answers /health", timeout_s)

    def shown(self, line: str) -> bool:
        """Not access lines, nor the client's reconnect noise."""
        return "Unable connect" not in line and '"GET /' not in line and '"POST /' not in line

    def log_tail(self, n: int = 40) -> str:
        return super().log_tail(n)


@contextlib.contextmanager
def explained(processes: Callable[[], tuple[GatewayProcess | None, ...]]) -> Iterator[None]:
    """A failed assertion carries the gateways' log tails."""
    try:
        yield
    except AssertionError as exc:
        tails = "\n".join(f"--- {p.log_path.name}\n{p.log_tail()}" for p in processes() if p is not None)
        raise AssertionError(f"{exc}\n{tails}") from exc


@pytest.mark.parametrize("spool", [True, False], ids=["spool", "no-spool-control"])
async def test_gateway_sigkilled_with_a_full_spool_loses_nothing(rl_config: RlstreamConfig, tmp_path: Path,
                                                                 spool: bool) -> None:
    """Broker down, 100 captured calls, gateway SIGKILLed; broker back, gateway restarted on the same spool: all 100
    arrive, once each. The control without a spool shows the test can fail: those 100 are gone."""
    n = 100
    broker, cfg, topics = await own_broker(rl_config, tmp_path)
    port = free_port()
    extra = ("--spool-dir", str(tmp_path / "spool")) if spool else ("-o", "gateway.spool", "false")
    first = second = None
    try:
        with explained(lambda: (first, second)):
            async with stub_upstream() as upstream, httpx.AsyncClient(timeout=30) as http:
                first = GatewayProcess(cfg, upstream, port, tmp_path / "gateway-1.log", *extra).start()
                await first.ready(http)
                await broker.stop()
                ids, slowest = await chat_burst(http, first.url, n)
                assert slowest < 3.0, f"a response waited {slowest:.1f} s on capture"
                if spool:  # all of them on disk
                    await eventually(lambda: _spool_holds(http, first.url, n), f"{n} events in the spool", 30)
                else:  # all of them captured (in memory)
                    await eventually(lambda: _queued(http, first.url, n), f"{n} events captured", 10)
                first.kill()

                await broker.start()
                second = GatewayProcess(cfg, upstream, port, tmp_path / "gateway-2.log", *extra).start()
                await second.ready(http)
                if spool:
                    await eventually(lambda: _acked(http, second.url, n), f"{n} spooled events acknowledged", 60)
                    await eventually(lambda: _spool_empty(http, second.url), "the spool drained", 20)
                else:
                    await asyncio.sleep(3)  # what a restarted gateway would have sent by now
                second.stop()
                assert second.proc is not None and second.proc.returncode == 0, second.log_tail()
            trajectories = await read_whole_topic(cfg, topics.trajectories, TrajectoryEvent)
    finally:
        for gw in (first, second):
            if gw is not None:
                gw.stop()
        await broker.stop()
    on_topic = Counter(e.trajectory_id for e in trajectories)
    with explained(lambda: (first, second)):
        if not spool:
            assert len(set(ids) & set(on_topic)) < n, "without a spool a SIGKILL during an outage must lose events"
            return
        assert set(on_topic) == set(ids), f"lost: {len(set(ids) - set(on_topic))}"
        assert max(on_topic.values()) == 1 and len(trajectories) == n, \
            f"duplicates: {sum(c - 1 for c in on_topic.values())}"
        assert list((tmp_path / "spool").glob("*.seg")) == []


async def _spool_holds(http: httpx.AsyncClient, url: str, n: int) -> bool:
    return (await stats(http, url))["spool"]["pending"] >= n


async def _queued(http: httpx.AsyncClient, url: str, n: int) -> bool:
    return (await stats(http, url))["capture"]["queued"] >= n


async def test_broker_down_for_200_requests_then_back_every_event_once(rl_config: RlstreamConfig,
                                                                      tmp_path: Path) -> None:
    """The broker stopped for the length of 200 requests: every request is answered at once, and once the broker is
    back all 200 trajectories (and the rewards given during the outage) are on their topics, each once."""
    n, rewarded = 200, 40
    broker, cfg, topics = await own_broker(rl_config, tmp_path)
    gateway = None
    try:
        with explained(lambda: (gateway,)):
            async with stub_upstream() as upstream, httpx.AsyncClient(timeout=30) as http:
                gateway = GatewayProcess(cfg, upstream, free_port(), tmp_path / "gateway.log",
                                         "--spool-dir", str(tmp_path / "spool")).start()
                await gateway.ready(http)
                await broker.stop()
                ids, slowest = await chat_burst(http, gateway.url, n)
                assert slowest < 3.0, f"a response waited {slowest:.1f} s on capture"
                for tid in ids[:rewarded]:  # feedback during the outage too
                    r = await http.post(f"{gateway.url}/v1/feedback", json={"trajectory_id": tid, "reward": 0.5})
                    assert r.status_code == 202, r.text
                await eventually(lambda: _spool_holds(http, gateway.url, n), f"{n} events in the spool", 30)
                await broker.start()
                await eventually(lambda: _acked(http, gateway.url, n + rewarded),
                                 f"{n + rewarded} events acknowledged after the broker came back", 90)
                await eventually(lambda: _spool_empty(http, gateway.url), "the spool drained", 30)
                gateway.stop()
                assert gateway.proc is not None and gateway.proc.returncode == 0, gateway.log_tail()
            trajectories = await read_whole_topic(cfg, topics.trajectories, TrajectoryEvent)
            rewards = await read_whole_topic(cfg, topics.rewards, RewardEvent)
    finally:
        if gateway is not None:
            gateway.stop()
        await broker.stop()
    on_topic = Counter(e.trajectory_id for e in trajectories)
    assert set(on_topic) == set(ids), f"lost: {len(set(ids) - set(on_topic))}"
    assert max(on_topic.values()) == 1 and len(trajectories) == n, f"duplicates: {len(trajectories) - n}"
    rewarded_ids = Counter(r.trajectory_id for r in rewards)
    assert set(rewarded_ids) == set(ids[:rewarded]) and max(rewarded_ids.values()) == 1
