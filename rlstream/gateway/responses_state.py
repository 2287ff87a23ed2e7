"""Stateful Responses: ``previous_response_id`` and ``conversation`` resolved by the gateway.

vLLM keeps stored responses in one process's memory, so behind several replicas (or after a replica restarts) a
``previous_response_id`` it is sent names nothing. The gateway keeps the state itself instead, per tenant, where every
gateway finds it (:class:`rlstream.gateway.shared_ids.TenantMap`: Redis when the gateway has it, kept
``streams.reward_window_s``, at most ``gateway.max_stored_responses`` per tenant): each answered response's items (its
whole input, the earlier turns' included, and its output as input items) under its response id, and each
conversation's items under its id. A request naming either is sent upstream with the full input (the stored items
followed by its own input) and without the two fields; the client's answer carries them as the client sent them.

``POST /v1/conversations`` creates a conversation (optionally with first items); a response made in a conversation
appends its input and output items to it. A request with ``store: false`` is answered and captured but not kept.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlstream.gateway.auth import OPEN, PRINCIPAL_KEY, Principal
from rlstream.gateway.core import Gateway, openai_error
from rlstream.gateway.limits import parse_json
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: how long a request waits for a previous response another gateway may still be writing (streamed answers are
#: stored as their final event passes), before it is answered 404
RESOLVE_RETRIES_S = (0.05, 0.1, 0.2)
STATE_FIELDS = ("previous_response_id", "conversation")


def _response_key(response_id: str) -> str:
    return "r:" + response_id


def _conversation_key(conversation_id: str) -> str:
    return "c:" + conversation_id


def input_items(given: Any) -> list[Any]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return list(given) if isinstance(given, list) else []


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return ""


def output_as_input(output: Any) -> list[dict[str, Any]]:
    """A response's ``output`` items as the input items of the next turn (a message as the assistant's text, a
    function call as its call; other items as they came)."""
    items: list[dict[str, Any]] = []
    for item in output if isinstance(output, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            items.append({"type": "message", "role": item.get("role", "assistant"),
                          "content": _text(item.get("content"))})
        elif kind == "function_call":
            items.append({"type": "function_call", "call_id": item.get("call_id", ""), "name": item.get("name", ""),
                          "arguments": item.get("arguments", "")})
        else:
            items.append(item)
    return items


def conversation_id(value: Any) -> str | None:
    """The id a request's ``conversation`` names (a string or ``{"id": ...}``)."""
    if isinstance(value, dict):
        value = value.get("id")
    return value if isinstance(value, str) and value else None


@dataclass
class ResponsesState:
    """A Responses request resolved against the stored state: ``body`` is what goes upstream (the full input, without
    ``previous_response_id`` / ``conversation``), ``echo`` the fields the client's answer carries as sent."""

    body: dict[str, Any]
    echo: dict[str, Any] = field(default_factory=dict)
    conversation: str | None = None
    items: list[Any] = field(default_factory=list)  # the whole input sent upstream

    @property
    def stateful(self) -> bool:
        return bool(self.echo)


class StoredResponses:
    """The stored Responses and conversations of one gateway's tenants (``gateway.stored``)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def _load(self, tenant: str, key: str, wait: bool) -> list[Any] | None:
        text = await self.gw.stored.get(tenant, key)
        for pause in RESOLVE_RETRIES_S if wait and text is None and self.gw.stored.shared else ():
            await asyncio.sleep(pause)
            text = await self.gw.stored.get(tenant, key)
        try:
            items = json.loads(text) if text is not None else None
        except ValueError:
            return None
        return items if isinstance(items, list) else None

    async def resolve(self, body: dict[str, Any], tenant: str) -> ResponsesState | Response:
        """``body`` with the stored items of the response or conversation it names before its own input; 404 (as
        OpenAI answers) when it names one that is unknown to ``tenant``, 400 when it names both."""
        previous, conversation = body.get("previous_response_id"), body.get("conversation")
        if previous is None and conversation is None:
            return ResponsesState(body)
        if previous is not None and conversation is not None:
            return openai_error(400, "Mutually exclusive parameters: Ensure you are only providing one of: "
                                "'previous_response_id' or 'conversation'.", param="previous_response_id")
        own = input_items(body.get("input"))
        sent = {k: v for k, v in body.items() if k not in STATE_FIELDS}
        if previous is not None:
            if not isinstance(previous, str) or not previous:
                return openai_error(400, "previous_response_id must be a response id", param="previous_response_id")
            stored = await self._load(tenant, _response_key(previous), wait=True)
            if stored is None:
                return openai_error(404, f"Previous response with id '{previous[:256]}' not found.",
                                    param="previous_response_id")
            items = [*stored, *own]
            return ResponsesState({**sent, "input": items}, {"previous_response_id": previous}, None, items)
        named = conversation_id(conversation)
        if named is None:
            return openai_error(400, "conversation must be a conversation id or {\"id\": ...}", param="conversation")
        stored = await self._load(tenant, _conversation_key(named), wait=False)
        if stored is None:
            return openai_error(404, f"Conversation with id '{named[:256]}' not found.", param="conversation")
        items = [*stored, *own]
        return ResponsesState({**sent, "input": items}, {"conversation": {"id": named}}, named, items)

    def _fits(self, text: str) -> bool:
        if len(text) <= self.gw.config.max_session_bytes:
            return True
        log.warning("stored Responses state larger than gateway.max_session_bytes; not kept", chars=len(text))
        return False

    async def remember(self, tenant: str, state: ResponsesState, payload: dict[str, Any]) -> None:
        """Keep an answered response's items (unless the request said ``store: false``) and append its turn to its
        conversation."""
        response_id = payload.get("id")
        items = [*(state.items or input_items(state.body.get("input"))), *output_as_input(payload.get("output"))]
        text = json.dumps(items, separators=(",", ":"))
        if not self._fits(text):
            return
        entries: dict[str, str] = {}
        if isinstance(response_id, str) and response_id and state.body.get("store") is not False:
            entries[_response_key(response_id)] = text
        if state.conversation is not None:
            entries[_conversation_key(state.conversation)] = text
        await self.gw.stored.put(tenant, entries)

    def answer(self, state: ResponsesState, payload: dict[str, Any]) -> dict[str, Any]:
        """The client's answer: the state fields as the client sent them (the upstream saw neither)."""
        payload.update(state.echo)
        return payload

    async def create_conversation(self, request: Request) -> Response:
        """``POST /v1/conversations``: a new conversation of the caller's tenant, optionally with ``items``."""
        caller: Principal = request.scope.get(PRINCIPAL_KEY) or OPEN
        body = parse_json(await request.body() or b"{}", self.gw.config.max_json_depth)
        if not isinstance(body, dict):
            return openai_error(400, "a conversation is created from a JSON object")
        items = body.get("items", [])
        if not isinstance(items, list) or len(items) > self.gw.config.max_messages:
            return openai_error(400, f"items: a list of at most {self.gw.config.max_messages} input items",
                                param="items")
        metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        new_id = "conv_" + secrets.token_hex(24)
        text = json.dumps(items, separators=(",", ":"))
        if not self._fits(text):
            return openai_error(413, "items larger than gateway.max_session_bytes", param="items")
        await self.gw.stored.put(caller.tenant, {_conversation_key(new_id): text})
        return JSONResponse({"id": new_id, "object": "conversation", "created_at": int(time.time()),
                             "metadata": metadata})
