"""Support of the gateway fleet tests: canned replicas that log what they were asked; the round-robin load balancer
is the benchmark's (bench/balancer.py)."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from bench.balancer import RoundRobinProxy

__all__ = ["ReplicaLog", "RoundRobinProxy", "canned_replica"]


@dataclass
class ReplicaLog:
    """What one canned replica was asked: (model name, the request's first user message) per request."""

    url: str = ""
    requests: list[tuple[str, str]] = field(default_factory=list)
    responses: list[dict[str, object]] = field(default_factory=list)  # the Responses request bodies, as sent


@contextlib.asynccontextmanager
async def canned_replica(delay_s: float = 0.0) -> AsyncIterator[ReplicaLog]:
    """An OpenAI-compatible replica answering every chat completion after ``delay_s`` with vLLM's token fields,
    recording what it was asked; its Responses API is vLLM's without a store (each request stands alone: a
    ``previous_response_id`` is answered 404), with one prompt token per input item (its text's length) and the
    reply ``turn K`` for an input of K user messages. Response ids are unique across replicas."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    record = ReplicaLog()
    serial = itertools.count()

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        first_user = next((m.get("content", "") for m in body.get("messages", []) if m.get("role") == "user"), "")
        record.requests.append((str(body.get("model")), str(first_user)))
        if delay_s:
            await asyncio.sleep(delay_s)
        return JSONResponse({
            "id": f"chatcmpl-{id(record):x}-{next(serial)}", "object": "chat.completion", "created": 0,
            "model": body.get("model"),
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                         "token_ids": [4, 5], "logprobs": {"content": [{"token": "o", "logprob": -0.5},
                                                                       {"token": "k", "logprob": -0.25}]}}]})

    async def responses(request: Request) -> Response:
        body = await request.json()
        record.responses.append(body)
        if body.get("previous_response_id"):
            return JSONResponse({"error": {"message": f"Response with id '{body['previous_response_id']}' not found.",
                                           "type": "invalid_request_error", "code": 404}}, status_code=404)
        given = body.get("input")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])
        prompt = [len(str(item.get("content") or item.get("arguments") or "")) + 1 for item in items]
        users = sum(1 for item in items if item.get("role") == "user")
        logprobs = [{"token": "turn", "logprob": -0.5}, {"token": f" {users}", "logprob": -0.25}]
        answer = {
            "id": f"resp_{id(record):x}_{next(serial)}", "object": "response", "status": "completed",
            "model": body.get("model"), "previous_response_id": None,
            "output": [{"type": "message", "role": "assistant", "status": "completed", "content": [
                {"type": "output_text", "text": f"turn {users}", "annotations": [], "logprobs": logprobs}]}],
            "input_messages": [{"tokens": prompt}], "output_messages": [{"tokens": [90, 90 + users]}]}
        if not body.get("stream"):
            return JSONResponse(answer)
        created = {**answer, "status": "in_progress", "output": [], "input_messages": None, "output_messages": None}
        events = [{"type": "response.created", "response": created},
                  {"type": "response.output_text.delta", "delta": "turn", "logprobs": logprobs[:1]},
                  {"type": "response.output_text.delta", "delta": f" {users}", "logprobs": logprobs[1:]},
                  {"type": "response.completed", "response": answer}]
        sse = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
        return Response(sse, media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/responses", responses, methods=["POST"])])
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
