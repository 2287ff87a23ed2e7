"""Streamed chat completions put back together: what the capture SDK and the gateway record of a stream."""
from __future__ import annotations

from typing import Any


class StreamAccumulator:
    """One choice (``choice_index``, the first by default) of a streamed chat completion, put back together from
    its chunks (OpenAI chunk dicts, with vLLM's ``prompt_token_ids`` / ``token_ids`` / ``logprobs`` when asked
    for). Chunks of the other choices are ignored: ``n > 1`` takes one accumulator per choice."""

    def __init__(self, prompt_ids: list[int] | None, choice_index: int = 0) -> None:
        self.choice_index = choice_index
        self.prompt_ids = [int(t) for t in prompt_ids] if prompt_ids is not None else None
        self.chunks = 0
        self.role = "assistant"
        self.content: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.token_ids: list[int] = []
        self.saw_token_ids = False
        self._logprobs: list[float] = []
        self.saw_logprobs = False
        self.finish_reason: str | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if self.prompt_ids is None and chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = [int(t) for t in chunk["prompt_token_ids"]]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != self.choice_index:
                continue
            self.chunks += 1
            delta = choice.get("delta") or {}
            self.role = delta.get("role") or self.role
            if delta.get("content"):
                self.content.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                slot = self.tool_calls.setdefault(int(call.get("index", 0)), {
                    "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if choice.get("token_ids") is not None:
                self.saw_token_ids = True
                self.token_ids.extend(int(t) for t in choice["token_ids"])
            content = (choice.get("logprobs") or {}).get("content")
            if content:
                self.saw_logprobs = True
                self._logprobs.extend(float(item["logprob"]) for item in content)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def message(self) -> dict[str, Any]:
        text = "".join(self.content)
        out: dict[str, Any] = {"role": self.role, "content": text if text or not self.tool_calls else None}
        if self.tool_calls:
            out["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return out

    def completion_ids(self) -> list[int] | None:
        return self.token_ids if self.saw_token_ids else None

    def logprobs(self) -> list[float] | None:
        return self._logprobs if self.saw_logprobs else None
