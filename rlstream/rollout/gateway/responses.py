"""The OpenAI Responses API as chat messages: what the gateway records of a ``/v1/responses`` call.

A request's ``instructions`` become a system message and its ``input`` (a string, or a list of messages and
``function_call`` / ``function_call_output`` items) the conversation; the response's ``output`` items become the
assistant message (text of its ``message`` items, its ``function_call`` items as tool calls).
"""
from __future__ import annotations

from typing import Any


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
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
    for item in payload.get("output") or []:
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
