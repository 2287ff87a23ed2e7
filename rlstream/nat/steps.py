"""NAT intermediate steps -> one conversation with its trainable turns (rlstream's Message and Turn).

Each LLM call of the target model inside a target function is one turn: its prompt is the messages the
call was given (LLM_START ``data.input``), its completion the message it returned (LLM_END ``data.payload``),
tool calls included. Calls whose prompt extends the conversation so far (the usual agent loop: the previous
answer, then tool results) extend it; a call that rewrote its context starts the conversation again, and the
turns it replaced are counted in :attr:`Conversation.replaced_turns`. A turn's tool calls come from the
next call's input when the LLM_END step lost them (NAT's step serialisation drops them); a run that ends on a
tool call keeps that last turn without its calls.

Messages are converted with LangChain's public ``convert_to_openai_messages``; tool calls stay tool calls
(NAT's ART adapter flattens them into assistant text). A turn whose call was recorded with its token data
(rlstream/nat/token_capture.py) carries the response's prompt and completion token ids and logprobs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from rlstream.rollout.capture import to_message
from rlstream.schemas.models import Message, Turn

WORKFLOW = "<workflow>"


@dataclass
class Conversation:
    """The messages of one workflow run and the turns (assistant messages) to train on."""

    messages: list[Message] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    replaced_turns: int = 0
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # message index -> reported token logprobs
    turns_with_token_data: int = 0  # turns whose token ids and logprobs came from the LLM response


#: ``lookup(prompt, completion)``: the token data of a recorded call (see rlstream/nat/token_capture.py), or None
TokenLookup = Callable[[Sequence[Message], Message], Any]


def _attr(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _data(step: Any) -> Any:
    return _attr(_attr(step, "payload"), "data")


def openai_messages(raw: Any) -> list[dict[str, Any]]:
    """LangChain messages (objects, their ``model_dump``, or OpenAI dicts) as OpenAI chat dicts."""
    from langchain_core.messages import convert_to_openai_messages

    items = raw if isinstance(raw, (list, tuple)) else [raw]
    prepared = []
    for item in items:
        if isinstance(item, dict) and "role" not in item and "type" in item:
            item = _from_dump(item)
        prepared.append(item)
    converted = convert_to_openai_messages(prepared)
    return converted if isinstance(converted, list) else [converted]


def _from_dump(data: dict[str, Any]) -> Any:
    """A LangChain message from its ``model_dump`` (what NAT's copies of steps hold)."""
    from langchain_core.messages import messages_from_dict

    return messages_from_dict([{"type": data["type"], "data": data}])[0]


def _arguments(text: str) -> str:
    """Tool-call arguments compared by value: frameworks re-serialise the JSON they parsed."""
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except ValueError:
        return text.strip()


def message_key(m: Message) -> tuple[Any, ...]:
    """A message compared by role, text, tool calls (name and arguments by value) and tool_call_id."""
    calls = tuple((c.name, _arguments(c.arguments)) for c in m.tool_calls or ())
    return (m.role, (m.content or "").strip(), calls, m.tool_call_id or "")


def _same(recorded: Message, prompted: Message) -> bool:
    """``prompted`` (a later call's input) repeats ``recorded``. A completion recorded without tool calls
    matches its later copy with them: NAT's serialised LLM_END steps drop an AIMessage's tool calls, which
    the next call's input still has."""
    if recorded.role == "assistant" and not recorded.tool_calls:
        return message_key(recorded)[:2] == message_key(prompted)[:2]
    return message_key(recorded) == message_key(prompted)


def _extends(history: Sequence[Message], prompt: Sequence[Message]) -> bool:
    return len(prompt) >= len(history) and all(_same(a, b) for a, b in zip(history, prompt))


def completion_message(end_step: Any) -> tuple[dict[str, Any] | None, list[float] | None]:
    """The assistant message an LLM_END step returned, and the token logprobs it reported (if any)."""
    data = _data(end_step)
    payload = _attr(data, "payload")
    message = _attr(payload, "message")
    if message is None:
        output = _attr(data, "output")
        return ({"role": "assistant", "content": output if isinstance(output, str) else ""} if output is not None
                else None), None
    converted = openai_messages(message)[0]
    converted["role"] = "assistant"
    logprobs = None
    content = _attr(_attr(message, "response_metadata", {}) or {}, "logprobs")
    entries = _attr(content, "content") if content is not None else None
    if entries:
        logprobs = [float(_attr(e, "logprob", 0.0)) for e in entries]
    return converted, logprobs


def _is_target(step: Any, target_functions: Sequence[str], target_models: set[str] | None) -> bool:
    ancestry = _attr(step, "function_ancestry")
    function = _attr(ancestry, "function_name")
    if WORKFLOW not in target_functions and function not in target_functions:
        return False
    model = _attr(_attr(step, "payload"), "name")
    return target_models is None or model in target_models


def _event_type(step: Any) -> str:
    value = _attr(_attr(step, "payload"), "event_type")
    return str(getattr(value, "value", value))


def conversation_from_steps(steps: Iterable[Any], target_functions: Sequence[str],
                            target_models: set[str] | None, token_lookup: TokenLookup | None = None) -> Conversation:
    """The conversation of one workflow run (see the module docstring); ``target_models`` None = every model.
    With ``token_lookup``, a turn whose call was recorded gets the token ids and logprobs of the response."""
    starts: dict[str, Any] = {}
    conv = Conversation()
    for step in steps:
        kind = _event_type(step)
        uuid = _attr(_attr(step, "payload"), "UUID")
        if kind == "LLM_START":
            starts[uuid] = step
            continue
        if kind != "LLM_END" or not _is_target(step, target_functions, target_models):
            continue
        start = starts.pop(uuid, None)
        completion, logprobs = completion_message(step)
        if start is None or completion is None:
            continue
        prompt = [to_message(m) for m in openai_messages(_attr(_data(start), "input") or [])]
        if not prompt:
            continue
        if _extends(conv.messages, prompt):
            # the prompt's copies are the complete ones (tool calls kept)
            conv.messages = list(prompt)
        else:
            conv.replaced_turns += len(conv.turns)
            conv.messages, conv.turns, conv.logprobs = list(prompt), [], {}
        conv.messages.append(to_message(completion))
        index = len(conv.messages) - 1
        model = _attr(_attr(step, "payload"), "name")
        function = _attr(_attr(step, "function_ancestry"), "function_name")
        conv.turns.append(Turn(message_index=index, model=model or None, function=function or None))
        if logprobs:
            conv.logprobs[index] = logprobs
    if token_lookup is not None:
        _attach_token_data(conv, token_lookup)
    return conv


def _attach_token_data(conv: Conversation, token_lookup: TokenLookup) -> None:
    """Give each turn the token data of its recorded call, looked up once the conversation is whole: a completion's
    tool calls (lost by NAT's LLM_END step) are back by then, and they tell apart the calls of one prompt whose
    completions differ only in their tool calls (the generations of one example)."""
    for position, turn in enumerate(conv.turns):
        index = turn.message_index
        captured = token_lookup(conv.messages[:index], conv.messages[index]) if index is not None else None
        if captured is None:
            continue
        conv.turns[position] = turn.model_copy(update={"prompt_token_ids": captured.prompt_token_ids,
                                                       "completion_token_ids": captured.completion_token_ids,
                                                       "completion_logprobs": captured.completion_logprobs})
        conv.turns_with_token_data += 1
