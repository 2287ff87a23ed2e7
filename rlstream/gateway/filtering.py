"""What the gateway asks the upstream for on top of the client's request, and how it takes it back out."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

#: Options the gateway adds so that the upstream returns token ids (vLLM's extension) and logprobs.
TOKEN_IDS = "return_token_ids"


@dataclass(frozen=True)
class ClientAsked:
    """What the client asked for itself (and so gets back)."""

    logprobs: bool = False
    token_ids: bool = False


def client_asked(body: dict[str, Any]) -> ClientAsked:
    return ClientAsked(logprobs=bool(body.get("logprobs")), token_ids=bool(body.get(TOKEN_IDS)))


def upstream_request(body: dict[str, Any], request_token_data: bool = True,
                     request_logprobs: bool = True) -> dict[str, Any]:
    """The request sent upstream: the client's, plus ``return_token_ids`` when ``request_token_data`` and
    ``logprobs`` when both are wanted (the client's own ``logprobs`` is always passed on)."""
    out = dict(body)
    if request_token_data:
        if request_logprobs and not out.get("logprobs"):
            out["logprobs"] = True
        out[TOKEN_IDS] = True
    return out


def _strip_choice(choice: dict[str, Any], asked: ClientAsked) -> None:
    if not asked.logprobs and "logprobs" in choice:
        choice["logprobs"] = None
    if not asked.token_ids and "token_ids" in choice:
        choice["token_ids"] = None


def filter_response(payload: dict[str, Any], asked: ClientAsked) -> dict[str, Any]:
    """A chat completion (or one stream chunk) with only what the client asked for: the logprobs and token
    ids the gateway added are set back to null (as the upstream writes them when not asked)."""
    out = copy.copy(payload)
    if not asked.token_ids and "prompt_token_ids" in out:
        out["prompt_token_ids"] = None
    choices = out.get("choices")
    if isinstance(choices, list):
        new = []
        for choice in choices:
            if isinstance(choice, dict):
                choice = dict(choice)
                _strip_choice(choice, asked)
            new.append(choice)
        out["choices"] = new
    return out


def rejects_extensions(status: int, text: str) -> bool:
    """An upstream that refuses the token-data options (a plain OpenAI-compatible server)."""
    lowered = text.lower()
    return status in (400, 422) and any(word in lowered for word in (TOKEN_IDS, "logprobs", "extra"))
