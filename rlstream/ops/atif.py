"""ATIF (Agent Trajectory Interchange Format) <-> :class:`TrajectoryEvent`.

ATIF is the trajectory format NeMo Agent Toolkit and NeMo Gym exchange (RFC 0001-trajectory-format of the Harbor
framework, https://github.com/harbor-framework/harbor; NAT's pydantic models are the ``nvidia-nat-atif`` package,
``nat.atif``, used here as the schema). One :class:`TrajectoryEvent` is one ATIF ``Trajectory``:

* system / user messages are ``system`` / ``user`` steps; an assistant message is an ``agent`` step whose
  ``metrics`` carry the turn recorded for it: ``prompt_token_ids``, ``completion_token_ids`` and ``logprobs``
  (ATIF's own fields for training without re-tokenization), ``model_name`` the turn's model;
* an assistant's tool calls are the step's ``tool_calls`` (arguments as a JSON object); each tool message that
  follows is an ``observation`` result of that step (``source_call_id`` = its ``tool_call_id``);
* what ATIF has no field for (run, example, group, reward, metadata, a turn's trainable flag / finish reason /
  temperature / version, a message's ``name``, a ``null`` content, tool-call arguments that are not a JSON object
  written the canonical way) goes under the ``rlstream`` key of the ``extra`` maps the spec leaves open, so that an
  export imported back is the same trajectory, every token id and logprob included.

A trajectory written by another ATIF producer (no ``rlstream`` extras) imports too: its agent steps' token ids
become turns, ``extra["reward"]`` (or ``final_metrics.extra["reward"]``) the reward.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from nat.atif import Agent, FinalMetrics, Metrics, Observation, ObservationResult, Step, Trajectory
from nat.atif import ToolCall as AtifToolCall

from rlstream.schemas.models import Message, ToolCall, TrajectoryEvent, TrajectorySource, Turn

#: the key of the ``extra`` maps that holds what ATIF has no field for
EXTRA_KEY = "rlstream"
ATIF_AGENT_NAME = "rlstream"
_CONTENT_NAMESPACE = uuid.UUID("0f5a2c61-7d3e-4b8a-9c1f-6e2d4a8b3c57")
_SOURCE_OF_ROLE = {"system": "system", "user": "user", "assistant": "agent"}
_ROLE_OF_SOURCE = {"system": "system", "user": "user", "agent": "assistant"}
#: Turn fields ATIF's step metrics do not hold (the token arrays and the model have ATIF fields)
_TURN_EXTRA_FIELDS = ("function", "trainable", "finish_reason", "policy_version", "temperature")


class AtifConversionError(ValueError):
    """A trajectory that has no faithful counterpart in the other format (the message says why)."""


# --- rlstream -> ATIF ---------------------------------------------------------------------------------------
def to_atif(event: TrajectoryEvent) -> Trajectory:
    """The ATIF trajectory of ``event`` (see the module docstring for the mapping)."""
    turns_at: dict[int, tuple[int, Turn]] = {}
    unattached: list[dict[str, Any]] = []
    for index, turn in enumerate(event.turns):
        at = turn.message_index
        if (at is not None and 0 <= at < len(event.messages) and event.messages[at].role == "assistant"
                and at not in turns_at):
            turns_at[at] = (index, turn)
        else:
            unattached.append({"turn_index": index, **turn.model_dump(mode="json")})
    steps: list[Step] = []
    for position, message in enumerate(event.messages):
        if message.role == "tool":
            if not steps:
                raise AtifConversionError("the first message is a tool message: no step to attach its result to")
            _attach_tool_result(steps[-1], message)
            continue
        steps.append(_step_of(len(steps) + 1, message, turns_at.get(position)))
    root_extra: dict[str, Any] = {
        "run_id": event.run_id, "example_id": event.example_id, "group_id": event.group_id,
        "group_size": event.group_size, "generation_index": event.generation_index, "policy": event.policy,
        "policy_version": event.policy_version, "source": _source_value(event),
        "reward_components": dict(event.reward_components), "metadata": dict(event.metadata),
        "target": event.target, "created_at": event.created_at.isoformat(), "producer_id": event.producer_id,
        "message_count": len(event.messages), "turn_count": len(event.turns),
    }
    if unattached:
        root_extra["unattached_turns"] = unattached
    prompt_total = sum(len(t.prompt_token_ids or ()) for t in event.turns)
    completion_total = sum(len(t.completion_token_ids or ()) for t in event.turns)
    models = [t.model for t in event.turns if t.model]
    return Trajectory(
        session_id=event.group_id,
        trajectory_id=event.trajectory_id,
        agent=Agent(name=event.target or ATIF_AGENT_NAME, version=str(event.policy_version),
                    model_name=models[0] if models else event.policy),
        steps=steps,
        final_metrics=FinalMetrics(total_prompt_tokens=prompt_total, total_completion_tokens=completion_total,
                                   total_steps=len(steps)),
        extra={"reward": event.reward, "task": event.metadata.get("task"), EXTRA_KEY: root_extra},
    )


def _step_of(step_id: int, message: Message, turn: tuple[int, Turn] | None) -> Step:
    source = _SOURCE_OF_ROLE.get(message.role, "user")
    extra: dict[str, Any] = {}
    if _ROLE_OF_SOURCE[source] != message.role:
        extra["role"] = message.role
    if message.content is None:
        extra["content_null"] = True
    if message.name is not None:
        extra["name"] = message.name
    if message.tool_call_id is not None:
        extra["tool_call_id"] = message.tool_call_id
    fields: dict[str, Any] = {}
    if message.tool_calls is not None:
        if source != "agent":
            raise AtifConversionError(f"a {message.role} message carries tool calls; ATIF allows them on agent steps")
        fields["tool_calls"] = [_atif_tool_call(call) for call in message.tool_calls]
    if turn is not None:
        index, record = turn
        fields["metrics"] = Metrics(
            prompt_tokens=len(record.prompt_token_ids) if record.prompt_token_ids is not None else None,
            completion_tokens=len(record.completion_token_ids) if record.completion_token_ids is not None else None,
            prompt_token_ids=record.prompt_token_ids, completion_token_ids=record.completion_token_ids,
            logprobs=record.completion_logprobs)
        fields["model_name"] = record.model
        fields["llm_call_count"] = 1
        extra["turn"] = {"turn_index": index, **{name: getattr(record, name) for name in _TURN_EXTRA_FIELDS}}
    return Step(step_id=step_id, source=source, message=message.content or "",
                extra={EXTRA_KEY: extra} if extra else None, **fields)


def _atif_tool_call(call: ToolCall) -> AtifToolCall:
    extra: dict[str, Any] = {}
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        arguments = {}
    if _canonical_arguments(arguments) != call.arguments:
        extra["arguments"] = call.arguments  # the exact string (not a JSON object, or written another way)
    if call.type != "function":
        extra["type"] = call.type
    return AtifToolCall(tool_call_id=call.id, function_name=call.name, arguments=arguments,
                        extra={EXTRA_KEY: extra} if extra else None)


def _canonical_arguments(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False) if arguments else ""


def _attach_tool_result(step: Step, message: Message) -> None:
    call_ids = {call.tool_call_id for call in step.tool_calls or ()}
    extra: dict[str, Any] = {}
    if message.tool_call_id not in call_ids:
        extra["tool_call_id"] = message.tool_call_id  # ATIF requires source_call_id to name a call of this step
    if message.name is not None:
        extra["name"] = message.name
    if message.content is None:
        extra["content_null"] = True
    result = ObservationResult(source_call_id=message.tool_call_id if message.tool_call_id in call_ids else None,
                               content=message.content or "", extra={EXTRA_KEY: extra} if extra else None)
    if step.observation is None:
        step.observation = Observation(results=[])
    step.observation.results.append(result)


def _source_value(event: TrajectoryEvent) -> str:
    return event.source.value if isinstance(event.source, TrajectorySource) else str(event.source)


# --- ATIF -> rlstream ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImportedTrajectory:
    """An ATIF trajectory read back: the event it describes (under its original ids) and where it came from."""

    event: TrajectoryEvent
    original_run_id: str | None
    original_source: str | None


def from_atif(trajectory: Trajectory, *, default_policy: str, default_run_id: str) -> ImportedTrajectory:
    """The :class:`TrajectoryEvent` an ATIF trajectory describes, with the ids and run it was exported with when
    it carries rlstream's extras (else ids derived from its ``trajectory_id`` / ``session_id``)."""
    root = dict((trajectory.extra or {}).get(EXTRA_KEY) or {})
    messages: list[Message] = []
    turns: list[tuple[int, Turn]] = []
    for step in trajectory.steps:
        extra = _rlstream_extra(step.extra)
        role = extra.get("role") or _ROLE_OF_SOURCE[step.source]
        content = None if extra.get("content_null") else _text_of(step.message, f"step {step.step_id}")
        tool_calls = [_rlstream_tool_call(call) for call in step.tool_calls] if step.tool_calls is not None else None
        messages.append(Message(role=role, content=content, name=extra.get("name"), tool_calls=tool_calls,
                                tool_call_id=extra.get("tool_call_id")))
        metrics = step.metrics or Metrics()
        if "turn" in extra or _has_token_data(metrics):
            turn_extra = dict(extra.get("turn") or {})
            index = turn_extra.pop("turn_index", None)
            turns.append((index if isinstance(index, int) else 10**9 + len(turns), Turn(
                message_index=len(messages) - 1, model=step.model_name,
                prompt_token_ids=metrics.prompt_token_ids,
                completion_token_ids=metrics.completion_token_ids,
                completion_logprobs=metrics.logprobs,
                **{k: v for k, v in turn_extra.items() if k in _TURN_EXTRA_FIELDS and v is not None})))
        for result in (step.observation.results if step.observation is not None else ()):
            result_extra = _rlstream_extra(result.extra)
            messages.append(Message(
                role="tool", content=None if result_extra.get("content_null") else _text_of(
                    result.content or "", f"step {step.step_id} observation"),
                name=result_extra.get("name"),
                tool_call_id=result.source_call_id if result.source_call_id is not None
                else result_extra.get("tool_call_id")))
    for raw in root.get("unattached_turns") or ():
        turn_fields = dict(raw)
        index = turn_fields.pop("turn_index", 10**9 + len(turns))
        turns.append((index, Turn.model_validate(turn_fields)))
    turns.sort(key=lambda pair: pair[0])
    reward = (trajectory.extra or {}).get("reward")
    if reward is None and trajectory.final_metrics is not None:
        reward = (trajectory.final_metrics.extra or {}).get("reward")
    trajectory_id = trajectory.trajectory_id or content_id(trajectory)
    example_id = root.get("example_id") or trajectory.session_id or trajectory_id
    run_id = root.get("run_id") or default_run_id
    metadata = dict(root.get("metadata") or {})
    task = (trajectory.extra or {}).get("task")
    if task is not None and "task" not in metadata:
        metadata["task"] = str(task)
    fields: dict[str, Any] = dict(
        trajectory_id=trajectory_id, run_id=run_id, example_id=example_id,
        group_id=root.get("group_id") or trajectory.session_id or f"{run_id}:{example_id}",
        group_size=root.get("group_size", 1), generation_index=root.get("generation_index", 0),
        policy=root.get("policy") or default_policy,
        policy_version=root.get("policy_version", _int_or_zero(trajectory.agent.version)),
        messages=messages, turns=[turn for _, turn in turns], reward=reward,
        reward_components=root.get("reward_components") or {}, metadata=metadata,
        target=root.get("target", trajectory.agent.name), producer_id=root.get("producer_id") or "atif",
    )
    if root.get("created_at"):
        fields["created_at"] = root["created_at"]
    if root.get("source"):
        fields["source"] = root["source"]
    event = TrajectoryEvent.model_validate(fields)
    if "message_count" in root and root["message_count"] != len(messages):
        raise AtifConversionError(f"the trajectory says it had {root['message_count']} messages; its steps hold "
                                  f"{len(messages)}")
    if "turn_count" in root and root["turn_count"] != len(event.turns):
        raise AtifConversionError(f"the trajectory says it had {root['turn_count']} turns; its steps hold "
                                  f"{len(event.turns)}")
    return ImportedTrajectory(event=event, original_run_id=root.get("run_id"), original_source=root.get("source"))


def content_id(trajectory: Trajectory) -> str:
    """The id of a trajectory that names none (ATIF before v1.7 has only the run-scoped ``session_id``): a uuid5 of
    its content, so importing the same file twice gives the same ids."""
    canonical = json.dumps(trajectory.to_json_dict(), sort_keys=True, ensure_ascii=False)
    return str(uuid.uuid5(_CONTENT_NAMESPACE, canonical))


def _rlstream_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    value = (extra or {}).get(EXTRA_KEY)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AtifConversionError(f"extra[{EXTRA_KEY!r}] is a {type(value).__name__}, not an object")
    return value


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if part.type != "text":
            raise AtifConversionError(f"{where}: {part.type} content is not supported (text only)")
        parts.append(part.text or "")
    return "".join(parts)


def _rlstream_tool_call(call: AtifToolCall) -> ToolCall:
    extra = _rlstream_extra(call.extra)
    arguments = extra.get("arguments")
    return ToolCall(id=call.tool_call_id, type=extra.get("type", "function"), name=call.function_name,
                    arguments=arguments if isinstance(arguments, str) else _canonical_arguments(call.arguments))


def _has_token_data(metrics: Metrics) -> bool:
    return any(v is not None for v in (metrics.prompt_token_ids, metrics.completion_token_ids, metrics.logprobs))


def _int_or_zero(text: str) -> int:
    return int(text) if text.isdigit() else 0
