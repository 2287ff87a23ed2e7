"""``POST /v1/responses``: the OpenAI Responses API as chat messages and exact tokens, and its endpoint
(:class:`Responses`).

A request's ``instructions`` become a system message and its ``input`` (a string, or a list of messages and
``function_call`` / ``function_call_output`` items) the conversation; the response's ``output`` items become the
assistant message (text of its ``message`` items, its ``function_call`` items as tool calls).

Token data: the gateway asks vLLM for ``enable_response_messages`` (the response then carries ``input_messages`` and
``output_messages``: the rendered prompt and the completion with their exact token ids) and for the sampled tokens'
logprobs (``include: ["message.output_text.logprobs"]``); it takes both back out of the client's answer unless the
client asked for them itself. vLLM gives logprobs for text output only: a turn whose logprobs do not cover every
completion token (a tool call) keeps its token ids without logprobs, and the learner trains it on-policy.

``previous_response_id`` and ``conversation`` are resolved by the gateway (:mod:`rlstream.gateway.responses_state`):
the upstream gets the whole input, so any replica behind any gateway answers the next turn.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlstream.gateway.auth import Principal
from rlstream.gateway.core import (Gateway, capture_refused_event, openai_error, request_session, upstream_failed,
                                   upstream_json)
from rlstream.gateway.limits import RequestRejected, RequestShape, checked_body
from rlstream.gateway.relay import read_head, relayed
from rlstream.gateway.responses_state import ResponsesState, StoredResponses
from rlstream.transport.log import get_logger

log = get_logger(__name__)
ROUTE = "responses"

#: the ``include`` value that asks for the sampled tokens' logprobs of output text
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: vLLM's request field that returns the prompt and completion token ids
MESSAGES_FIELD = "enable_response_messages"
#: stream events that carry the whole response object (the last one of a stream carries its token ids)
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _list(value: Any) -> list[Any]:
    """``value`` when it is a list, else nothing (an upstream's malformed field is not iterated)."""
    return value if isinstance(value, list) else []


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return ""


def request_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses request (raises ValueError for an input it cannot read)."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    given = body.get("input")
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise ValueError("a Responses request needs an 'input' string or list")
    for item in given:
        if not isinstance(item, dict):
            raise ValueError(f"input item is not an object: {item!r}")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": item.get("call_id", ""), "type": "function",
                 "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}}]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                             "content": _text(item.get("output"))})
    return messages


def response_message(payload: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a Responses result."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in _list(payload.get("output")):
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            texts.append(_text(item.get("content")))
        elif item.get("type") == "function_call":
            calls.append({"id": item.get("call_id", ""), "type": "function",
                          "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass(frozen=True)
class ResponsesAsked:
    """What the client itself asked of a Responses call (the rest of the token data is the gateway's own)."""

    messages: bool = False
    logprobs: bool = False


def responses_asked(body: dict[str, Any]) -> ResponsesAsked:
    include = body.get("include")
    return ResponsesAsked(messages=body.get(MESSAGES_FIELD) is True,
                          logprobs=isinstance(include, list) and LOGPROBS_INCLUDE in include)


def responses_upstream_request(body: dict[str, Any], token_data: bool, logprobs: bool) -> dict[str, Any]:
    """The request sent upstream: ``body`` asking for token ids (``token_data``) and logprobs (``logprobs``)."""
    sent = dict(body)
    if token_data:
        sent[MESSAGES_FIELD] = True
        if logprobs:
            include = [i for i in body.get("include") or [] if isinstance(i, str)] if isinstance(
                body.get("include"), list) else []
            sent["include"] = include if LOGPROBS_INCLUDE in include else [*include, LOGPROBS_INCLUDE]
    return sent


def rejects_token_options(status: int, text: str) -> bool:
    """True when an upstream answered 400/422 because it does not know the token-data fields (not vLLM)."""
    lowered = text.lower()
    return status in (400, 422) and (MESSAGES_FIELD in lowered or "include" in lowered or "extra" in lowered)


def _raw_tokens(entries: Any) -> list[int] | None:
    """The token ids of vLLM's ``raw_message_tokens`` entries, joined; None when there are none."""
    if not isinstance(entries, list) or not entries:
        return None
    ids: list[int] = []
    for entry in entries:
        tokens = entry.get("tokens") if isinstance(entry, dict) else None
        if not isinstance(tokens, list):
            return None  # another shape (harmony messages): no token ids
        ids.extend(int(t) for t in tokens)
    return ids


def output_logprobs(payload: dict[str, Any]) -> list[float] | None:
    """The logprobs of a response's output text, in order; None when it carries none."""
    values: list[float] = []
    for item in _list(payload.get("output")):
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        for part in _list(item.get("content")):
            if isinstance(part, dict) and isinstance(part.get("logprobs"), list):
                values.extend(float(lp["logprob"]) for lp in part["logprobs"])
    return values or None


@dataclass(frozen=True)
class ResponseTokens:
    """Token data of one Responses call (what vLLM saw and sampled)."""

    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    logprobs: list[float] | None


def response_tokens(payload: dict[str, Any], logprobs: list[float] | None = None) -> ResponseTokens:
    """The exact prompt and completion token ids of a Responses result (vLLM's ``input_messages`` /
    ``output_messages``), and the completion's logprobs (``logprobs``: those gathered from a stream, else the output
    text's own; logprobs that miss a completion token are counted and left out by :meth:`Gateway.finish`). An
    answer whose token data is malformed is recorded without it."""
    try:
        return _response_tokens(payload, logprobs)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        log.warning("upstream Responses token data unreadable; captured without it", error=str(exc)[:200])
        return ResponseTokens(None, None, None)


def _response_tokens(payload: dict[str, Any], logprobs: list[float] | None) -> ResponseTokens:
    prompt_ids = _raw_tokens(payload.get("input_messages"))
    completion_ids = _raw_tokens(payload.get("output_messages"))
    values = logprobs if logprobs is not None else output_logprobs(payload)
    if completion_ids is None:  # logprobs that miss a token are counted and left out by the core (Gateway.finish)
        values = None
    return ResponseTokens(prompt_ids, completion_ids, values)


def finish_reason(payload: dict[str, Any]) -> str:
    """A chat-style finish reason of a Responses result."""
    status = payload.get("status")
    if status in (None, "completed"):
        calls = any(isinstance(i, dict) and i.get("type") == "function_call" for i in _list(payload.get("output")))
        return "tool_calls" if calls else "stop"
    details = payload.get("incomplete_details")
    if status == "incomplete" and isinstance(details, dict) and details.get("reason") == "max_output_tokens":
        return "length"
    return str(status)


def recorded_request(body: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-shaped request a Responses call is recorded as (what decides its turn's temperature and whether its
    logprobs were grammar-constrained)."""
    recorded: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name in ("temperature", "tools", "tool_choice", "structured_outputs"):
        if name in body:
            recorded[name] = body[name]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        recorded["response_format"] = {"type": fmt["type"]}
    return recorded


def _strip_part_logprobs(part: Any) -> None:
    if isinstance(part, dict) and part.get("type") == "output_text" and part.get("logprobs"):
        part["logprobs"] = None


def _strip_item_logprobs(item: Any) -> None:
    if isinstance(item, dict) and item.get("type") == "message":
        for part in _list(item.get("content")):
            _strip_part_logprobs(part)


def filter_response_payload(payload: dict[str, Any], asked: ResponsesAsked) -> dict[str, Any]:
    """A Responses result as the client asked for it: without the token ids and logprobs the gateway added."""
    if not asked.messages:
        for name in ("input_messages", "output_messages"):
            if name in payload:
                payload[name] = None
    if not asked.logprobs:
        for item in _list(payload.get("output")):
            _strip_item_logprobs(item)
        if payload.get("top_logprobs") is not None:  # vLLM echoes the logprobs asked for: null when none were
            payload["top_logprobs"] = None
    return payload


@dataclass
class ResponsesStreamCapture:
    """Follows a streamed Responses answer: gathers the output text's logprobs from its delta events and the final
    response object (with its token ids), and renders each event as the client asked for it."""

    asked: ResponsesAsked
    upstream_model: str
    client_model: str
    logprobs: list[float] = field(default_factory=list)
    final: dict[str, Any] | None = None
    response_id: str | None = None
    events: int = 0
    malformed: bool = False  # an event's token data could not be read: the call is recorded without logprobs
    echo: dict[str, Any] = field(default_factory=dict)  # fields every response object carries as the client sent
    on_final: Callable[[dict[str, Any]], None] | None = None  # called with the final response object

    def render(self, line: str) -> str:
        """One line of the stream as it goes to the client (``data:`` lines filtered, others as they came)."""
        if not line.startswith("data:"):
            return line + "\n"
        data = line[5:].strip()
        try:
            event = json.loads(data)
        except (ValueError, RecursionError):
            return line + "\n"
        if not isinstance(event, dict):
            return line + "\n"
        self.events += 1
        try:
            self._take(event)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:  # handed on, not captured
            self.malformed = True
            log.warning("malformed upstream Responses stream event not captured", error=str(exc)[:200])
        self._filter(event)
        return "data: " + json.dumps(event, separators=(",", ":")) + "\n"

    def _take(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        response = event.get("response")
        if isinstance(response, dict):
            if self.response_id is None and isinstance(response.get("id"), str):
                self.response_id = response["id"]  # the first event's: the one the headers index
            if kind in FINAL_EVENTS:
                self.final = json.loads(json.dumps(response))  # a copy: the client's is filtered
                if self.on_final is not None:
                    self.on_final(self.final)
        if kind == "response.output_text.delta" and isinstance(event.get("logprobs"), list):
            self.logprobs.extend(float(lp["logprob"]) for lp in event["logprobs"]
                                 if isinstance(lp, dict) and "logprob" in lp)

    def _filter(self, event: dict[str, Any]) -> None:
        response = event.get("response")
        if isinstance(response, dict):
            filter_response_payload(response, self.asked)
            response.update(self.echo)
            if response.get("model") == self.upstream_model:
                response["model"] = self.client_model
        if not self.asked.logprobs:
            if str(event.get("type", "")).startswith("response.output_text.") and event.get("logprobs"):
                event["logprobs"] = []
            _strip_part_logprobs(event.get("part"))
            _strip_item_logprobs(event.get("item"))

    def tokens(self) -> ResponseTokens | None:
        """The call's token data, once the final event came (None before)."""
        if self.final is None:
            return None
        return response_tokens(self.final, None if self.malformed else self.logprobs or None)


def event_response_id(line: str) -> str | None:
    """The response id a stream line's event carries (``response.created`` is the first that does)."""
    if not line.startswith("data:"):
        return None
    try:
        event = json.loads(line[5:])
    except (ValueError, RecursionError):
        return None
    response = event.get("response") if isinstance(event, dict) else None
    return response["id"] if isinstance(response, dict) and isinstance(response.get("id"), str) else None


RESPONSES_REQUEST = RequestShape("a Responses request", turns="input", turn_noun="input items")


class Responses:
    """``POST /v1/responses`` (also under ``/s/{session_id}``), streamed or not: passed to the upstream (where it has
    the API) and recorded like a chat call, with the exact prompt and completion token ids and logprobs vLLM
    returns."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.stored = StoredResponses(gateway)

    async def serve(self, request: Request) -> Response:
        gw, config = self.gw, self.gw.config
        started = time.perf_counter()
        body = checked_body(await request.body(), RESPONSES_REQUEST, config)
        try:
            messages = request_messages(body)
        except ValueError as exc:
            return openai_error(400, str(exc))
        caller, task, session_id, captured = gw.admit(request, str(body.get("model", "")))
        if not captured:
            return await gw.passthrough("/responses", body)
        state = await self.stored.resolve(body, caller.tenant)  # previous_response_id, conversation
        if isinstance(state, Response):
            return state
        if state.stateful:  # the upstream gets the whole input: the stored items, then this request's
            body = state.body
            try:
                messages = request_messages(body)
            except ValueError as exc:
                return openai_error(400, str(exc))
        routed = await gw.routed(str(body.get("model", "")), session_id, caller, body.get("user"))
        if isinstance(routed, Response):
            return routed
        model, version, base = routed
        stream = bool(body.get("stream"))
        upstream_started = time.perf_counter()
        plain = {**body, "model": model}
        sent = responses_upstream_request(plain, gw.request_token_data, config.request_logprobs)
        try:
            upstream, _ = await gw.send(base + "/responses", sent, plain, stream, rejects_token_options)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, config)
        if upstream.status_code == 404:
            await upstream.aclose()
            return openai_error(404, "the upstream has no Responses API", "not_found_error")
        recorded = recorded_request(body, messages)
        asked = responses_asked(body)
        if stream and upstream.status_code == 200:
            return await self._stream(upstream, request, recorded, asked, caller, session_id, task, version, model,
                                      started, upstream_started, state)
        raw = await upstream.aread() if stream else upstream.content
        await upstream.aclose()
        upstream_s = time.perf_counter() - upstream_started
        payload = upstream_json(upstream, raw, config.max_choices)
        if isinstance(payload, Response):
            return payload
        tokens = response_tokens(payload)
        traj, headers = gw.begin(session_id, recorded, tokens.prompt_ids, version, task, caller.tenant)
        gw.finish(traj, recorded, response_message(payload), tokens.prompt_ids, tokens.completion_ids,
                  tokens.logprobs, finish_reason(payload), model, version)
        payload = filter_response_payload(payload, asked)
        await self.stored.remember(caller.tenant, state, payload)  # before the answer: the next turn may go anywhere
        payload = self.stored.answer(state, payload)
        if payload.get("model") == model:
            payload["model"] = body.get("model", model)
        answer = JSONResponse(payload, headers=gw.sign(headers, caller, request_session(request), payload.get("id")))
        await gw.overhead(ROUTE, False, started, upstream_s)
        return answer

    async def _stream(self, response: httpx.Response, request: Request, recorded: dict[str, Any],
                      asked: ResponsesAsked, caller: Principal, session_id: str | None, task: str | None,
                      version: int, model: str, started: float, upstream_started: float,
                      state: ResponsesState) -> Response:
        """Pass a streamed Responses answer on event by event while following it; the call is recorded from its
        final event (``response.completed``), which carries the token ids."""
        gw = self.gw
        lines = response.aiter_lines()
        capture = ResponsesStreamCapture(asked, model, str(recorded.get("model") or model), echo=state.echo,
                                         on_final=lambda final: gw.background.run(
                                             self.stored.remember(caller.tenant, state, final)))
        try:  # up to the first event (response.created): its response id is indexed for feedback
            head = await read_head(response, lines, lambda line: event_response_id(line) is not None)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, gw.config, "stream failed")
        rendered = "".join(capture.render(line) for line in head)
        upstream_s = time.perf_counter() - upstream_started
        traj, headers = gw.begin(session_id, recorded, None, version, task, caller.tenant)
        headers = gw.sign(headers, caller, request_session(request), capture.response_id)

        finished = False  # recorded once: at the final event, or when the stream ends without one

        def record() -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            tokens = capture.tokens()
            if capture.final is not None and tokens is not None:
                gw.finish(traj, recorded, response_message(capture.final), tokens.prompt_ids, tokens.completion_ids,
                          tokens.logprobs, finish_reason(capture.final), model, version)
            elif capture.events:
                log.warning("streamed Responses call ended without its final event; not captured",
                            trajectory_id=traj.trajectory_id)

        def render(line: str) -> str:
            out = capture.render(line)
            if capture.final is not None and not finished:  # captured before the client hears the end
                try:
                    record()
                except RequestRejected as refusal:  # the final event becomes the error (the OpenAI SDKs raise it)
                    return capture_refused_event(refusal)
            return out

        def record_at_end() -> None:  # a stream cut short: a refusal is logged and counted
            with contextlib.suppress(RequestRejected):
                record()

        async def handed_on() -> None:
            await gw.overhead(ROUTE, True, started, upstream_s)

        return relayed(response, lines, rendered, render, handed_on, record_at_end, headers)
