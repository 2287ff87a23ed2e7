"""``POST /v1/chat/completions`` (also under ``/s/{session_id}``), streamed or not: the call goes to the version and
replica the core routes it to, asking for token ids and logprobs; the client gets only what it asked for
(``filtering.py``); the call is captured with vLLM's exact tokens. ``n > 1`` outside a session is one GRPO group
(one trajectory per choice)."""
from __future__ import annotations

import contextlib
import time
from typing import Any

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from rlstream.gateway.auth import Principal
from rlstream.gateway.core import (Gateway, capture_refused_event, json_response, request_session,
                                   upstream_failed, upstream_json)
from rlstream.gateway.filtering import ClientAsked, client_asked, filter_response, rejects_extensions, upstream_request
from rlstream.gateway.limits import RequestShape, checked_body, requested_choices
from rlstream.gateway.relay import CapturedAtDone, first_data_event, read_head, relayed
from rlstream.rollout.capture import token_data
from rlstream.rollout.streaming import StreamAccumulator
from rlstream.transport.log import get_logger

log = get_logger(__name__)
ROUTE = "chat_completions"


CHAT_REQUEST = RequestShape("a chat completion request", turns="messages", turns_required=True, choices=True)


class ChatCompletions:
    """The Chat Completions endpoint of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def serve(self, request: Request) -> Response:
        gw, config = self.gw, self.gw.config
        started = time.perf_counter()
        body = checked_body(await request.body(), CHAT_REQUEST, config)
        caller, task, session_id, captured = gw.admit(request, str(body.get("model", "")))
        gw.keys.charge(caller, requested_choices(body) - 1)  # n choices cost n requests
        if not captured:
            return await gw.passthrough("/chat/completions", body)
        asked = client_asked(body)
        routed = await gw.routed(str(body.get("model", "")), session_id, caller, body.get("user"))
        if isinstance(routed, Response):
            return routed
        model, version, base = routed
        stream = bool(body.get("stream"))
        upstream_started = time.perf_counter()
        try:
            response = await self._send({**body, "model": model}, stream, base)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, config)
        if stream and response.status_code == 200:
            return await self._stream(response, body, asked, session_id, task, version, model, started,
                                      upstream_started, caller)
        raw = await response.aread() if stream else response.content
        upstream_s = time.perf_counter() - upstream_started
        if response.status_code != 200:
            await response.aclose()
        payload = upstream_json(response, raw, config.max_choices)
        if isinstance(payload, Response):
            return payload
        try:
            prompt_ids, completion_ids, logprobs = token_data(payload)
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            log.warning("upstream token data unreadable; captured without it", error=str(exc))
            prompt_ids = completion_ids = logprobs = None
        choices = payload.get("choices") or []
        if len(choices) > 1 and session_id is None:
            headers = self._capture_choices(body, payload, version, task, model, caller.tenant)
        else:
            if len(choices) > 1:
                log.warning("n > 1 inside a session: the session keeps the first choice", session_id=session_id,
                            choices=len(choices))
            traj, headers = gw.begin(session_id, body, prompt_ids, version, task, caller.tenant)
            if choices:
                gw.finish(traj, body, choices[0].get("message") or {"role": "assistant"}, prompt_ids,
                          completion_ids, logprobs, choices[0].get("finish_reason"), model, version)
        out = filter_response(payload, asked)
        if "model" in out and out.get("model") == model:
            out["model"] = body.get("model", model)
        answer = json_response(out, headers=gw.sign(headers, caller, request_session(request), payload.get("id")))
        await gw.overhead(ROUTE, False, started, upstream_s)
        return answer

    async def _send(self, body: dict[str, Any], stream: bool, base: str) -> httpx.Response:
        """The upstream's answer to ``body``; an upstream that refuses the token-data options is asked without
        them, now and from then on."""
        gw = self.gw
        sent = upstream_request(body, gw.request_token_data, gw.config.request_logprobs)
        response, refused = await gw.send(base + "/chat/completions", sent, upstream_request(body, False), stream,
                                          rejects_extensions)
        if refused:
            gw.request_token_data = False
        return response

    def _capture_choices(self, body: dict[str, Any], payload: dict[str, Any], version: int, task: str | None,
                         served: str, tenant: str | None = None) -> dict[str, str]:
        """The choices of a whole (not streamed) ``n > 1`` answer, captured as one group."""
        choices = payload.get("choices") or []
        trajs, headers = self.gw.begin_group(len(choices), version, task, tenant)
        for index, (traj, choice) in enumerate(zip(trajs, choices)):
            prompt_ids, completion_ids, logprobs = token_data(payload, choice_index=index)
            self.gw.finish(traj, body, choice.get("message") or {"role": "assistant"}, prompt_ids, completion_ids,
                           logprobs, choice.get("finish_reason"), served, version)
        return headers

    async def _stream(self, response: httpx.Response, body: dict[str, Any], asked: ClientAsked,
                      session_id: str | None, task: str | None, version: int, model: str, started: float,
                      upstream_started: float, caller: Principal) -> Response:
        """Pass a streamed answer on while accumulating it; the overhead reported is the time up to handing on the
        first event, less the upstream's time to it (``started``, ``upstream_started``: ``time.perf_counter``)."""
        gw = self.gw
        lines = response.aiter_lines()
        try:  # read up to the first event: its prompt token ids decide the session trajectory
            head = await read_head(response, lines, first_data_event)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, gw.config, "stream failed")
        upstream_s = time.perf_counter() - upstream_started
        first: dict[str, Any] | None = None
        if head and first_data_event(head[-1]):
            with contextlib.suppress(orjson.JSONDecodeError):
                first = orjson.loads(head[-1][5:])
        first = first if isinstance(first, dict) else {}
        prompt_ids = first.get("prompt_token_ids")
        n = requested_choices(body)
        if n > 1 and session_id is None:  # the headers go out first: the group's trajectories exist up front
            trajs, headers = self.gw.begin_group(n, version, task, caller.tenant)
        else:
            if n > 1:
                log.warning("n > 1 inside a session: the session keeps the first choice", session_id=session_id,
                            choices=n)
            traj, headers = gw.begin(session_id, body, prompt_ids, version, task, caller.tenant)
            trajs = [traj]
        accumulators = [StreamAccumulator(prompt_ids, choice_index=index) for index in range(len(trajs))]
        client_model = body.get("model", model)
        headers = gw.sign(headers, caller, gw.client_session(session_id), first.get("id"))

        def dispatch(chunk: dict[str, Any]) -> None:
            """Each choice of ``chunk`` to its own accumulator, by index (n choices: n x tokens in all, not n^2)."""
            choices = chunk.get("choices")
            if len(accumulators) == 1 or not isinstance(choices, list):
                accumulators[0].add(chunk)
                return
            if accumulators[0].prompt_ids is None and chunk.get("prompt_token_ids") is not None:
                accumulators[0].add({"prompt_token_ids": chunk["prompt_token_ids"]})
                for acc in accumulators[1:]:
                    acc.prompt_ids = accumulators[0].prompt_ids
            for choice in choices:
                index = choice.get("index", 0) if isinstance(choice, dict) else None
                if isinstance(index, int) and 0 <= index < len(accumulators):
                    accumulators[index].add({"choices": [choice]})

        def render(line: str) -> str:
            if not line.startswith("data:"):
                return line + "\n"
            data = line[5:].strip()
            if not data or data == "[DONE]":
                return line + "\n"
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                return line + "\n"
            if not isinstance(chunk, dict):
                return line + "\n"
            try:
                dispatch(chunk)
            except (TypeError, ValueError, AttributeError) as exc:  # handed on as it came, not captured
                log.warning("malformed upstream stream chunk not captured", error=str(exc))
            out = filter_response(chunk, asked)
            if out.get("model") == model:
                out["model"] = client_model
            return "data: " + orjson.dumps(out).decode() + "\n"

        def record() -> None:
            for traj, acc in zip(trajs, accumulators):
                if acc.chunks:
                    gw.finish(traj, body, acc.message(), acc.prompt_ids, acc.completion_ids(), acc.logprobs(),
                              acc.finish_reason, model, version)

        # captured before the client hears the end: a capture Kafka refuses ends the stream in error
        stream = CapturedAtDone(record, render, lambda refusal, done: capture_refused_event(refusal) + done + "\n")

        async def handed_on() -> None:
            await gw.overhead(ROUTE, True, started, upstream_s)

        return relayed(response, lines, "".join(render(line) for line in head), stream.render, handed_on,
                       stream.at_end, headers)
