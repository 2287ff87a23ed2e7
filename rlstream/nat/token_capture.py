"""Token ids and logprobs of the target LLM's calls, taken from the LLM responses.

NAT's intermediate steps carry messages only. For the evaluation runs of ``rlstream_traj_builder`` the target LLM
(an ``openai`` or ``rlstream_gateway`` LLM) is swapped for the same settings under ``_type: rlstream_token_capture``
(see :func:`capturing_config`): NAT's own LangChain ``ChatOpenAI``, asking the server for the token data (vLLM's
``return_token_ids`` and ``logprobs``), with an httpx response hook that records each call's prompt and completion
messages with the prompt token ids, the completion token ids and their logprobs in :data:`RECORDER`. The builder
then finds the recorded call of each turn by its prompt and completion messages (:meth:`CallRecorder.lookup`), so
the learner trains the tokens the model really sampled with their behaviour logprobs. A turn with no recorded call
(a server without the vLLM extensions, a streamed call) keeps no token data and is rendered with the chat template,
as before.

The evaluation runs and the builder share one process (NAT runs the workflow in-process), so the recorder is a
bounded in-process map.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from nat.builder.builder import Builder
from nat.builder.framework_enum import LLMFrameworkEnum
from nat.builder.llm import LLMProviderInfo
from nat.cli.register_workflow import register_llm_client, register_llm_provider
from nat.llm.openai_llm import OpenAIModelConfig

from rlstream.nat.steps import message_key
from rlstream.schemas.models import Message

#: recorded calls kept at most (the oldest go first): an epoch's calls are looked up right after its runs
MAX_RECORDED_CALLS = 20_000


class TokenCaptureLLMConfig(OpenAIModelConfig, name="rlstream_token_capture"):  # type: ignore[call-arg]
    """NAT's OpenAI LLM that also records the token data of each response (set by the builder, not by users)."""

    session_headers: bool = False  # send the NAT request's session headers (an rlstream_gateway LLM's behaviour)
    task: str | None = None


@dataclass(frozen=True)
class CapturedCall:
    """The token data of one chat completion."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float] | None


def call_key(prompt: Sequence[Message], completion: Message) -> tuple[Any, ...]:
    """What identifies a call: its prompt messages and its completion, tool calls included (the generations of one
    example share their prompt; a forced tool call's completions differ only in their arguments)."""
    return tuple(message_key(m) for m in prompt), message_key(completion)


class CallRecorder:
    """Recorded calls by :func:`call_key` (thread-safe, bounded)."""

    def __init__(self, max_calls: int = MAX_RECORDED_CALLS) -> None:
        self.max_calls = max_calls
        self._calls: OrderedDict[tuple[Any, ...], CapturedCall] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, request: dict[str, Any], response: dict[str, Any]) -> bool:
        """Record one chat request and its response; False when the response has no token data. Logprobs of a
        grammar-constrained call (a forced tool call, JSON output) are dropped, as the gateway does: vLLM computes
        them after its grammar mask, so they are not the model's own."""
        from rlstream.gateway.sessions import recorded_call

        choices = response.get("choices") or []
        prompt_ids = response.get("prompt_token_ids")
        if not choices or prompt_ids is None or choices[0].get("token_ids") is None:
            return False
        choice = choices[0]
        content = (choice.get("logprobs") or {}).get("content")
        logprobs = [float(item["logprob"]) for item in content] if content else None
        call = recorded_call(request, choice.get("message") or {"role": "assistant", "content": ""},
                             [int(t) for t in prompt_ids], [int(t) for t in choice["token_ids"]], logprobs,
                             choice.get("finish_reason"), str(request.get("model")))
        key = call_key(call.request_messages, call.response_message)
        captured = CapturedCall(list(call.turn.prompt_token_ids or []), list(call.turn.completion_token_ids or []),
                                call.turn.completion_logprobs)
        with self._lock:
            self._calls[key] = captured
            self._calls.move_to_end(key)
            while len(self._calls) > self.max_calls:
                self._calls.popitem(last=False)
        return True

    def lookup(self, prompt: Sequence[Message], completion: Message) -> CapturedCall | None:
        with self._lock:
            return self._calls.get(call_key(prompt, completion))

    def __len__(self) -> int:
        return len(self._calls)


#: the process-wide recorder of the capturing LLM clients
RECORDER = CallRecorder()


def capturing_config(llm_config: Any) -> Any:
    """The capturing twin of an ``openai`` or ``rlstream_gateway`` LLM config (others are returned unchanged)."""
    from rlstream.nat.gateway_llm import RlstreamGatewayLLMConfig

    if type(llm_config) is OpenAIModelConfig or isinstance(llm_config, RlstreamGatewayLLMConfig):
        fields = llm_config.model_dump(exclude={"type"}, exclude_unset=True)
        if isinstance(llm_config, RlstreamGatewayLLMConfig):
            fields["session_headers"] = True
        return TokenCaptureLLMConfig(**fields)
    return llm_config


async def _record_response(response: Any) -> None:
    if response.status_code != 200 or "json" not in response.headers.get("content-type", ""):
        return  # errors and streamed calls are not recorded (their turns are rendered by the learner)
    try:
        await response.aread()
        RECORDER.record(json.loads(response.request.content or b"{}"), response.json())
    except (ValueError, KeyError, TypeError):  # an odd body: that turn is simply not recorded
        return


@register_llm_provider(config_type=TokenCaptureLLMConfig)
async def token_capture_llm(config: TokenCaptureLLMConfig, _builder: Builder) -> AsyncIterator[LLMProviderInfo]:
    yield LLMProviderInfo(config=config, description="an OpenAI-compatible model whose token data is recorded")


@register_llm_client(config_type=TokenCaptureLLMConfig, wrapper_type=LLMFrameworkEnum.LANGCHAIN)
async def token_capture_langchain(config: TokenCaptureLLMConfig, _builder: Builder) -> AsyncIterator[Any]:
    from rlstream.nat.gateway_llm import openai_chat_model, session_hook

    request_hooks = [session_hook(config.task)] if config.session_headers else []
    async with openai_chat_model(config, request_hooks=request_hooks, response_hooks=[_record_response],
                                 logprobs=True, extra_body={"return_token_ids": True}) as model:
        yield model
