"""`rlstream gateway serve` sends the upstream's API key (vLLM's --api-key) from the CLI, its own environment variable
or the config's inference.api_key, and never writes it (nor an upstream URL password) to its log. The upstream is a
canned one that records the Authorization header it gets."""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from rlstream.ops.ports import free_port
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from tests.chaos.test_gateway_sigterm import CANNED, read_message
from tests.chaos.test_gateway_spool import MESSAGES, GatewayProcess


@contextlib.asynccontextmanager
async def recording_upstream(seen: list[str]) -> AsyncIterator[int]:
    """A canned chat upstream that appends each POST's Authorization header (or "") to ``seen`` (the gateway's GET
    of ``/v1/models``, where it reads the upstream's default temperature, is answered but not recorded)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head, _ = await read_message(reader)
                auth = [line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                        if line.lower().startswith(b"authorization:")]
                if head.startswith(b"POST "):
                    seen.append(auth[0] if auth else "")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(CANNED)).encode() + b"\r\n\r\n" + CANNED)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@pytest.mark.parametrize("how", ["cli", "gateway-env", "inference-config-env", "url-password"])
async def test_gateway_sends_the_upstream_key_and_never_logs_it(rl_config: RlstreamConfig, created_topics: TopicNames,
                                                                tmp_path: Path, how: str) -> None:
    key = f"upstream-key-{how}-7f3a9c"
    seen: list[str] = []
    async with recording_upstream(seen) as port:
        upstream = f"http://127.0.0.1:{port}"
        extra: tuple[str, ...] = ("-o", "gateway.spool", "false")
        env: dict[str, str] = {}
        if how == "cli":
            extra += ("--upstream-api-key", key)
        elif how == "gateway-env":
            env["RLSTREAM_GATEWAY_UPSTREAM_API_KEY"] = key
        elif how == "inference-config-env":
            env["RLSTREAM_INFERENCE__API_KEY"] = key
        else:  # a password inside the upstream URL: sent as basic auth, never shown
            upstream = f"http://alice:{key}@127.0.0.1:{port}"
        gateway = GatewayProcess(rl_config, upstream, free_port(), tmp_path / "gateway.log", *extra)
        gateway.env.update(env)
        gateway.start()
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                await gateway.ready(http)
                r = await http.post(f"{gateway.url}/v1/chat/completions", json={"model": "stub", "messages": MESSAGES})
                assert r.status_code == 200, r.text
        finally:
            gateway.stop()
    logged = gateway.log_path.read_text()
    assert key not in logged, [line for line in logged.splitlines() if key in line][:3]
    if how == "url-password":
        assert seen and seen[0].startswith("Basic ") and "alice:**********@" in logged
    else:
        assert seen == [f"Bearer {key}"]
    assert "gateway on http" in logged  # the start line was written (masked)
