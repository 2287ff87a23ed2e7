"""The gate's evaluation episodes: how one held-out (example, sample) is run against one version and scored.

An episode is ``async episode(request: EpisodeRequest) -> SampleResult`` (:class:`Episode`), chosen by
``gate.episode`` (a ``module:function`` reference, resolved at start like the reward function). The default,
:func:`single_completion`, is one chat completion of the example's messages scored by the reward function: the
episode of a single-turn task. A multi-turn task names its own episode, the agent, tools and verifier that produce its
training traffic (the tool agent's: ``rlstream.ops.tool_task:gate_episode``), built on :func:`score_answer`.
Each result carries the episode's transcript (:class:`~rlstream.gate.rules.SampleAnswer`: the conversation, the
reward's components, the seed); the gate publishes those of a few examples per version (``gate.publish_answers``).

The request's ``client`` is an ``AsyncOpenAI`` on the replica's own server (never the gateway: nothing evaluated is
captured or trained on), without retries of its own: an episode lets the server's failures (connection errors,
timeouts, 5xx) propagate and raises :class:`NoAnswer` when the server answered nothing to judge; the evaluation
retries such a sample and fails when it cannot get an answer (evaluation.py). What the model does wrong (a bad tool
call, no final answer in its turns) is a result, scored like any other.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

from rlstream.gate.rules import SUCCESS_COMPONENT, SampleAnswer, SampleResult
from rlstream.schemas.models import Message, ToolCall
from rlstream.transport.log import get_logger

log = get_logger(__name__)


class NoAnswer(RuntimeError):
    """The server's response held nothing to judge (no choice, no message): a failed request, not a result."""


@dataclass(frozen=True)
class EpisodeRequest:
    """One held-out (example, sample) to run against one version: its example, sample index and seed, the version's
    model name, an OpenAI client on the replica, and how to sample and judge the answer."""

    example: dict[str, Any]
    sample: int
    seed: int
    model: str
    client: Any  # openai.AsyncOpenAI on the replica's server (".../v1"), max_retries 0
    reward_function: Any  # module:function(example, output) of gate.reward_function
    temperature: float
    max_tokens: int
    answer_pattern: re.Pattern[str]
    refusal_patterns: tuple[re.Pattern[str], ...] = ()

    @property
    def key(self) -> str:
        """The key that pairs this sample's results across versions."""
        return f"{self.example['id']}#{self.sample}"


class Episode(Protocol):
    """``async (request) -> SampleResult``; raises on a failure of the server (see the module docstring)."""

    async def __call__(self, request: EpisodeRequest) -> SampleResult: ...


def example_messages(example: dict[str, Any]) -> list[dict[str, Any]]:
    """The example's ``messages``, else its ``prompt`` as one user message."""
    if example.get("messages"):
        return [dict(m) for m in example["messages"]]
    return [{"role": "user", "content": str(example["prompt"])}]


def reward_of(result: Any) -> float:
    """The reward a reward function returned (a number, ``(number, components)`` or a mapping with ``reward``)."""
    return scored(result)[0]


def scored(result: Any) -> tuple[float, dict[str, float]]:
    """A reward function's result as (reward, components): a number, a ``(number, components)`` pair or a mapping
    with ``reward`` (its other numeric entries are the components); components that are not finite numbers are
    left out."""
    components: Any = {}
    if isinstance(result, dict):
        result, components = result.get("reward"), {k: v for k, v in result.items() if k != "reward"}
    elif isinstance(result, (tuple, list)) and result:
        result, components = result[0], (result[1] if len(result) > 1 and isinstance(result[1], dict) else {})
    value = float(result)
    if not math.isfinite(value):
        raise ValueError(f"reward {value} is not finite")
    parts: dict[str, float] = {}
    for name, part in components.items():
        try:
            number = float(part)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            parts[str(name)] = number
    return value, parts


def wire_message(message: dict[str, Any]) -> Message:
    """An OpenAI-style chat message (tool calls flat or under ``function``; content text or parts) as a trajectory's
    :class:`~rlstream.schemas.models.Message`."""
    content = message.get("content")
    calls = []
    for i, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or call
        arguments = function.get("arguments", "")
        calls.append(ToolCall(id=str(call.get("id") or f"call_{i}"), name=str(function.get("name", "")),
                              arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return Message(role=str(message.get("role", "user")),
                   content=content if content is None or isinstance(content, str) else json.dumps(content),
                   name=message.get("name"), tool_calls=calls or None, tool_call_id=message.get("tool_call_id"))


def arguments_parse(arguments: Any) -> bool:
    """Whether a tool call's arguments are a JSON object."""
    try:
        return isinstance(json.loads(arguments or ""), dict)
    except (TypeError, ValueError):
        return False


def tool_calls_parsed(tool_calls: list[Any]) -> int:
    """How many of an OpenAI message's tool calls carry arguments that parse as a JSON object."""
    return sum(arguments_parse(getattr(getattr(call, "function", None), "arguments", None)) for call in tool_calls)


def score_answer(request: EpisodeRequest, output: Any, answer: str, length: int, tool_calls: int = 0,
                 parsed_calls: int = 0, messages: list[dict[str, Any]] | None = None) -> SampleResult:
    """The result of one episode: ``output`` scored by the reward function (one that raises scores 0, logged),
    ``answer`` (the final text) checked for the answer and refusal patterns (an episode with tool calls parses),
    ``length`` the completion tokens of the episode. ``messages``: the episode's conversation after the example's
    own messages (the assistant's turns, tool results), default the answer as one assistant message; with the
    reward's components and the seed it is the result's :class:`SampleAnswer`."""
    try:
        reward, components = scored(request.reward_function(request.example, output))
    except Exception as exc:  # noqa: BLE001 - user code
        log.warning("evaluation reward function failed", model=request.model, key=request.key, error=str(exc))
        reward, components = 0.0, {}
    said = messages if messages is not None else [{"role": "assistant", "content": answer}]
    transcript = SampleAnswer(tuple(wire_message(m) for m in [*example_messages(request.example), *said]),
                              components, request.seed)
    return SampleResult(key=request.key, reward=reward,
                        parses=bool(request.answer_pattern.search(answer)) or tool_calls > 0,
                        refusal=any(p.search(answer) for p in request.refusal_patterns), length=length,
                        tool_calls=tool_calls, tool_calls_parsed=parsed_calls,
                        success=components.get(SUCCESS_COMPONENT),
                        answer=transcript)


async def single_completion(request: EpisodeRequest) -> SampleResult:
    """One chat completion of the example's messages (and ``tools``, when it has them), its text scored by the
    reward function: the default episode, for single-turn tasks."""
    kwargs: dict[str, Any] = {"tools": request.example["tools"]} if request.example.get("tools") else {}
    response = await request.client.chat.completions.create(
        model=request.model, messages=example_messages(request.example), temperature=request.temperature,
        max_tokens=request.max_tokens, seed=request.seed, **kwargs)
    choices = getattr(response, "choices", None)
    if not choices or getattr(choices[0], "message", None) is None:
        raise NoAnswer(f"the completion of {request.key} has no choice")
    message = choices[0].message
    text = message.content or ""
    calls = list(message.tool_calls or [])
    usage = getattr(response, "usage", None)
    length = usage.completion_tokens if usage is not None else len(text.split())
    said = {"role": "assistant", "content": message.content,
            "tool_calls": [{"id": getattr(c, "id", None), "function": {
                "name": getattr(getattr(c, "function", None), "name", ""),
                "arguments": getattr(getattr(c, "function", None), "arguments", "")}} for c in calls]}
    return score_answer(request, text, text, length, len(calls), tool_calls_parsed(calls), [said])
