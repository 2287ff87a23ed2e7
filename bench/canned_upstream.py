"""A canned OpenAI-compatible upstream for bench/gateway_overhead.py: answers every chat completion at once with a
body shaped like vLLM's (8 completion tokens; token ids and logprobs each when asked, as vLLM returns them), streamed or
not. With it, the benchmark measures the gateway's own work without vLLM's time or its CPU on the same cores.

    .venv/bin/python bench/canned_upstream.py PORT
"""
from __future__ import annotations

import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

PROMPT_IDS = list(range(1, 19))
TOKENS = [("c", 66)] * 7 + [(".", 13)]


def logprob_item(token: str, index: int) -> dict[str, object]:
    return {"token": token, "logprob": -0.125 * (index + 1), "bytes": list(token.encode()), "top_logprobs": []}


def completion(ids: bool, logprobs: bool, model: str) -> bytes:
    text = "".join(token for token, _ in TOKENS)
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "tool_calls": []},
              "logprobs": {"content": [logprob_item(t, i) for i, (t, _) in enumerate(TOKENS)]} if logprobs else None,
              "finish_reason": "length", "stop_reason": None,
              "token_ids": [i for _, i in TOKENS] if ids else None}
    return json.dumps({"id": "chatcmpl-canned", "object": "chat.completion", "created": 0, "model": model,
                       "choices": [choice], "prompt_logprobs": None,
                       "prompt_token_ids": PROMPT_IDS if ids else None,
                       "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(TOKENS),
                                 "total_tokens": len(PROMPT_IDS) + len(TOKENS)}}).encode()


def stream_events(ids: bool, logprobs: bool, model: str) -> list[bytes]:
    head = {"id": "chatcmpl-canned", "object": "chat.completion.chunk", "created": 0, "model": model}
    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
    if ids:
        first["prompt_token_ids"] = PROMPT_IDS
    events = [first]
    for index, (token, token_id) in enumerate(TOKENS):
        last = index == len(TOKENS) - 1
        choice: dict[str, object] = {"index": 0, "delta": {"content": token},
                                     "logprobs": {"content": [logprob_item(token, index)]} if logprobs else None,
                                     "finish_reason": "length" if last else None}
        if ids:
            choice["token_ids"] = [token_id]
        events.append({**head, "choices": [choice]})
    return [f"data: {json.dumps(event)}\n\n".encode() for event in events] + [b"data: [DONE]\n\n"]


async def chat_completions(request: Request) -> Response:
    body = json.loads(await request.body())
    ids, logprobs = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
    model = str(body.get("model", "toy"))
    if body.get("stream"):
        events = stream_events(ids, logprobs, model)

        async def send() -> object:
            for event in events:
                yield event

        return StreamingResponse(send(), media_type="text/event-stream")
    return Response(completion(ids, logprobs, model), media_type="application/json")


async def models(request: Request) -> Response:
    return Response(b'{"object": "list", "data": [{"id": "toy", "object": "model"}]}', media_type="application/json")


app = Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                        Route("/v1/models", models), Route("/health", models)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False,
                loop="uvloop", http="httptools")
