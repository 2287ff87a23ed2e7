"""A canned OpenAI-compatible upstream for bench/gateway_overhead.py: answers every chat completion, legacy completion,
Responses and Anthropic Messages call at once with a body shaped like vLLM's (8 completion tokens; token ids and
logprobs each when asked, as vLLM returns them), streamed or not. With it, the benchmark measures the gateway's own
work without vLLM's time or its CPU on the same cores.

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


def text_completion(ids: bool, logprobs: bool, model: str) -> bytes:
    """A legacy completion shaped like vLLM's (``return_token_ids``: the choice's prompt and completion ids)."""
    choice = {"index": 0, "text": "".join(token for token, _ in TOKENS), "finish_reason": "length", "stop_reason": None,
              "logprobs": completion_logprobs(TOKENS) if logprobs else None,
              "token_ids": [i for _, i in TOKENS] if ids else None, "prompt_token_ids": PROMPT_IDS if ids else None}
    return json.dumps({"id": "cmpl-canned", "object": "text_completion", "created": 0, "model": model,
                       "choices": [choice], "usage": {"prompt_tokens": len(PROMPT_IDS),
                                                      "completion_tokens": len(TOKENS),
                                                      "total_tokens": len(PROMPT_IDS) + len(TOKENS)}}).encode()


def completion_logprobs(tokens: list[tuple[str, int]], start: int = 0) -> dict[str, object]:
    return {"tokens": [t for t, _ in tokens], "token_logprobs": [-0.125 * (start + i + 1) for i in range(len(tokens))],
            "top_logprobs": [None] * len(tokens), "text_offset": list(range(start, start + len(tokens)))}


def text_completion_events(ids: bool, logprobs: bool, model: str) -> list[bytes]:
    events = []
    for index, (token, token_id) in enumerate(TOKENS):
        choice: dict[str, object] = {"index": 0, "text": token,
                                     "logprobs": completion_logprobs([(token, token_id)], index) if logprobs else None,
                                     "finish_reason": "length" if index == len(TOKENS) - 1 else None,
                                     "token_ids": [token_id] if ids else None}
        if ids and index == 0:
            choice["prompt_token_ids"] = PROMPT_IDS
        events.append({"id": "cmpl-canned", "object": "text_completion", "created": 0, "model": model,
                       "choices": [choice]})
    return [f"data: {json.dumps(event)}\n\n".encode() for event in events] + [b"data: [DONE]\n\n"]


def response_object(messages: bool, logprobs: bool, model: str) -> dict[str, object]:
    """A Responses result shaped like vLLM's (``enable_response_messages``: the exact token ids)."""
    text = "".join(token for token, _ in TOKENS)
    part = {"type": "output_text", "text": text, "annotations": [],
            "logprobs": [{"token": t, "logprob": -0.125 * (i + 1), "top_logprobs": []}
                         for i, (t, _) in enumerate(TOKENS)] if logprobs else None}
    return {"id": "resp_canned", "object": "response", "created_at": 0, "model": model, "status": "completed",
            "output": [{"type": "message", "id": "msg_canned", "role": "assistant", "status": "completed",
                        "content": [part]}], "top_logprobs": 0 if logprobs else None,
            "input_messages": [{"type": "raw_message_tokens", "message": "", "tokens": PROMPT_IDS}] if messages
            else None,
            "output_messages": [{"type": "raw_message_tokens", "message": text, "tokens": [i for _, i in TOKENS]}]
            if messages else None,
            "usage": {"input_tokens": len(PROMPT_IDS), "output_tokens": len(TOKENS),
                      "total_tokens": len(PROMPT_IDS) + len(TOKENS)}}


def response_events(messages: bool, logprobs: bool, model: str) -> list[bytes]:
    done = response_object(messages, logprobs, model)
    events: list[dict[str, object]] = [{"type": "response.created", "sequence_number": 0,
                                        "response": {**done, "status": "in_progress", "output": []}}]
    for index, (token, _) in enumerate(TOKENS):
        events.append({"type": "response.output_text.delta", "sequence_number": index + 1, "item_id": "msg_canned",
                       "output_index": 0, "content_index": 0, "delta": token,
                       "logprobs": [{"token": token, "logprob": -0.125 * (index + 1), "top_logprobs": []}]
                       if logprobs else []})
    events.append({"type": "response.completed", "sequence_number": len(TOKENS) + 1, "response": done})
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


def anthropic_message(model: str) -> bytes:
    """A Messages answer as vLLM's /v1/messages writes it (the baseline of the gateway's /v1/messages)."""
    return json.dumps({"id": "msg_canned", "type": "message", "role": "assistant", "model": model,
                       "content": [{"type": "text", "text": "".join(token for token, _ in TOKENS)}],
                       "stop_reason": "max_tokens", "stop_sequence": None,
                       "usage": {"input_tokens": len(PROMPT_IDS), "output_tokens": len(TOKENS)}}).encode()


def anthropic_events(model: str) -> list[bytes]:
    def event(kind: str, data: dict[str, object]) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    start = {"id": "msg_canned", "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(PROMPT_IDS), "output_tokens": 0}}
    return [event("message_start", {"message": start}),
            event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            *(event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": token}})
              for token, _ in TOKENS),
            event("content_block_stop", {"index": 0}),
            event("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                    "usage": {"input_tokens": len(PROMPT_IDS), "output_tokens": len(TOKENS)}}),
            event("message_stop", {})]


def answer(stream: bool, events: list[bytes], whole: bytes) -> Response:
    if stream:
        async def send() -> object:
            for event in events:
                yield event

        return StreamingResponse(send(), media_type="text/event-stream")
    return Response(whole, media_type="application/json")


async def completions(request: Request) -> Response:
    body = json.loads(await request.body())
    ids, logprobs = bool(body.get("return_token_ids")), body.get("logprobs") is not None
    model = str(body.get("model", "toy"))
    stream = bool(body.get("stream"))
    return answer(stream, text_completion_events(ids, logprobs, model) if stream else [],
                  b"" if stream else text_completion(ids, logprobs, model))


async def responses(request: Request) -> Response:
    body = json.loads(await request.body())
    messages = body.get("enable_response_messages") is True
    logprobs = "message.output_text.logprobs" in (body.get("include") or [])
    model = str(body.get("model", "toy"))
    stream = bool(body.get("stream"))
    return answer(stream, response_events(messages, logprobs, model) if stream else [],
                  b"" if stream else json.dumps(response_object(messages, logprobs, model)).encode())


async def messages(request: Request) -> Response:
    body = json.loads(await request.body())
    model = str(body.get("model", "toy"))
    stream = bool(body.get("stream"))
    return answer(stream, anthropic_events(model) if stream else [], b"" if stream else anthropic_message(model))


async def models(request: Request) -> Response:
    return Response(b'{"object": "list", "data": [{"id": "toy", "object": "model"}]}', media_type="application/json")


app = Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                        Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/responses", responses, methods=["POST"]),
                        Route("/v1/messages", messages, methods=["POST"]),
                        Route("/v1/models", models), Route("/health", models)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False,
                loop="uvloop", http="httptools")
