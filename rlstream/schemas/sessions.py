"""The session rules shared by the gateway and the stream app's stitcher: how a call continues its session's open
trajectory, and the ids of a session's trajectories (derived, so any gateway and the stitcher name them alike)."""
from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

from rlstream.schemas.models import Message, Turn

#: How a call continues its session's open trajectory (see :func:`continues`).
TOKENS = "tokens"
MESSAGES = "messages"
#: The namespace of session trajectory ids (uuid5 of the scoped session id and the segment number).
SESSION_NAMESPACE = uuid.UUID("6f1d3c2e-5b8a-4e0f-9c3d-2a7b1e4f8d60")


def _arguments(text: str) -> object:
    """Tool-call arguments as the JSON value they spell (as sent when they are not JSON): a client that sends a
    call back as an object (the Anthropic API's ``tool_use`` input) re-serializes it with other spacing."""
    try:
        return json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return text


def same_message(a: Message, b: Message) -> bool:
    """Equal for the continuation rule: role, content, tool call id and the tool calls' names and arguments (as
    JSON values)."""
    return a.role == b.role and (a.content or "") == (b.content or "") and a.tool_call_id == b.tool_call_id and (
        [(t.name, t.arguments) for t in a.tool_calls or []] == [(t.name, t.arguments) for t in b.tool_calls or []]
        or [(t.name, _arguments(t.arguments)) for t in a.tool_calls or []]
        == [(t.name, _arguments(t.arguments)) for t in b.tool_calls or []])


def continues(previous_prompt_ids: Sequence[int] | None, previous_completion_ids: Sequence[int] | None,
              previous_history: Sequence[Message], prompt_ids: Sequence[int] | None,
              messages: Sequence[Message]) -> str | None:
    """How a call with ``prompt_ids`` / ``messages`` continues the previous call of its session, or None.

    ``previous_history`` is the previous call's request messages followed by its reply. ``TOKENS``: the new prompt
    starts with the previous prompt + completion, token for token. ``MESSAGES``: its messages start with the previous
    history, but the upstream rendered it into other tokens (a tool call the chat template re-renders, or no token
    ids at all). None: the history was rewritten (a new trajectory starts)."""
    if prompt_ids is not None and previous_prompt_ids is not None and previous_completion_ids is not None:
        prefix = [*previous_prompt_ids, *previous_completion_ids]
        if len(prompt_ids) > len(prefix) and list(prompt_ids[: len(prefix)]) == prefix:
            return TOKENS
    if len(messages) > len(previous_history) and all(same_message(a, b) for a, b in zip(messages, previous_history)):
        return MESSAGES
    return None


def session_trajectory_id(session_id: str, segment: int = 0) -> str:
    """The id of a session's ``segment``-th trajectory (0: the first; a rewritten history or a cap starts the
    next): the same in every gateway and in the stitcher, with no state shared between them."""
    return str(uuid.uuid5(SESSION_NAMESPACE, f"{session_id}#{segment}"))


def stitched_turns(calls: Sequence[tuple[Sequence[Message], Message, Turn]]) -> tuple[list[Message], list[Turn]]:
    """(messages, turns) of a trajectory made of ``calls`` (request messages, reply, turn each), as the capture
    SDK's Recording assembles them: the last call's messages and reply, one turn per call with ``message_index``
    pointing at its reply in them (None for a call that is not part of that conversation)."""
    if not calls:
        return [], []
    last_request, last_reply, _ = calls[-1]
    conversation = [*last_request, last_reply]
    turns = []
    for request, reply, turn in calls:
        index = len(request)
        inside = index < len(conversation) and same_message(conversation[index], reply) and all(
            same_message(a, b) for a, b in zip(conversation[:index], request))
        turns.append(turn.model_copy(update={"message_index": index if inside else None}))
    return conversation, turns
