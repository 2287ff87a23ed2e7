"""A round-robin TCP load balancer for the gateway fleet tests: each new connection goes to the next backend that
accepts it (a backend that refuses, e.g. a killed gateway, is skipped as a load balancer's health check would)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


class RoundRobinProxy:
    """Listens on 127.0.0.1 and pipes each connection to the next of ``backends`` ((host, port) pairs)."""

    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self.next = 0
        self.connections: list[int] = [0] * len(backends)  # connections handed to each backend
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def _pick(self) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
        for _ in range(len(self.backends)):
            index = self.next % len(self.backends)
            self.next += 1
            host, port = self.backends[index]
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                continue
            return index, reader, writer
        raise ConnectionError("no backend accepts connections")

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            index, reader, writer = await self._pick()
        except ConnectionError:
            client_writer.close()
            return
        self.connections[index] += 1
        await asyncio.gather(self._pipe(client_reader, writer), self._pipe(reader, client_writer))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator["RoundRobinProxy"]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class ReplicaLog:
    """What one canned replica was asked: (model name, the request's first user message) per request."""

    url: str = ""
    requests: list[tuple[str, str]] = field(default_factory=list)


@contextlib.asynccontextmanager
async def canned_replica(delay_s: float = 0.0) -> AsyncIterator[ReplicaLog]:
    """An OpenAI-compatible replica answering every chat completion after ``delay_s`` with vLLM's token fields,
    recording what it was asked."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    record = ReplicaLog()

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        first_user = next((m.get("content", "") for m in body.get("messages", []) if m.get("role") == "user"), "")
        record.requests.append((str(body.get("model")), str(first_user)))
        if delay_s:
            await asyncio.sleep(delay_s)
        return JSONResponse({
            "id": "chatcmpl-canned", "object": "chat.completion", "created": 0, "model": body.get("model"),
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                         "token_ids": [4, 5], "logprobs": {"content": [{"token": "o", "logprob": -0.5},
                                                                       {"token": "k", "logprob": -0.25}]}}]})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "canned replica did not start"
        await asyncio.sleep(0.02)
    record.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        yield record
    finally:
        server.should_exit = True
        await task
