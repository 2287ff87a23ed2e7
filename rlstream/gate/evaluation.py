"""The gate's held-out evaluation: a dataset and a reward function (the shape of NAT's validation), run on the
inference fleet under one version's own model name, with the guard figures of every answer.

Each example (``prompt`` or ``messages``, optionally ``tools``) is completed ``samples`` times with a fixed seed per
(example, sample): the candidate and the serving version answer the same prompts with the same sampling noise, so
their difference is the weights' (vLLM honours a request's ``seed``). The reward function is
``module:function(example, completion_text)`` returning a number, a ``(number, components)`` pair or a mapping with
``reward``. Evaluation requests go straight to a replica's vLLM server, never through the gateway: nothing
evaluated is captured or trained on.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import math
import re
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlstream.gate.rules import EvalFigures
from rlstream.transport.log import get_logger

log = get_logger(__name__)


class EvaluationSetError(ValueError):
    """The evaluation set (dataset file or reward function) cannot be used; the message says why."""


class EvaluationFailed(RuntimeError):
    """An evaluation could not produce figures (requests failing after their retries, connection errors, 5xx): it is
    no result, and it never decides a promotion."""


def load_reward_function(ref: str) -> Callable[..., Any]:
    """Import ``package.module:function`` (the current directory is importable)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise EvaluationSetError(f"reward function {ref!r} is not of the form module:function")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise EvaluationSetError(f"cannot load reward function {ref!r}: {exc}") from exc
    if not callable(target):
        raise EvaluationSetError(f"reward function {ref!r} is not callable")
    return target


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


def example_messages(example: dict[str, Any]) -> list[dict[str, Any]]:
    if example.get("messages"):
        return [dict(m) for m in example["messages"]]
    return [{"role": "user", "content": str(example["prompt"])}]


def reward_of(result: Any) -> float:
    """The reward a reward function returned (a number, ``(number, components)`` or a mapping with ``reward``)."""
    if isinstance(result, dict):
        result = result.get("reward")
    elif isinstance(result, (tuple, list)) and result:
        result = result[0]
    value = float(result)
    if not math.isfinite(value):
        raise ValueError(f"reward {value} is not finite")
    return value


@dataclass(frozen=True)
class EvaluationSet:
    """The held-out prompts, the reward function and how to sample and judge the answers."""

    examples: list[dict[str, Any]]
    reward_function: Callable[..., Any]
    samples: int = 4
    temperature: float = 1.0
    max_tokens: int = 64
    answer_pattern: str = r"\S"
    refusal_patterns: tuple[str, ...] = ()
    concurrency: int = 8
    request_timeout_s: float = 60.0


@dataclass(frozen=True)
class Answer:
    reward: float
    parses: bool
    refusal: bool
    length: int
    tool_calls: int
    tool_calls_parsed: int


def tool_calls_parsed(tool_calls: list[Any]) -> int:
    """How many tool calls carry arguments that parse as a JSON object."""
    parsed = 0
    for call in tool_calls:
        arguments = getattr(getattr(call, "function", None), "arguments", None)
        try:
            parsed += isinstance(json.loads(arguments or ""), dict)
        except (TypeError, ValueError):
            pass
    return parsed


def seed_of(example_id: str, sample: int) -> int:
    """The sampling seed of one (example, sample): the same for every version evaluated."""
    return zlib.crc32(f"{example_id}#{sample}".encode()) & 0x7FFFFFFF


async def evaluate_version(evaluation: EvaluationSet, version: int, base_url: str, model: str,
                           api_key: str | None = None) -> EvalFigures:
    """Run the evaluation set against ``model`` (one version's own name) at ``base_url`` (``.../v1``).

    A completion request that fails counts as an answer that does not parse, with reward 0; a reward function that
    raises scores 0 (both logged).
    """
    from openai import AsyncOpenAI

    answer_re = re.compile(evaluation.answer_pattern)
    refusal_res = [re.compile(p, re.IGNORECASE) for p in evaluation.refusal_patterns]
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", timeout=evaluation.request_timeout_s,
                         max_retries=1)
    limit = asyncio.Semaphore(evaluation.concurrency)
    started = time.monotonic()

    async def one(example: dict[str, Any], sample: int) -> Answer:
        async with limit:
            kwargs: dict[str, Any] = {}
            if example.get("tools"):
                kwargs["tools"] = example["tools"]
            try:
                response = await client.chat.completions.create(
                    model=model, messages=example_messages(example), temperature=evaluation.temperature,
                    max_tokens=evaluation.max_tokens, seed=seed_of(example["id"], sample), **kwargs)
            except Exception as exc:  # noqa: BLE001 - a failed request is a failed answer, not a crash
                log.warning("evaluation request failed", version=version, model=model, error=str(exc))
                return Answer(0.0, False, False, 0, 0, 0)
        choice = response.choices[0]
        text = choice.message.content or ""
        calls = list(choice.message.tool_calls or [])
        length = response.usage.completion_tokens if response.usage else len(text.split())
        try:
            reward = reward_of(evaluation.reward_function(example, text))
        except Exception as exc:  # noqa: BLE001 - user code
            log.warning("evaluation reward function failed", version=version, error=str(exc))
            reward = 0.0
        return Answer(reward, bool(answer_re.search(text)) or bool(calls), any(r.search(text) for r in refusal_res),
                      length, len(calls), tool_calls_parsed(calls))

    try:
        answers = await asyncio.gather(*(one(e, s) for e in evaluation.examples for s in range(evaluation.samples)))
    finally:
        await client.close()
    n = len(answers)
    calls = sum(a.tool_calls for a in answers)
    return EvalFigures(
        version=version,
        reward_mean=sum(a.reward for a in answers) / n if n else 0.0,
        answer_parse_rate=sum(a.parses for a in answers) / n if n else 0.0,
        tool_call_parse_rate=sum(a.tool_calls_parsed for a in answers) / calls if calls else 1.0,
        refusal_rate=sum(a.refusal for a in answers) / n if n else 0.0,
        answer_length=sum(a.length for a in answers) / n if n else 0.0,
        samples=n, tool_calls=calls, seconds=time.monotonic() - started)
