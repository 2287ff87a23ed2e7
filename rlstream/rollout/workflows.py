"""Reference workflows for ``rlstream rollout run`` (and a pattern for your own).

A workflow is::

    async def workflow(example: dict, client: AsyncOpenAI, sampling: SamplingSettings) -> output

It talks to the model through ``client`` (an instrumented ``AsyncOpenAI``: every call is recorded)
with the settings in ``sampling`` (:class:`~rlstream.rollout.sampling.SamplingSettings`: ``model``,
``temperature``, ``max_tokens``, from ``rollout.*``), and returns what the reward function scores.
``sampling.model`` is the plain policy name; the runner routes it to the policy version being served.
Every caller (the rollout runner, ``rlstream finetune``, the held-out evaluation of ``rlstream up``)
passes the three arguments positionally; a workflow of the old two-argument form (which read its
settings from attributes set on the client) is refused by :func:`check_workflow` with a message saying so.
"""
from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable

from rlstream.rollout.loading import UserCodeError
from rlstream.rollout.sampling import SamplingSettings

#: ``async (example, client, sampling) -> output``.
Workflow = Callable[[dict[str, Any], Any, SamplingSettings], Awaitable[Any]]


def check_workflow(workflow: Callable[..., Any]) -> Workflow:
    """``workflow`` itself, once it is known to take ``(example, client, sampling)``; else :class:`UserCodeError`."""
    try:
        signature = inspect.signature(workflow)
    except (TypeError, ValueError):  # no signature to read (a builtin, some C callables): trust it
        return workflow
    try:
        signature.bind(None, None, None)
    except TypeError:
        name = getattr(workflow, "__qualname__", repr(workflow))
        raise UserCodeError(
            f"workflow {name}{signature} cannot be called as workflow(example, client, sampling); a workflow takes "
            "the sampling settings (model, temperature, max_tokens) as its third argument "
            "(see rlstream.rollout.workflows)") from None
    return workflow


def example_messages(example: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of an example: its ``messages``, else its ``prompt`` as one user message."""
    if example.get("messages"):
        return [dict(m) for m in example["messages"]]
    if example.get("prompt"):
        return [{"role": "user", "content": str(example["prompt"])}]
    raise ValueError(f"example {example.get('id')!r} has neither messages nor prompt")


async def single_turn(example: dict[str, Any], client: Any, sampling: SamplingSettings) -> str:
    """One chat completion of the example's messages; returns the completion text."""
    response = await client.chat.completions.create(
        model=sampling.model, messages=example_messages(example),
        temperature=sampling.temperature, max_tokens=sampling.max_tokens,
    )
    return response.choices[0].message.content or ""
