"""Capture of LLM calls made through the OpenAI Python client (sync and async).

Usage::

    client = instrument(AsyncOpenAI(base_url=..., api_key=...))
    with Recording(target_functions=["solver"], target_model="policy") as rec:
        await my_agent(client)                      # calls inside @target_function("solver") are trainable
    event = rec.to_event(run_id=..., example_id=..., ...)

Each chat completion of the target model becomes a :class:`Turn` (prompt and completion token ids and
logprobs when the server returns them: vLLM's ``return_token_ids`` and ``logprobs``), and the
conversation (messages, tool calls, tool results) becomes the trajectory's messages. Calls made with
no active recording pass straight through. Calls to other models are not recorded. Servers that
return no token data still give recorded turns (the learner trains them on-policy).
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, TypeVar

from rlstream.rollout.streaming import StreamAccumulator
from rlstream.schemas.sampling import NEUTRAL_TEMPERATURE
from rlstream.transport.log import get_logger
from rlstream.schemas.models import (TOOLS_METADATA_KEY, Message, ToolCall, TrajectoryEvent, TrajectorySource,
                                     Turn, merged_tools)

log = get_logger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

#: ``target_functions`` entry that makes every call of the workflow trainable (NAT's default).
WORKFLOW = "<workflow>"

_recording: contextvars.ContextVar["Recording | None"] = contextvars.ContextVar("rlstream_recording", default=None)
_functions: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("rlstream_functions", default=())
_route: contextvars.ContextVar["Callable[[str], str] | None"] = contextvars.ContextVar("rlstream_route", default=None)
_route_version: contextvars.ContextVar["Callable[[str], int | None] | None"] = contextvars.ContextVar(
    "rlstream_route_version", default=None)


# --- marking target functions ------------------------------------------------------------------
class target_function:  # noqa: N801 - reads as a decorator
    """Mark an agent function: LLM calls made while it runs carry its name.

    Works as a decorator (sync or async functions) and as a context manager::

        @target_function("solver")
        async def solve(...): ...

        with target_function("planner"):
            ...
    """

    def __init__(self, name: str | Callable[..., Any] | None = None) -> None:
        self._func: Callable[..., Any] | None = None
        if callable(name):
            self._func, name = name, name.__name__
        self.name = name
        self._tokens: list[contextvars.Token[tuple[str, ...]]] = []

    def __call__(self, func: F) -> F:
        name = self.name or func.__name__
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with target_function(name):
                    return await func(*args, **kwargs)
            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with target_function(name):
                return func(*args, **kwargs)
        return wrapper  # type: ignore[return-value]

    def __enter__(self) -> "target_function":
        if not self.name:
            raise ValueError("target_function used as a context manager needs a name")
        self._tokens.append(_functions.set(_functions.get() + (self.name,)))
        return self

    def __exit__(self, *exc: object) -> None:
        _functions.reset(self._tokens.pop())


def active_functions() -> tuple[str, ...]:
    """The marked functions the current code runs inside, outermost first."""
    return _functions.get()


@contextmanager
def routing(route: Callable[[str], str], version: Callable[[str], int | None] | None = None) -> Iterator[None]:
    """Within this block, an instrumented client sends requests for model ``m`` to ``route(m)``, and records each
    such call's turn with ``version(m)``, the policy version that answers it (None: not known).

    The rollout runner uses it to send the policy's requests to the newest loaded version (a LoRA
    adapter name) while the workflow keeps asking for the plain policy name.
    """
    token = _route.set(route)
    version_token = _route_version.set(version)
    try:
        yield
    finally:
        _route_version.reset(version_token)
        _route.reset(token)


def routed_version(model: str) -> int | None:
    """The policy version a call for ``model`` made now is served by (from :func:`routing`; None when unknown)."""
    version = _route_version.get()
    return version(model) if version is not None else None


def request_temperature(request: dict[str, Any], default: float = NEUTRAL_TEMPERATURE) -> float:
    """The sampling temperature of a chat request: its ``temperature`` when it is a number, else ``default``, the
    server's for a request that names none (an absent or non-numeric value, such as the client's "not given"
    marker; :func:`rlstream.schemas.sampling.server_default_temperature` for vLLM)."""
    value = request.get("temperature")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return default


# --- one recorded trajectory ---------------------------------------------------------------------
@dataclass
class RecordedCall:
    """One chat completion of the target model, as recorded."""

    request_messages: list[Message]
    response_message: Message
    turn: Turn
    served_model: str
    #: the request's tool schemas (OpenAI's ``tools``), as JSON-ready dicts
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Recording:
    """Collects the target model's calls made while it is active (a context manager, sync or async)."""

    target_functions: list[str] = field(default_factory=lambda: [WORKFLOW])
    target_model: str | None = None
    calls: list[RecordedCall] = field(default_factory=list)
    #: the temperature a call that names none was sampled at: the server's default
    #: (:func:`rlstream.schemas.sampling.server_default_temperature` for vLLM)
    default_temperature: float = NEUTRAL_TEMPERATURE
    _token: contextvars.Token["Recording | None"] | None = None
    _fn_token: contextvars.Token[tuple[str, ...]] | None = None

    def __enter__(self) -> "Recording":
        self._token = _recording.set(self)
        self._fn_token = _functions.set(_functions.get() + (WORKFLOW,))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fn_token is not None:
            _functions.reset(self._fn_token)
        if self._token is not None:
            _recording.reset(self._token)

    async def __aenter__(self) -> "Recording":
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    # -- filtering --
    def wants_model(self, model: str) -> bool:
        return self.target_model is None or model == self.target_model

    def trainable_here(self) -> tuple[bool, str | None]:
        """(trainable, innermost marked function) for a call made now."""
        stack = active_functions()
        targets = set(self.target_functions or [WORKFLOW])
        innermost = stack[-1] if stack else None
        return any(name in targets for name in stack), innermost

    def add(self, call: RecordedCall) -> None:
        self.calls.append(call)

    # -- assembly --
    @property
    def trainable_calls(self) -> list[RecordedCall]:
        return [c for c in self.calls if c.turn.trainable]

    def messages(self) -> list[Message]:
        """The conversation: the last recorded call's messages plus its answer, and any messages that
        the caller adds with ``extend_messages`` (e.g. tool results after the final call)."""
        if not self.calls:
            return list(self._extra)
        last = self.calls[-1]
        return [*last.request_messages, last.response_message, *self._extra]

    _extra: list[Message] = field(default_factory=list)

    def extend_messages(self, messages: list[dict[str, Any] | Message]) -> None:
        """Append messages that came after the last LLM call (e.g. a final tool result)."""
        self._extra.extend(to_message(m) for m in messages)

    def turns(self) -> list[Turn]:
        """One turn per recorded call, with ``message_index`` pointing at its answer in :meth:`messages`."""
        conversation = self.messages()
        out = []
        for call in self.calls:
            turn = call.turn.model_copy()
            index = len(call.request_messages)
            if index < len(conversation) and _same_message(conversation[index], call.response_message) and all(
                _same_message(a, b) for a, b in zip(conversation[:index], call.request_messages)
            ):
                turn.message_index = index
            else:
                turn.message_index = None  # a side conversation: its tokens still describe it fully
            out.append(turn)
        return out

    def final_text(self) -> str:
        """The content of the last recorded answer ('' when none)."""
        return (self.calls[-1].response_message.content or "") if self.calls else ""

    def to_event(
        self,
        *,
        run_id: str,
        example_id: str,
        group_id: str,
        group_size: int,
        generation_index: int,
        policy: str,
        policy_version: int,
        reward: float | None = None,
        reward_components: dict[str, float] | None = None,
        metadata: dict[str, str] | None = None,
        source: TrajectorySource = TrajectorySource.rollout,
        producer_id: str = "",
        fallback_messages: list[dict[str, Any] | Message] | None = None,
    ) -> TrajectoryEvent:
        """Assemble the TrajectoryEvent of this recording."""
        messages = self.messages() or [to_message(m) for m in (fallback_messages or [])]
        targets = sorted({c.turn.function for c in self.trainable_calls if c.turn.function})
        meta = dict(metadata or {})
        served = sorted({c.served_model for c in self.calls})
        if served:
            meta.setdefault("served_models", ",".join(served))
        tools = merged_tools(c.tools for c in self.calls)
        if tools:
            meta.setdefault(TOOLS_METADATA_KEY, json.dumps(tools, sort_keys=True))
        return TrajectoryEvent(
            run_id=run_id, example_id=example_id, group_id=group_id, group_size=group_size,
            generation_index=generation_index, policy=policy, policy_version=policy_version, source=source,
            messages=messages, turns=self.turns(), reward=reward, reward_components=dict(reward_components or {}),
            metadata=meta, target=",".join(targets) if targets else None, producer_id=producer_id,
        )


def request_tools(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool schemas a chat request offered (``tools``), as JSON-ready dicts (SDK models dumped); [] for none or
    for a value that is not a list of schemas."""
    tools = request.get("tools")
    if not isinstance(tools, (list, tuple)):
        return []
    out = []
    for tool in tools:
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump(exclude_none=True)
        if isinstance(tool, dict):
            out.append(json.loads(json.dumps(tool, default=str)))
    return out


def current_recording() -> Recording | None:
    return _recording.get()


def _same_message(a: Message, b: Message) -> bool:
    return a.role == b.role and (a.content or "") == (b.content or "") and a.tool_call_id == b.tool_call_id and (
        [(t.name, t.arguments) for t in a.tool_calls or []] == [(t.name, t.arguments) for t in b.tool_calls or []])


# --- conversions ------------------------------------------------------------------------------------
def _get(obj: Any, name: str, default: Any = None) -> Any:
    """Attribute or key access, including fields the OpenAI models keep as extras (vLLM's additions)."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(name)
    return default if value is None else value


def _content_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(_get(part, "text", "")) for part in content)
    return str(content)


def to_message(raw: dict[str, Any] | Any) -> Message:
    """An OpenAI-style message (dict or client object) as a wire :class:`Message`."""
    if isinstance(raw, Message):
        return raw
    calls = _get(raw, "tool_calls")
    tool_calls = None
    if calls:
        tool_calls = [
            ToolCall(id=str(_get(c, "id", "")), type=str(_get(c, "type", "function")),
                     name=str(_get(_get(c, "function"), "name", "")),
                     arguments=str(_get(_get(c, "function"), "arguments", "") or ""))
            for c in calls
        ]
    role = _get(raw, "role")
    if not role:
        raise ValueError(f"message without a role: {raw!r}")
    return Message(role=str(role), content=_content_text(_get(raw, "content")), name=_get(raw, "name"),
                   tool_calls=tool_calls, tool_call_id=_get(raw, "tool_call_id"))


def token_data(response: Any, choice_index: int = 0) -> tuple[list[int] | None, list[int] | None, list[float] | None]:
    """(prompt token ids, completion token ids, completion logprobs) of a chat completion; None when absent."""
    prompt_ids = _get(response, "prompt_token_ids")
    choices = _get(response, "choices") or []
    if not choices:
        return (list(prompt_ids) if prompt_ids else None), None, None
    choice = choices[choice_index]
    completion_ids = _get(choice, "token_ids")
    logprobs = None
    content = _get(_get(choice, "logprobs"), "content")
    if content:
        logprobs = [float(_get(item, "logprob")) for item in content]
    return (
        [int(t) for t in prompt_ids] if prompt_ids is not None else None,
        [int(t) for t in completion_ids] if completion_ids is not None else None,
        logprobs,
    )


# --- the client wrapper --------------------------------------------------------------------------------
def _prepare(kwargs: dict[str, Any], request_token_data: bool) -> tuple[dict[str, Any], str, bool]:
    """Apply routing and ask for token data when a recording wants this model."""
    model = str(kwargs.get("model", ""))
    recording = current_recording()
    route = _route.get()
    call_kwargs = dict(kwargs)
    if route is not None:
        call_kwargs["model"] = route(model)
    wanted = recording is not None and recording.wants_model(model)
    if wanted and request_token_data:
        call_kwargs.setdefault("logprobs", True)
        extra = dict(call_kwargs.get("extra_body") or {})
        extra.setdefault("return_token_ids", True)
        call_kwargs["extra_body"] = extra
    return call_kwargs, model, wanted


def _record(kwargs: dict[str, Any], call_kwargs: dict[str, Any], response: Any) -> None:
    recording = current_recording()
    if recording is None:
        return
    choice = (_get(response, "choices") or [None])[0]
    if choice is None:
        log.warning("chat completion without choices; not recorded", model=kwargs.get("model"))
        return
    prompt_ids, completion_ids, logprobs = token_data(response)
    _add_call(recording, recording.trainable_here(), kwargs, call_kwargs, _get(choice, "message"), prompt_ids,
              completion_ids, logprobs, _get(choice, "finish_reason"), routed_version(str(kwargs.get("model", ""))))


def _add_call(recording: Recording, where: tuple[bool, str | None], kwargs: dict[str, Any],
              call_kwargs: dict[str, Any], message: Any, prompt_ids: list[int] | None,
              completion_ids: list[int] | None, logprobs: list[float] | None, finish_reason: str | None,
              policy_version: int | None = None) -> None:
    """One finished call (streamed or not) into ``recording``, its turn tagged with the policy version that
    answered it and the temperature it was sampled at."""
    trainable, function = where
    if logprobs is not None and constrained(kwargs):
        # The server masks the logits with the grammar before computing logprobs, so these are not the
        # policy's own probabilities; the learner treats a turn without logprobs as on-policy instead.
        logprobs = None
    if completion_ids is not None and logprobs is not None and len(completion_ids) != len(logprobs):
        log.warning("token ids and logprobs differ in length; logprobs dropped", ids=len(completion_ids),
                    logprobs=len(logprobs))
        logprobs = None
    turn = Turn(model=str(kwargs.get("model")), function=function, prompt_token_ids=prompt_ids,
                completion_token_ids=completion_ids, completion_logprobs=logprobs, trainable=trainable,
                finish_reason=finish_reason, policy_version=policy_version,
                temperature=request_temperature(kwargs, recording.default_temperature))
    recording.add(RecordedCall(
        request_messages=[to_message(m) for m in kwargs.get("messages", [])],
        response_message=to_message(message),
        turn=turn,
        served_model=str(call_kwargs.get("model")),
        tools=request_tools(kwargs),
    ))


def _chunk_dict(chunk: Any) -> dict[str, Any]:
    if isinstance(chunk, dict):
        return chunk
    dump = getattr(chunk, "model_dump", None)
    return dump() if callable(dump) else {}


class _StreamRecorder:
    """Passes a stream's chunks through unchanged and records the call once the stream is exhausted (the
    recording and the target function are the ones active when the call was made)."""

    def __init__(self, inner: Any, kwargs: dict[str, Any], call_kwargs: dict[str, Any]) -> None:
        self._inner = inner
        self._kwargs, self._call_kwargs = kwargs, call_kwargs
        self._recording = current_recording()
        self._where = self._recording.trainable_here() if self._recording is not None else (False, None)
        self._version = routed_version(str(kwargs.get("model", "")))  # the routing active when the call was made
        self._acc = StreamAccumulator(None)
        self._done = False

    def _take(self, chunk: Any) -> None:
        try:
            self._acc.add(_chunk_dict(chunk))
        except Exception as exc:  # an odd chunk must not break the caller's stream
            log.warning("stream chunk not understood; the call will not be recorded", error=str(exc))
            self._done = True

    def _finish(self) -> None:
        if self._done or self._recording is None:
            return
        self._done = True
        if not self._acc.chunks:
            log.warning("stream without choices; not recorded", model=self._kwargs.get("model"))
            return
        _add_call(self._recording, self._where, self._kwargs, self._call_kwargs, self._acc.message(),
                  self._acc.prompt_ids, self._acc.completion_ids(), self._acc.logprobs(), self._acc.finish_reason,
                  self._version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class RecordingStream(_StreamRecorder):
    """A synchronous ``Stream`` of chat completion chunks, recorded."""

    def __iter__(self) -> Iterator[Any]:
        for chunk in self._inner:
            self._take(chunk)
            yield chunk
        self._finish()

    def __enter__(self) -> "RecordingStream":
        return self

    def __exit__(self, *exc: object) -> None:
        close = getattr(self._inner, "close", None)
        if callable(close):
            close()


class RecordingAsyncStream(_StreamRecorder):
    """An ``AsyncStream`` of chat completion chunks, recorded."""

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for chunk in self._inner:
            self._take(chunk)
            yield chunk
        self._finish()

    async def __aenter__(self) -> "RecordingAsyncStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        close = getattr(self._inner, "close", None)
        if callable(close):
            result = close()
            if inspect.isawaitable(result):
                await result


def constrained(kwargs: dict[str, Any]) -> bool:
    """True when the request forces its output through a grammar (forced tool choice, JSON output,
    guided decoding): the server's logprobs are then those of the masked distribution."""
    choice = kwargs.get("tool_choice")
    if kwargs.get("tools") and (choice == "required" or isinstance(choice, dict)):
        return True
    fmt = kwargs.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        return True
    extra = kwargs.get("extra_body") or {}
    return any(key.startswith("guided_") or key == "structured_outputs" for key in extra)


def _rejects_extensions(exc: Exception) -> bool:
    status = getattr(exc, "status_code", None)
    text = str(exc).lower()
    return status in (400, 422) and any(word in text for word in ("return_token_ids", "logprobs", "extra"))


class _Completions:
    """``chat.completions`` of a wrapped client; works for sync and async clients alike (an async
    client's ``create`` returns an awaitable, which is wrapped so that the response is recorded)."""

    def __init__(self, inner: Any, owner: "_Options") -> None:
        self._inner, self._owner = inner, owner

    def create(self, **kwargs: Any) -> Any:
        call_kwargs, _, wanted = _prepare(kwargs, self._owner.request_token_data)
        try:
            result = self._inner.create(**call_kwargs)
        except Exception as exc:
            if not self._should_retry_plain(wanted, exc):
                raise
            call_kwargs, _, wanted = _prepare(kwargs, False)
            result = self._inner.create(**call_kwargs)
        if inspect.isawaitable(result):
            return self._finish_async(result, kwargs, call_kwargs, wanted)
        if wanted and kwargs.get("stream"):
            return RecordingStream(result, kwargs, call_kwargs)
        if wanted:
            _record(kwargs, call_kwargs, result)
        return result

    async def _finish_async(self, pending: Any, kwargs: dict[str, Any], call_kwargs: dict[str, Any], wanted: bool) -> Any:
        try:
            response = await pending
        except Exception as exc:
            if not self._should_retry_plain(wanted, exc):
                raise
            call_kwargs, _, wanted = _prepare(kwargs, False)
            response = await self._inner.create(**call_kwargs)
        if wanted and kwargs.get("stream"):
            return RecordingAsyncStream(response, kwargs, call_kwargs)
        if wanted:
            _record(kwargs, call_kwargs, response)
        return response

    def _should_retry_plain(self, wanted: bool, exc: Exception) -> bool:
        if not (wanted and self._owner.request_token_data and _rejects_extensions(exc)):
            return False
        log.warning("endpoint rejects token-data options; recording without token data", error=str(exc))
        self._owner.request_token_data = False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass
class _Options:
    request_token_data: bool = True


class _Chat:
    def __init__(self, inner: Any, completions: Any) -> None:
        self._inner, self.completions = inner, completions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class InstrumentedClient:
    """An OpenAI / AsyncOpenAI client whose ``chat.completions.create`` is recorded; all else delegates."""

    def __init__(self, client: Any, request_token_data: bool = True) -> None:
        self._client = client
        self._options = _Options(request_token_data)
        self.chat = _Chat(client.chat, _Completions(client.chat.completions, self._options))

    @property
    def wrapped(self) -> Any:
        return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def instrument(client: Any, request_token_data: bool = True) -> InstrumentedClient:
    """Wrap an ``openai.OpenAI`` or ``openai.AsyncOpenAI`` client for capture.

    ``request_token_data`` asks the server for token ids and logprobs (vLLM); an endpoint that rejects
    those options is retried without them once and then used without them.
    """
    if isinstance(client, InstrumentedClient):
        return client
    return InstrumentedClient(client, request_token_data)
