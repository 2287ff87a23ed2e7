"""Support of the gateway fleet tests: canned replicas that log what they were asked; the round-robin load balancer
is the benchmark's (bench/balancer.py)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from bench.balancer import RoundRobinProxy

__all__ = ["ReplicaLog", "RoundRobinProxy", "canned_replica"]


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
