"""``POST /v1/completions`` (also under ``/s/{session_id}``): the legacy OpenAI Completions API, streamed or not.

The call goes to the version and replica the core routes it to, asking vLLM for ``return_token_ids`` (each choice
then carries its ``prompt_token_ids`` and ``token_ids``) and ``logprobs: 0`` (the sampled tokens' logprobs in
``logprobs.token_logprobs``); the client gets only what it asked for, as vLLM writes it when not asked (``null``).
The call is captured like a chat call with vLLM's exact tokens: the prompt text is recorded as one user message (the
turn's prompt token ids are the exact ones, no chat template applied), the completion text as the assistant message.
An answer with several choices outside a session (``n > 1``, a list of prompts, or both) captures every choice: the
``n`` choices of each prompt are one GRPO group (vLLM numbers the choice ``j`` of prompt ``i`` as ``i * n + j``), a prompt
asked once is a trajectory of its own. Inside a session the session keeps the first choice (logged), as for chat.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlstream.gateway.auth import Principal
from rlstream.gateway.core import (Gateway, capture_refused_event, openai_error, request_session, upstream_failed,
                                   upstream_json)
from rlstream.gateway.filtering import TOKEN_IDS, rejects_extensions
from rlstream.gateway.limits import RequestShape, checked_body, prompt_count, requested_choices
from rlstream.gateway.relay import CapturedAtDone, first_data_event, read_head, relayed
from rlstream.gateway.sessions import Trajectory
from rlstream.transport.log import get_logger

log = get_logger(__name__)
ROUTE = "completions"


@dataclass(frozen=True)
class CompletionsAsked:
    """What the client of a Completions call asked for itself (``logprobs: 0`` is a request for logprobs)."""

    logprobs: bool = False
    token_ids: bool = False


def completions_asked(body: dict[str, Any]) -> CompletionsAsked:
    """What ``body`` asks for of the token data."""
    return CompletionsAsked(logprobs=body.get("logprobs") is not None, token_ids=bool(body.get(TOKEN_IDS)))


def completions_upstream_request(body: dict[str, Any], token_data: bool, logprobs: bool) -> dict[str, Any]:
    """The request sent upstream: ``body`` with ``return_token_ids`` (``token_data``) and, with ``logprobs`` too,
    ``logprobs: 0`` unless the client asked for its own number of top logprobs."""
    sent = dict(body)
    if token_data:
        sent[TOKEN_IDS] = True
        if logprobs and sent.get("logprobs") is None:
            sent["logprobs"] = 0
    return sent


def filter_completion(payload: dict[str, Any], asked: CompletionsAsked) -> dict[str, Any]:
    """A completion (or one stream chunk) with only what the client asked for: what the gateway added set back to
    ``null``, as vLLM writes it when not asked."""
    for choice in payload.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if not asked.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        if not asked.token_ids:
            for name in ("token_ids", "prompt_token_ids"):
                if name in choice:
                    choice[name] = None
    return payload


def _ints(value: Any) -> list[int] | None:
    return [int(t) for t in value] if isinstance(value, list) else None


def sampled_logprobs(choice: dict[str, Any], count: int | None) -> list[float] | None:
    """The sampled tokens' logprobs of a completion choice (the last ``count`` of them: an ``echo`` answer puts the
    prompt's first); None when it carries none."""
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list) or not values:
        return None
    if count is not None and len(values) > count:
        values = values[-count:]
    return [float(v) for v in values if v is not None]  # a missing one: the core counts the turn incomplete


@dataclass(frozen=True)
class CompletionTokens:
    """Token data of one Completions choice."""

    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    logprobs: list[float] | None


def completion_tokens(choice: dict[str, Any]) -> CompletionTokens:
    """The exact prompt and completion token ids and the logprobs of one choice of a (not streamed) completion; an
    answer whose token data is malformed is recorded without it."""
    try:
        completion_ids = _ints(choice.get("token_ids"))
        logprobs = sampled_logprobs(choice, len(completion_ids) if completion_ids is not None else None)
        return CompletionTokens(_ints(choice.get("prompt_token_ids")), completion_ids, logprobs)
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        log.warning("upstream Completions token data unreadable; captured without it", error=str(exc)[:200])
        return CompletionTokens(None, None, None)


def prompt_text(body: dict[str, Any], index: int = 0) -> str:
    """The text of a Completions request's prompt number ``index``; "" for a prompt given as token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[index] if 0 <= index < len(prompt) else ""
    return prompt if isinstance(prompt, str) else ""


def recorded_request(body: dict[str, Any], prompt_index: int = 0) -> dict[str, Any]:
    """The chat-shaped request a Completions call (its prompt number ``prompt_index``) is recorded as: the prompt as
    one user message, and the fields that decide its turn's temperature and whether its logprobs were
    grammar-constrained."""
    recorded: dict[str, Any] = {"model": body.get("model"),
                                "messages": [{"role": "user", "content": prompt_text(body, prompt_index)}]}
    for name in ("temperature", "structured_outputs", "response_format"):
        if name in body:
            recorded[name] = body[name]
    for name, value in body.items():
        if name.startswith("guided_"):
            recorded[name] = value
    return recorded


@dataclass
class ChoiceFollow:
    """The token data, text and finish reason of one choice of a streamed completion, gathered chunk by chunk."""

    prompt_ids: list[int] | None = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    chunks: int = 0
    saw_ids: bool = False
    saw_logprobs: bool = False

    def take(self, choice: dict[str, Any]) -> None:
        """Gather one chunk's part of this choice."""
        self.chunks += 1
        if self.prompt_ids is None and choice.get("prompt_token_ids") is not None:
            self.prompt_ids = [int(t) for t in choice["prompt_token_ids"]]
        ids = choice.get("token_ids")
        if ids is not None:
            self.saw_ids = True
            self.completion_ids.extend(int(t) for t in ids)
        logprobs = choice.get("logprobs")
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if isinstance(values, list):
            self.saw_logprobs = True
            self.logprobs.extend(float(v) for v in values if v is not None)
        if isinstance(choice.get("text"), str):
            self.text.append(choice["text"])
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def tokens(self, malformed: bool = False) -> CompletionTokens:
        """The choice's token data (``malformed``: a chunk of the stream could not be read, so only the prompt's)."""
        if malformed:
            return CompletionTokens(self.prompt_ids, None, None)
        ids = self.completion_ids if self.saw_ids else None
        logprobs = self.logprobs if self.saw_logprobs else None  # one missing: the core counts the turn incomplete
        if logprobs is not None and ids is not None and len(logprobs) > len(ids):
            logprobs = logprobs[-len(ids):]  # echo: the prompt's logprobs came first
        return CompletionTokens(self.prompt_ids, ids, logprobs)


@dataclass
class CompletionStream:
    """Follows each choice of a streamed completion (by its ``index``); renders each chunk as the client asked for
    it. ``choices``: how many choices are followed (the rest are handed on, not captured)."""

    asked: CompletionsAsked
    upstream_model: str
    client_model: str
    choices: int = 1
    followed: dict[int, ChoiceFollow] = field(default_factory=dict)
    response_id: str | None = None
    malformed: bool = False
    other_choices: bool = False

    def choice(self, index: int = 0) -> ChoiceFollow:
        """What was gathered of choice ``index``."""
        return self.followed.setdefault(index, ChoiceFollow())

    def render(self, line: str) -> str:
        """One line of the stream as it goes to the client (``data:`` chunks filtered, others as they came)."""
        if not line.startswith("data:"):
            return line + "\n"
        data = line[5:].strip()
        if not data or data == "[DONE]":
            return line + "\n"
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            return line + "\n"
        if not isinstance(chunk, dict):
            return line + "\n"
        try:
            self.take(chunk)
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:  # handed on, not captured
            self.malformed = True
            log.warning("malformed upstream Completions stream chunk not captured", error=str(exc)[:200])
        filter_completion(chunk, self.asked)
        if chunk.get("model") == self.upstream_model:
            chunk["model"] = self.client_model
        return "data: " + json.dumps(chunk, separators=(",", ":")) + "\n"

    def take(self, chunk: dict[str, Any]) -> None:
        """Gather the token data of ``chunk``'s choices."""
        if self.response_id is None and isinstance(chunk.get("id"), str):
            self.response_id = chunk["id"]
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.choices:
                self.other_choices = True
                continue
            self.choice(index).take(choice)

    @property
    def prompt_ids(self) -> list[int] | None:
        """The first choice's prompt token ids (what a session trajectory is matched on)."""
        return self.choice(0).prompt_ids

    def tokens(self, index: int = 0) -> CompletionTokens:
        """The token data of choice ``index``."""
        return self.choice(index).tokens(self.malformed)


def upstream_refusal(response: httpx.Response, raw: bytes, path: str) -> Response:
    """The client's answer to an upstream error: its JSON error as it came, else (an upstream without the endpoint
    answers a text page) an OpenAI-style error with the upstream's status."""
    with contextlib.suppress(ValueError, RecursionError):
        if isinstance(json.loads(raw), dict):
            return Response(raw, status_code=response.status_code,
                            media_type=response.headers.get("content-type", "application/json"))
    kind = "not_found_error" if response.status_code == 404 else "upstream_error"
    return openai_error(response.status_code, f"the upstream answered {response.status_code} to {path}", kind)


@dataclass(frozen=True)
class ChoiceSlot:
    """Where one choice of a Completions answer is captured: its trajectory and the request it is recorded with."""

    trajectory: Trajectory
    recorded: dict[str, Any]


def ordered_choices(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The choices of an answer in ``index`` order (as they came when their indexes are not exactly 0..len-1)."""
    indexes = [c.get("index") for c in choices]
    if all(isinstance(i, int) and not isinstance(i, bool) for i in indexes) and \
            sorted(indexes) == list(range(len(choices))):  # type: ignore[type-var]
        return sorted(choices, key=lambda c: int(c["index"]))
    return choices


def merged_headers(parts: list[dict[str, str]]) -> dict[str, str]:
    """The response headers naming every trajectory (and group) of an answer with several choices, in choice
    order: ``x-rlstream-trajectory-ids`` all of them, ``x-rlstream-group-id`` the first group and, with several
    prompts, ``x-rlstream-group-ids`` each prompt's group."""
    ids = [t for part in parts
           for t in (part.get("x-rlstream-trajectory-ids") or part["x-rlstream-trajectory-id"]).split(",")]
    groups = [part["x-rlstream-group-id"] for part in parts if "x-rlstream-group-id" in part]
    merged = {"x-rlstream-trajectory-id": ids[0], "x-rlstream-trajectory-ids": ",".join(ids),
              "x-rlstream-policy-version": parts[0]["x-rlstream-policy-version"]}
    if groups:
        merged["x-rlstream-group-id"] = groups[0]
        if len(groups) > 1:
            merged["x-rlstream-group-ids"] = ",".join(groups)
    return merged


COMPLETION_REQUEST = RequestShape("a completion request", required="prompt", choices=True, prompts=True)


class Completions:
    """The Completions endpoint of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def serve(self, request: Request) -> Response:
        gw, config = self.gw, self.gw.config
        started = time.perf_counter()
        body = checked_body(await request.body(), COMPLETION_REQUEST, config)
        caller, task, session_id, captured = gw.admit(request, str(body.get("model", "")))
        gw.keys.charge(caller, requested_choices(body) * prompt_count(body) - 1)  # each choice of each prompt
        if not captured:
            return await gw.passthrough("/completions", body)
        routed = await gw.routed(str(body.get("model", "")), session_id, caller, body.get("user"))
        if isinstance(routed, Response):
            return routed
        model, version, base = routed
        stream = bool(body.get("stream"))
        plain = {**body, "model": model}
        sent = completions_upstream_request(plain, gw.request_token_data, config.request_logprobs)
        upstream_started = time.perf_counter()
        try:
            upstream, refused = await gw.send(base + "/completions", sent, plain, stream, rejects_extensions)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, config)
        if refused:
            gw.request_token_data = False
        asked = completions_asked(body)
        recorded = recorded_request(body)
        if stream and upstream.status_code == 200:
            return await self._stream(upstream, request, body, recorded, asked, caller, session_id, task, version,
                                      model, started, upstream_started)
        raw = await upstream.aread() if stream else upstream.content
        await upstream.aclose()
        upstream_s = time.perf_counter() - upstream_started
        if upstream.status_code != 200:
            return upstream_refusal(upstream, raw, "/v1/completions")
        payload = upstream_json(upstream, raw, config.max_choices)
        if isinstance(payload, Response):
            return payload
        choices = ordered_choices([c for c in payload.get("choices") or [] if isinstance(c, dict)])
        if len(choices) > 1 and session_id is None:
            headers = self._capture_choices(body, choices, version, task, model, caller.tenant)
        else:
            if len(choices) > 1:
                log.warning("several choices inside a session: the session keeps the first", session_id=session_id,
                            choices=len(choices))
            tokens = completion_tokens(choices[0]) if choices else CompletionTokens(None, None, None)
            traj, headers = gw.begin(session_id, recorded, tokens.prompt_ids, version, task, caller.tenant)
            if choices:
                self._finish(ChoiceSlot(traj, recorded), tokens, str(choices[0].get("text") or ""),
                             choices[0].get("finish_reason"), model, version)
        out = filter_completion(payload, asked)
        if out.get("model") == model:
            out["model"] = body.get("model", model)
        answer = JSONResponse(out, headers=gw.sign(headers, caller, request_session(request), payload.get("id")))
        await gw.overhead(ROUTE, False, started, upstream_s)
        return answer

    def _begin_slots(self, body: dict[str, Any], n: int, prompts: int, version: int, task: str | None,
                     tenant: str | None,
                     prompts_known: bool = True) -> tuple[list[ChoiceSlot], dict[str, str]]:
        """One slot per choice of ``prompts`` prompts asked ``n`` times each (vLLM's order: choice ``i * n + j`` is
        sample ``j`` of prompt ``i``): each prompt's ``n`` choices one group, a prompt asked once a trajectory of its
        own; and the headers naming them all. ``prompts_known`` False: which prompt a choice answers is unknown (it
        is recorded without the prompt's text; its turn still has vLLM's exact prompt token ids)."""
        slots: list[ChoiceSlot] = []
        parts: list[dict[str, str]] = []
        for prompt in range(prompts):
            recorded = recorded_request(body, prompt if prompts_known else -1)
            if n > 1:
                trajs, headers = self.gw.begin_group(n, version, task, tenant)
            else:
                traj, headers = self.gw.begin(None, recorded, None, version, task, tenant)
                trajs = [traj]
            slots += [ChoiceSlot(traj, recorded) for traj in trajs]
            parts.append(headers)
        return slots, merged_headers(parts)

    def _capture_choices(self, body: dict[str, Any], choices: list[dict[str, Any]], version: int, task: str | None,
                         served: str, tenant: str | None) -> dict[str, str]:
        """Every choice of a whole (not streamed) answer outside a session, grouped by prompt."""
        n, prompts = requested_choices(body), prompt_count(body)
        if len(choices) == n * prompts:
            slots, headers = self._begin_slots(body, n, prompts, version, task, tenant)
        else:
            log.warning("choices not n per prompt as asked: each captured as a trajectory of its own",
                        choices=len(choices), n=n, prompts=prompts)
            slots, headers = self._begin_slots(body, 1, len(choices), version, task, tenant, prompts_known=False)
        for slot, choice in zip(slots, choices):
            self._finish(slot, completion_tokens(choice), str(choice.get("text") or ""), choice.get("finish_reason"),
                         served, version)
        return headers

    def _finish(self, slot: ChoiceSlot, tokens: CompletionTokens, text: str, finish_reason: str | None,
                served: str, version: int) -> None:
        """Record one answered choice in its trajectory."""
        self.gw.finish(slot.trajectory, slot.recorded, {"role": "assistant", "content": text}, tokens.prompt_ids,
                       tokens.completion_ids, tokens.logprobs, finish_reason, served, version)

    async def _stream(self, response: httpx.Response, request: Request, body: dict[str, Any],
                      recorded: dict[str, Any], asked: CompletionsAsked, caller: Principal, session_id: str | None,
                      task: str | None, version: int, model: str, started: float,
                      upstream_started: float) -> Response:
        """Pass a streamed completion on chunk by chunk while following its choices; outside a session each choice has
        its trajectory from the start (grouped by prompt), in a session the first chunk's prompt token ids decide the
        session trajectory; the call is recorded once the stream ends."""
        gw = self.gw
        lines = response.aiter_lines()
        n, prompts = requested_choices(body), prompt_count(body)
        several = n * prompts > 1
        follow = CompletionStream(asked, model, str(recorded.get("model") or model),
                                  choices=n * prompts if several and session_id is None else 1)
        try:
            head = await read_head(response, lines, first_data_event)
        except httpx.HTTPError as exc:
            return upstream_failed(exc, gw.config, "stream failed")
        rendered = "".join(follow.render(line) for line in head)
        upstream_s = time.perf_counter() - upstream_started
        if several and session_id is None:
            slots, headers = self._begin_slots(body, n, prompts, version, task, caller.tenant)
        else:
            if several:
                log.warning("several choices inside a session: the session keeps the first", session_id=session_id,
                            choices=n * prompts)
            traj, headers = gw.begin(session_id, recorded, follow.prompt_ids, version, task, caller.tenant)
            slots = [ChoiceSlot(traj, recorded)]
        headers = gw.sign(headers, caller, request_session(request), follow.response_id)

        def record() -> None:
            if follow.other_choices:
                log.warning("a streamed completion's choices beyond those captured were handed on only",
                            captured=len(slots))
            for index, slot in enumerate(slots):
                choice = follow.followed.get(index)
                if choice is not None and choice.chunks:
                    self._finish(slot, follow.tokens(index), "".join(choice.text), choice.finish_reason, model,
                                 version)

        stream = CapturedAtDone(record, follow.render,
                                lambda refusal, done: capture_refused_event(refusal) + done + "\n")

        async def handed_on() -> None:
            await gw.overhead(ROUTE, True, started, upstream_s)

        return relayed(response, lines, rendered, stream.render, handed_on, stream.at_end, headers)
