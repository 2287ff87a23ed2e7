"""A scripted OpenAI-compatible upstream: a starlette app on a free port whose chat completions a test's policy
writes (a function of the request body), for tests of episode logic that need no real model."""
from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

#: what a policy returns for a request: a chat.completion body, or an HTTP status to answer with instead
Reply = dict[str, Any] | int
Policy = Callable[[dict[str, Any]], Reply]


@dataclass
class UpstreamLog:
    """The upstream's ``url`` (``.../v1``) and every request body it was sent."""

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)


def completion(model: str, content: str | None = None, tool_calls: list[dict[str, Any]] | None = None,
               completion_tokens: int = 8) -> dict[str, Any]:
    """A chat.completion body with one choice: ``content``, or the tool calls (``{"name", "arguments"}`` each)."""
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str)
                           else json.dumps(c["arguments"])}} for i, c in enumerate(tool_calls or [])]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": 16, "completion_tokens": completion_tokens,
                      "total_tokens": 16 + completion_tokens}}


@contextlib.asynccontextmanager
async def scripted_upstream(policy: Policy) -> AsyncIterator[UpstreamLog]:
    """Serve ``POST /v1/chat/completions`` answered by ``policy(body)`` until the block ends."""
    import asyncio

    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    record = UpstreamLog()

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        record.requests.append(body)
        reply = policy(body)
        if isinstance(reply, int):
            return JSONResponse({"error": {"message": f"scripted status {reply}", "type": "scripted"}},
                                status_code=reply)
        return JSONResponse(reply)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "scripted upstream did not start"
        await asyncio.sleep(0.02)
    record.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    try:
        yield record
    finally:
        server.should_exit = True
        await task


def closed_url() -> str:
    """A ``.../v1`` URL on a local port nothing listens on (connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"
