"""Reference workflows for ``rlstream rollout run`` (and a pattern for your own).

A workflow is ``async def workflow(example: dict, client) -> output``: it talks to the model through
``client`` (an instrumented ``AsyncOpenAI``; ask for ``client.rlstream_model`` or the configured
policy name) and returns what the reward function scores.
"""
from __future__ import annotations

from typing import Any


def example_messages(example: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of an example: its ``messages``, else its ``prompt`` as one user message."""
    if example.get("messages"):
        return [dict(m) for m in example["messages"]]
    if example.get("prompt"):
        return [{"role": "user", "content": str(example["prompt"])}]
    raise ValueError(f"example {example.get('id')!r} has neither messages nor prompt")


async def single_turn(example: dict[str, Any], client: Any) -> str:
    """One chat completion of the example's messages; returns the completion text."""
    response = await client.chat.completions.create(
        model=client.rlstream_model, messages=example_messages(example),
        temperature=client.rlstream_temperature, max_tokens=client.rlstream_max_tokens,
    )
    return response.choices[0].message.content or ""
