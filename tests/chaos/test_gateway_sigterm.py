"""SIGTERM to ``rlstream gateway serve`` holding 21,000 open sessions (defaults: a capture queue of 10,000): every
session's trajectory reaches the trajectories topic of the real broker, directly or through the spool (sent by the
gateway restarted on it). The control with a queue-sized burst and no spool is
``tests/integration/test_gateway_shutdown.py``'s no-spool case."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import AsyncIterator

import httpx

from rlstream.ops.ports import free_port
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from tests.chaos.test_gateway_spool import MESSAGES, GatewayProcess, eventually, explained, stats
from tests.support.learner_helpers import read_whole_topic

SESSIONS = 21_000


CANNED = json.dumps({
    "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub", "prompt_token_ids": [1, 2, 3],
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                 "token_ids": [5], "logprobs": {"content": [{"token": "ok", "logprob": -0.5}]}}]}).encode()


async def read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 message with a Content-Length body: (head, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


@contextlib.asynccontextmanager
async def canned_upstream() -> AsyncIterator[str]:
    """A bare asyncio HTTP server answering every request with one canned chat completion (cheap enough that the
    test process can feed the gateway 21,000 calls in reasonable time on a small machine)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        response = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(CANNED)).encode() + b"\r\n\r\n" + CANNED)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_message(reader)
                writer.write(response)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def open_sessions(url: str, n: int, connections: int = 32) -> None:
    """One call in each of ``n`` sessions over ``connections`` keep-alive connections (raw HTTP/1.1: the test
    process's own cost per call stays small); every answer must be a 200."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "stub", "messages": MESSAGES}).encode()
    ids = iter(range(n))

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for index in ids:
                writer.write(f"POST /s/s{index}/v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                             f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                             + body)
                head, answer = await read_message(reader)
                assert head.startswith(b"HTTP/1.1 200"), head + answer
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(connections)))


async def test_sigterm_with_21000_open_sessions_loses_none(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                           tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    # sessions held in the gateway's memory (calls stitched in streams are on the topic as they complete)
    extra = ("--spool-dir", str(spool), "-o", "gateway.max_open_sessions", str(SESSIONS + 1000), "-o",
             "gateway.session_stitching", "gateway")
    first = second = None
    with explained(lambda: (first, second)):
        async with canned_upstream() as upstream, httpx.AsyncClient(timeout=60) as http:
            first = GatewayProcess(rl_config, upstream, free_port(), tmp_path / "gateway-1.log", *extra).start()
            await first.ready(http)
            started = time.monotonic()
            await open_sessions(first.url, SESSIONS)
            opened_s = time.monotonic() - started
            assert (await stats(http, first.url))["open_sessions"] == SESSIONS
            assert first.proc is not None
            os.kill(first.proc.pid, signal.SIGTERM)
            code = await asyncio.to_thread(first.proc.wait, 120)
            assert code == 0, first.log_tail()
            # the stop closed more sessions than the queue holds: the rest went to the spool, not away
            assert "capture queue full: events go to the spool" in first.log_path.read_text(), first.log_tail()
            direct = {e.trajectory_id for e in
                      await read_whole_topic(rl_config, created_topics.trajectories, TrajectoryEvent)}
            spooled = list(spool.glob("*.seg"))
            if len(direct) < SESSIONS:  # the rest is in the spool: a restarted gateway sends it
                assert spooled, f"{SESSIONS - len(direct)} neither on the topic nor in the spool"
                second = GatewayProcess(rl_config, upstream, free_port(), tmp_path / "gateway-2.log", *extra).start()
                await second.ready(http)

                async def spool_sent() -> bool:
                    figures = (await stats(http, second.url))["spool"]
                    return figures["pending"] == 0 and not figures["spooling"]
                await eventually(spool_sent, "the spool sent", 120)
                second.stop()
        events = await read_whole_topic(rl_config, created_topics.trajectories, TrajectoryEvent)
    on_topic = Counter(e.metadata.get("session_id") for e in events)
    assert set(on_topic) == {f"s{i}" for i in range(SESSIONS)}, f"lost: {SESSIONS - len(on_topic)}"
    duplicates = sum(c - 1 for c in on_topic.values())
    assert duplicates == 0, f"{duplicates} sent twice"
    print(f"{SESSIONS} sessions opened in {opened_s:.1f} s; {len(direct)} on the topic when the stopped gateway "
          f"exited")
