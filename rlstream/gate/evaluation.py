"""The gate's held-out evaluation: a dataset, a reward function and the task's episode (the shape of NAT's
validation), run on the inference fleet under one version's own model name, with the guard figures of every answer.

Each example (``prompt`` or ``messages``, optionally ``tools``) is run ``samples`` times through the task's episode
(``gate.episode``, episodes.py: by default one chat completion; the tool agent's is its Agents SDK episode) with a
fixed seed per (example, sample): the candidate and the serving version answer the same prompts with the same
sampling noise, so their difference is the weights' (vLLM honours a request's ``seed``). The reward function is
``module:function(example, output)`` returning a number, a ``(number, components)`` pair or a mapping with
``reward``. Evaluation requests go straight to a replica's vLLM server, never through the gateway: nothing
evaluated is captured or trained on.

A sample whose episode fails (connection error, timeout, 5xx, a response with nothing to judge) is tried again,
``gate.evaluation_retries`` times with exponential backoff (a 4xx other than 408/429 is not); when one still fails,
the evaluation raises :class:`EvaluationFailed`: a failed request is never scored as an answer.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import re
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from rlstream.gate.episodes import (Episode, EpisodeRequest, NoAnswer, example_messages, reward_of, single_completion,
                                    tool_calls_parsed)
from rlstream.gate.rules import EvalFigures, SampleResult
from rlstream.transport.log import get_logger

log = get_logger(__name__)

__all__ = ["EvaluationFailed", "EvaluationSet", "EvaluationSetError", "evaluate_version", "example_messages",
           "failure_reason", "load_episode", "load_evaluation_examples", "load_reward_function", "reward_of",
           "seed_of", "tool_calls_parsed"]


class EvaluationSetError(ValueError):
    """The evaluation set (dataset file or reward function) cannot be used; the message says why."""


class EvaluationFailed(RuntimeError):
    """An evaluation could not produce figures (requests failing after their retries, connection errors, 5xx): it is
    no result, and it never decides a promotion."""


def load_reference(ref: str, what: str = "reward function") -> Callable[..., Any]:
    """Import ``package.module:function`` (the current directory is importable); ``what`` names it in errors."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise EvaluationSetError(f"{what} {ref!r} is not of the form module:function")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise EvaluationSetError(f"cannot load {what} {ref!r}: {exc}") from exc
    if not callable(target):
        raise EvaluationSetError(f"{what} {ref!r} is not callable")
    return target


def load_reward_function(ref: str) -> Callable[..., Any]:
    """The reward function ``module:function(example, output)`` of ``gate.reward_function``."""
    return load_reference(ref, "reward function")


def load_episode(ref: str | None) -> Episode:
    """The episode of ``gate.episode`` (``module:function``); :func:`single_completion` when unset."""
    if not ref:
        return single_completion
    episode = load_reference(ref, "gate episode")
    if not asyncio.iscoroutinefunction(episode) and not asyncio.iscoroutinefunction(getattr(episode, "__call__", None)):
        raise EvaluationSetError(f"gate episode {ref!r} is not an async function of an EpisodeRequest")
    return episode  # type: ignore[return-value]


def load_evaluation_examples(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Examples from a JSON list or JSONL file; each needs ``prompt`` or ``messages``."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise EvaluationSetError(f"cannot read the evaluation set {path}: {exc}") from exc
    try:
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise EvaluationSetError(f"evaluation set {path} is not JSON/JSONL: {exc}") from exc
    examples = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not (row.get("prompt") or row.get("messages")):
            raise EvaluationSetError(f"evaluation set {path}, example {i}: an object with prompt or messages")
        examples.append({**row, "id": str(row.get("id", i))})
    if not examples:
        raise EvaluationSetError(f"evaluation set {path} has no example")
    return examples[:limit] if limit else examples


@dataclass(frozen=True)
class EvaluationSet:
    """The held-out prompts, the reward function, the task's episode and how to sample, judge and retry."""

    examples: list[dict[str, Any]]
    reward_function: Callable[..., Any]
    samples: int = 4
    temperature: float = 1.0
    max_tokens: int = 64
    answer_pattern: str = r"\S"
    refusal_patterns: tuple[str, ...] = ()
    concurrency: int = 8
    request_timeout_s: float = 60.0
    episode: Episode = single_completion
    retries: int = 3
    retry_backoff_s: float = 0.5


def seed_of(example_id: str, sample: int) -> int:
    """The sampling seed of one (example, sample): the same for every version evaluated."""
    return zlib.crc32(f"{example_id}#{sample}".encode()) & 0x7FFFFFFF


def failure_reason(exc: BaseException) -> str:
    """A failed episode's reason, as the ``gate/evaluation_request_failures`` metric tags it: ``timeout``,
    ``connection``, ``status_<code>``, ``no_answer`` or ``error``."""
    import openai

    if isinstance(exc, (openai.APITimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(exc, (openai.APIConnectionError, ConnectionError)):
        return "connection"
    if isinstance(exc, openai.APIStatusError):
        return f"status_{exc.status_code}"
    if isinstance(exc, NoAnswer):
        return "no_answer"
    return "error"


def _retryable(exc: BaseException) -> bool:
    import openai

    if isinstance(exc, openai.APIStatusError):
        return exc.status_code >= 500 or exc.status_code in (408, 429)
    return True


class _SampleFailed(Exception):
    def __init__(self, key: str, attempts: int, cause: BaseException) -> None:
        super().__init__(f"{key}: {failure_reason(cause)} after {attempts} attempt(s): {type(cause).__name__}: {cause}")


def figures_of(version: int, results: list[SampleResult], seconds: float = 0.0) -> EvalFigures:
    """A version's aggregate figures from its per-sample results (which it carries)."""
    n = len(results)
    calls = sum(r.tool_calls for r in results)
    return EvalFigures(
        version=version,
        reward_mean=sum(r.reward for r in results) / n if n else 0.0,
        answer_parse_rate=sum(r.parses for r in results) / n if n else 0.0,
        tool_call_parse_rate=sum(r.tool_calls_parsed for r in results) / calls if calls else 1.0,
        refusal_rate=sum(r.refusal for r in results) / n if n else 0.0,
        answer_length=sum(r.length for r in results) / n if n else 0.0,
        samples=n, tool_calls=calls, seconds=seconds, results=tuple(results),
        task_success=(sum(r.success or 0.0 for r in results) / n
                      if n and all(r.success is not None for r in results) else None))


async def evaluate_version(evaluation: EvaluationSet, version: int, base_url: str, model: str,
                           api_key: str | None = None,
                           on_request_failure: Callable[[str], Awaitable[None]] | None = None) -> EvalFigures:
    """Run the evaluation set's episode for every (example, sample) against ``model`` (one version's own name) at
    ``base_url`` (``.../v1``): figures with one :class:`SampleResult` per sample.

    A failed episode is retried (see the module docstring; each failure is reported to ``on_request_failure`` with
    its :func:`failure_reason`); when a sample still fails, the rest are cancelled and :class:`EvaluationFailed` is
    raised."""
    from openai import AsyncOpenAI

    answer_re = re.compile(evaluation.answer_pattern)
    refusal_res = tuple(re.compile(p, re.IGNORECASE) for p in evaluation.refusal_patterns)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", timeout=evaluation.request_timeout_s,
                         max_retries=0)
    limit = asyncio.Semaphore(evaluation.concurrency)
    failures: Counter[str] = Counter()
    started = time.monotonic()

    async def one(example: dict[str, Any], sample: int) -> SampleResult:
        request = EpisodeRequest(example=example, sample=sample, seed=seed_of(example["id"], sample), model=model,
                                 client=client, reward_function=evaluation.reward_function,
                                 temperature=evaluation.temperature, max_tokens=evaluation.max_tokens,
                                 answer_pattern=answer_re, refusal_patterns=refusal_res)
        attempts = 1 + max(0, evaluation.retries)
        for attempt in range(1, attempts + 1):
            try:
                async with limit:
                    return await evaluation.episode(request)
            except Exception as exc:  # noqa: BLE001 - every failure is counted, retried, and at last fails it all
                reason = failure_reason(exc)
                failures[reason] += 1
                log.warning("evaluation request failed", version=version, model=model, key=request.key,
                            attempt=attempt, reason=reason, error=f"{type(exc).__name__}: {exc}")
                if on_request_failure is not None:
                    await on_request_failure(reason)
                if attempt == attempts or not _retryable(exc):
                    raise _SampleFailed(request.key, attempt, exc) from exc
                await asyncio.sleep(evaluation.retry_backoff_s * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    tasks = [asyncio.create_task(one(e, s)) for e in evaluation.examples for s in range(evaluation.samples)]
    try:
        results = await asyncio.gather(*tasks)
    except _SampleFailed as exc:
        raise EvaluationFailed(f"version {version} ({model}): a sample failed, no figures; failed requests "
                               f"{dict(failures)}; {exc}") from exc
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    return figures_of(version, list(results), time.monotonic() - started)
