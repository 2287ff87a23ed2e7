"""``_type: rlstream_gateway``: an OpenAI LLM whose calls go through the rlstream capture gateway, one NAT
request per gateway session.

It is NAT's ``openai`` LLM (same fields) plus an httpx request hook that sends the NAT request's
``workflow_run_id`` as ``X-Session-Id`` (a client picks it with NAT's ``workflow-run-id`` request header, else
NAT makes one), and ``task`` as ``X-Rlstream-Task``. The gateway records the calls of one request as one
trajectory; ``POST /v1/feedback`` with that session id rewards it, hours later if need be.
"""
from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from nat.builder.builder import Builder
from nat.builder.context import Context
from nat.builder.framework_enum import LLMFrameworkEnum
from nat.builder.llm import LLMProviderInfo
from nat.cli.register_workflow import register_llm_client, register_llm_provider
from nat.llm.openai_llm import OpenAIModelConfig
from pydantic import Field

SESSION_HEADER = "X-Session-Id"
TASK_HEADER = "X-Rlstream-Task"


class RlstreamGatewayLLMConfig(OpenAIModelConfig, name="rlstream_gateway"):  # type: ignore[call-arg]
    """NAT's OpenAI LLM pointed at ``rlstream gateway serve`` (``base_url: http://gateway:8100/v1``)."""

    task: str | None = Field(None, description="the task key of the baseline (X-Rlstream-Task); default: the policy")


def session_headers(task: str | None) -> dict[str, str]:
    """The gateway headers of the current NAT request (none outside one)."""
    headers: dict[str, str] = {}
    run_id = Context.get().workflow_run_id
    if run_id:
        headers[SESSION_HEADER] = str(run_id)
    if task:
        headers[TASK_HEADER] = task
    return headers


@asynccontextmanager
async def openai_chat_model(config: OpenAIModelConfig, *,
                            request_hooks: Sequence[Callable[[Any], Awaitable[None]]] = (),
                            response_hooks: Sequence[Callable[[Any], Awaitable[None]]] = (),
                            **chat_options: Any) -> AsyncIterator[Any]:
    """LangChain's ``ChatOpenAI`` for a NAT ``openai``-style config, over an httpx client with these event hooks
    (closed when the context ends); ``chat_options`` go to ``ChatOpenAI``."""
    import httpx
    from langchain_openai import ChatOpenAI

    api_key = config.api_key.get_secret_value() if config.api_key is not None else os.getenv("OPENAI_API_KEY", "none")
    hooks = {"request": list(request_hooks), "response": list(response_hooks)}
    async with httpx.AsyncClient(event_hooks=hooks, timeout=config.request_timeout or 600.0) as http:
        yield ChatOpenAI(model=config.model_name, base_url=config.base_url, api_key=api_key,  # type: ignore[arg-type]
                         temperature=config.temperature, top_p=config.top_p, seed=config.seed,
                         max_retries=config.max_retries, http_async_client=http, **chat_options)


@register_llm_provider(config_type=RlstreamGatewayLLMConfig)
async def rlstream_gateway_llm(config: RlstreamGatewayLLMConfig, _builder: Builder) -> AsyncIterator[LLMProviderInfo]:
    yield LLMProviderInfo(config=config, description="an OpenAI-compatible model behind the rlstream gateway")


@register_llm_client(config_type=RlstreamGatewayLLMConfig, wrapper_type=LLMFrameworkEnum.LANGCHAIN)
async def rlstream_gateway_langchain(config: RlstreamGatewayLLMConfig, _builder: Builder) -> AsyncIterator[Any]:
    async with openai_chat_model(config, request_hooks=[session_hook(config.task)]) as model:
        yield model


def session_hook(task: str | None) -> Callable[[Any], Awaitable[None]]:
    """An httpx request hook that adds the current NAT request's gateway headers (:func:`session_headers`)."""
    async def add_session(request: Any) -> None:
        request.headers.update(session_headers(task))

    return add_session
