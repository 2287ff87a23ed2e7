"""``POST /v1/messages`` (also under ``/s/{session_id}``): the Anthropic Messages API, streamed or not, tools
included, captured with vLLM's exact token ids and logprobs.

vLLM serves ``/v1/messages`` by turning the request into a chat completion, and its Messages request has no field
that returns token ids or logprobs. So the gateway makes the same translation itself: the Messages request becomes a
chat completion request (``system`` a system message, ``tool_use`` blocks tool calls, ``tool_result`` blocks tool
messages, ``tools`` function tools, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` as ``auto`` /
``required`` / a named function / ``none``, ``stop_sequences`` ``stop``), sent to the upstream's
``/v1/chat/completions`` asking for token ids and logprobs like any chat call, and the answer goes back in the
Messages shape (content blocks ``thinking`` / ``text`` / ``tool_use``, ``stop_reason``, ``usage``; streamed as
``message_start``, ``content_block_*``, ``message_delta``, ``message_stop`` events) as vLLM's own translation writes
it. Errors are answered in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``) with the status the
gateway or the upstream gave.
"""
from __future__ import annotations

import contextlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlstream.gateway.auth import Principal
from rlstream.gateway.core import Gateway, request_session, upstream_json
from rlstream.gateway.filtering import rejects_extensions, upstream_request
from rlstream.gateway.limits import RequestRejected, RequestShape, checked_body
from rlstream.gateway.relay import CapturedAtDone, first_data_event, read_head, relayed
from rlstream.gateway.sessions import Trajectory
from rlstream.rollout.capture import token_data
from rlstream.rollout.streaming import StreamAccumulator
from rlstream.transport.log import get_logger

log = get_logger(__name__)
ROUTE = "messages"

#: Anthropic's error type for each status the gateway or the upstream answers
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> JSONResponse:
    """An error in the Anthropic API's shape (its SDK reads ``error.type`` and ``error.message``)."""
    kind = ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def as_anthropic_error(response: Response) -> Response:
    """An error response of the gateway's or the upstream's (OpenAI's shape, or any body) in Anthropic's shape, with
    its status."""
    message = f"the upstream answered {response.status_code}"
    with contextlib.suppress(ValueError, RecursionError, AttributeError, TypeError):
        body = json.loads(bytes(response.body))
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("message"):
            message = str(error["message"])
        elif isinstance(body, dict) and body.get("message"):
            message = str(body["message"])
    return anthropic_error(response.status_code, message)


# --- the request: Messages -> chat completion ------------------------------------------------------------------
def _text_of(blocks: Any) -> str:
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list):
        return "".join(str(b.get("text") or "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result(block: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a user's ``tool_result`` block: its text as a tool message (and its images after it)."""
    content = block.get("content")
    images: list[str] = []
    if isinstance(content, list):
        images = [_image_url(item.get("source") or {}) for item in content
                  if isinstance(item, dict) and item.get("type") == "image"]
        text = "\n".join(str(item.get("text", "")) for item in content
                         if isinstance(item, dict) and item.get("type") == "text")
    else:
        text = content if isinstance(content, str) else ""
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                                  "content": text}]
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    return out


def _message(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of one Messages message (raises ValueError for one it cannot read)."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant", "system"):
        raise ValueError(f"message role must be user, assistant or system, not {role!r}")
    if role == "system":
        text = _text_of(content)
        return [{"role": "system", "content": text}] if text else []
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValueError("message content is a string or a list of content blocks")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    before: list[dict[str, Any]] = []  # tool messages go before the user's own message
    for block in content:
        if not isinstance(block, dict):
            raise ValueError(f"content block is not an object: {block!r}")
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": str(block["text"])})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            calls.append({"id": str(block.get("id") or f"call_{secrets.token_hex(8)}"), "type": "function",
                          "function": {"name": str(block.get("name") or ""),
                                       "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result":
            if role == "user":
                before.extend(_tool_result(block))
            else:
                parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    out: dict[str, Any] = {"role": role}
    if reasoning:
        out["reasoning"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    if parts:
        out["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    elif not calls and not reasoning:
        return before
    return before + [out]


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request of a Messages request (raises ValueError for one it cannot read)."""
    messages: list[dict[str, Any]] = []
    system = _text_of(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    given = body.get("messages")
    if not isinstance(given, list):
        raise ValueError("a Messages request has a 'messages' list")
    for message in given:
        if not isinstance(message, dict):
            raise ValueError(f"message is not an object: {message!r}")
        messages.extend(_message(message))
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError("max_tokens is a positive whole number")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens}
    for name, to in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                     ("stop_sequences", "stop")):
        if body.get(name) is not None:
            chat[to] = body[name]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        mapped: Any = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
        if kind == "tool":
            if not choice.get("name"):
                raise ValueError("tool_choice.name is required when its type is 'tool'")
            mapped = {"type": "function", "function": {"name": choice["name"]}}
        if mapped is None:
            raise ValueError(f"tool_choice type must be auto, any, tool or none, not {kind!r}")
        chat["tool_choice"] = mapped
        if choice.get("disable_parallel_tool_use") is not None:
            chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [{"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"),
            "parameters": {"type": "object", **(tool.get("input_schema") or {})}}}
            for tool in tools if isinstance(tool, dict)]
        chat.setdefault("tool_choice", "auto")
    return chat


# --- the answer: chat completion -> Messages -------------------------------------------------------------------
def stop_reason(finish_reason: str | None, stop: Any, tool_used: bool, tool_complete: bool) -> tuple[str | None,
                                                                                                    str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` of a chat finish reason (as vLLM maps them): ``max_tokens``
    first; ``tool_use`` for complete tool calls; a matched stop string (vLLM's ``stop_reason`` when it is text)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def usage(chat_usage: Any) -> dict[str, int]:
    """Anthropic's usage of a chat completion's (input tokens less those read from the prefix cache)."""
    if not isinstance(chat_usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    out = {"output_tokens": int(chat_usage.get("completion_tokens") or 0)}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int):
        out["cache_read_input_tokens"] = cached
        prompt -= cached
    out["input_tokens"] = max(0, prompt)
    return out


def _arguments(text: str) -> dict[str, Any] | None:
    with contextlib.suppress(ValueError, RecursionError):
        value = json.loads(text or "{}")
        return value if isinstance(value, dict) else None
    return None


def anthropic_message(payload: dict[str, Any], model: str) -> dict[str, Any]:
    """The Messages answer of a chat completion (its first choice), naming ``model``."""
    choices = payload.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": secrets.token_hex(16)})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or f"toolu_{secrets.token_hex(12)}",
                        "name": fn.get("name", ""), "input": _arguments(fn.get("arguments", "")) or {}})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls), bool(calls))
    return {"id": payload.get("id") or f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
            "content": content or [{"type": "text", "text": ""}], "model": model, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(payload.get("usage"))}


def sse(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event of the Messages stream."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


@dataclass
class MessagesStream:
    """Turns a streamed chat completion into the Messages stream (as vLLM's translation does) while accumulating the
    call for capture (:class:`StreamAccumulator`)."""

    client_model: str
    accumulator: StreamAccumulator = field(default_factory=lambda: StreamAccumulator(None))
    started: bool = False
    response_id: str | None = None
    index: int = 0                  # the next content block's index
    block: str | None = None        # the open block's type
    tool_id: str | None = None      # the open tool_use block's call id
    signature: str | None = None    # the open thinking block's signature (sent before it stops)
    pending: list[str] = field(default_factory=list)  # text that came while a tool_use block was open
    tool_ids: dict[int, str] = field(default_factory=dict)
    tool_used: bool = False
    last_args: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop: Any = None
    delta_sent: bool = False
    malformed: bool = False

    def render(self, line: str) -> str:
        """The Messages events of one line of the upstream's chat stream ("" for a line that makes none)."""
        if not line.startswith("data:"):
            return ""
        data = line[5:].strip()
        if not data:
            return ""
        if data == "[DONE]":
            return self._finish(None) + sse("message_stop", {})
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            chunk = None
        if not isinstance(chunk, dict):
            self.malformed = True
            return sse("error", {"error": {"type": "api_error", "message": "invalid data from the upstream"}})
        if isinstance(chunk.get("error"), dict):  # an upstream failure mid-stream
            message = str(chunk["error"].get("message") or "upstream error")
            return sse("error", {"error": {"type": "api_error", "message": message}})
        try:
            self.accumulator.add(chunk)
        except (TypeError, ValueError, AttributeError) as exc:  # handed on, not captured
            self.malformed = True
            log.warning("malformed upstream stream chunk not captured", error=str(exc)[:200])
        try:
            return self._events(chunk)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            self.malformed = True
            return sse("error", {"error": {"type": "api_error", "message": f"invalid data from the upstream: {exc}"}})

    def _events(self, chunk: dict[str, Any]) -> str:
        out: list[str] = []
        if not self.started:
            self.started = True
            self.response_id = str(chunk.get("id") or f"msg_{secrets.token_hex(12)}")
            start_usage = usage(chunk.get("usage"))
            if not start_usage["input_tokens"] and chunk.get("prompt_token_ids"):
                start_usage["input_tokens"] = len(chunk["prompt_token_ids"])
            out.append(sse("message_start", {"message": {
                "id": self.response_id, "type": "message", "role": "assistant", "content": [],
                "model": self.client_model, "stop_reason": None, "stop_sequence": None, "usage": start_usage}}))
        choices = chunk.get("choices")
        if not choices:  # the last chunk: its usage
            if chunk.get("usage") is not None:
                out.append(self._finish(chunk.get("usage")))
            return "".join(out)
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason, self.stop = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning")
        if reasoning:
            if self.block != "thinking":
                out += self._stop_and_flush()
                out.append(self._start({"type": "thinking", "thinking": ""}))
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        text = delta.get("content")
        if text:
            if self.block == "tool_use":
                self.pending.append(text)
            else:
                if self.block != "text":
                    out += self._stop_and_flush()
                    out.append(self._start({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            call_id = call.get("id")
            if call_id is not None:
                self.tool_ids[call.get("index", 0)] = call_id
                if self.tool_id != call_id and fn.get("name") is not None:
                    out += self._stop_and_flush()
                    self.tool_used = True
                    self.last_args = []
                    out.append(self._start({"type": "tool_use", "id": call_id, "name": fn["name"], "input": {}}))
            else:
                call_id = self.tool_ids.get(call.get("index", 0))
            if fn.get("arguments") and call_id is not None and call_id == self.tool_id:
                self.last_args.append(fn["arguments"])
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return "".join(out)

    def _start(self, block: dict[str, Any]) -> str:
        self.block = block["type"]
        self.tool_id = block.get("id") if self.block == "tool_use" else None
        self.signature = secrets.token_hex(16) if self.block == "thinking" else None
        return sse("content_block_start", {"index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"index": self.index, "delta": delta})

    def _stop(self) -> list[str]:
        if self.block is None:
            return []
        out = [self._delta({"type": "signature_delta", "signature": self.signature})] if self.signature else []
        out.append(sse("content_block_stop", {"index": self.index}))
        self.block = self.tool_id = self.signature = None
        self.index += 1
        return out

    def _stop_and_flush(self) -> list[str]:
        out = self._stop()
        if self.pending:
            text = "".join(self.pending)
            self.pending.clear()
            out += [self._start({"type": "text", "text": ""}), self._delta({"type": "text_delta", "text": text})]
            out += self._stop()
        return out

    def _finish(self, chat_usage: Any) -> str:
        """The open block's end and the ``message_delta`` (once)."""
        if self.delta_sent:
            return ""
        self.delta_sent = True
        out = self._stop_and_flush()
        complete = self.tool_used and _arguments("".join(self.last_args)) is not None
        reason, sequence = stop_reason(self.finish_reason or "stop", self.stop, self.tool_used, complete)
        out.append(sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": usage(chat_usage)}))
        return "".join(out)


MESSAGES_REQUEST = RequestShape("a Messages request", turns="messages", turns_required=True)


class Messages:
    """The Anthropic Messages endpoint of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def serve(self, request: Request) -> Response:
        try:
            return await self._serve(request)
        except RequestRejected as exc:  # the gateway's own bounds, answered in Anthropic's shape
            self.gw.limit_stats.count(exc.reason)
            return anthropic_error(exc.status, exc.message)

    async def _serve(self, request: Request) -> Response:
        gw, config = self.gw, self.gw.config
        started = time.perf_counter()
        body = checked_body(await request.body(), MESSAGES_REQUEST, config)
        try:
            chat = chat_request(body)
        except ValueError as exc:
            return anthropic_error(400, str(exc))
        caller, task, session_id, captured = gw.admit(request, str(body.get("model", "")))
        if not captured:  # another model: the upstream's own Messages API, not captured
            return await gw.passthrough("/messages", body)
        routed = await gw.routed(str(body.get("model", "")), session_id, caller, body.get("user"))
        if isinstance(routed, Response):
            return as_anthropic_error(routed)
        model, version, base = routed
        stream = bool(body.get("stream"))
        plain = {**chat, "model": model}
        sent = upstream_request(plain, gw.request_token_data, config.request_logprobs)
        upstream_started = time.perf_counter()
        try:
            upstream, refused = await gw.send(base + "/chat/completions", sent, upstream_request(plain, False),
                                              stream, rejects_extensions)
        except httpx.HTTPError as exc:
            log.warning("upstream unreachable", kind=type(exc).__name__)
            return anthropic_error(502, f"upstream unreachable ({type(exc).__name__})")
        if refused:
            gw.request_token_data = False
        client_model = str(body.get("model") or model)
        if stream and upstream.status_code == 200:
            return await self._stream(upstream, request, chat, caller, session_id, task, version, model,
                                      client_model, started, upstream_started)
        raw = await upstream.aread() if stream else upstream.content
        await upstream.aclose()
        upstream_s = time.perf_counter() - upstream_started
        payload = upstream_json(upstream, raw, config.max_choices)
        if isinstance(payload, Response):
            return as_anthropic_error(payload)
        try:
            prompt_ids, completion_ids, logprobs = token_data(payload)
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            log.warning("upstream token data unreadable; captured without it", error=str(exc))
            prompt_ids = completion_ids = logprobs = None
        choices = payload.get("choices") or []
        traj, headers = gw.begin(session_id, chat, prompt_ids, version, task)
        if choices:
            gw.finish(traj, chat, choices[0].get("message") or {"role": "assistant"}, prompt_ids, completion_ids,
                      logprobs, choices[0].get("finish_reason"), model, version)
        out = anthropic_message(payload, client_model)
        answer = JSONResponse(out, headers=gw.sign(headers, caller, request_session(request), out["id"]))
        await gw.overhead(ROUTE, False, started, upstream_s)
        return answer

    async def _stream(self, response: httpx.Response, request: Request, chat: dict[str, Any], caller: Principal,
                      session_id: str | None, task: str | None, version: int, model: str, client_model: str,
                      started: float, upstream_started: float) -> Response:
        """Hand the Messages stream on event by event while accumulating the chat stream; the call is recorded
        once the stream ends."""
        gw = self.gw
        lines = response.aiter_lines()
        follow = MessagesStream(client_model)
        try:  # up to the first chunk: its prompt token ids decide the session trajectory, its id the message id
            head = await read_head(response, lines, first_data_event)
        except httpx.HTTPError as exc:
            log.warning("upstream stream failed", kind=type(exc).__name__)
            return anthropic_error(502, f"upstream stream failed ({type(exc).__name__})")
        rendered = "".join(follow.render(line) for line in head)
        upstream_s = time.perf_counter() - upstream_started
        acc = follow.accumulator
        traj: Trajectory
        traj, headers = gw.begin(session_id, chat, acc.prompt_ids, version, task)
        headers = gw.sign(headers, caller, request_session(request), follow.response_id)

        def record() -> None:
            if acc.chunks:
                gw.finish(traj, chat, acc.message(), acc.prompt_ids, acc.completion_ids(), acc.logprobs(),
                          acc.finish_reason, model, version)

        stream = CapturedAtDone(record, follow.render, lambda refusal, _done: sse(
            "error", {"error": {"type": ERROR_TYPES[413], "message": refusal.message}}))

        async def handed_on() -> None:
            await gw.overhead(ROUTE, True, started, upstream_s)

        return relayed(response, lines, rendered, stream.render, handed_on, stream.at_end, headers)
