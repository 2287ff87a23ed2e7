"""Capture logic that needs no server: token-data extraction, targeting, conversation assembly."""
from __future__ import annotations

import asyncio
from typing import Any

from openai.types.chat import ChatCompletion

from rlstream.rollout.capture import Recording, instrument, routing, target_function, token_data


def completion(content: str | None, *, token_ids: list[int] | None = None, logprobs: list[float] | None = None,
               prompt_ids: list[int] | None = None, tool_calls: list[dict[str, Any]] | None = None) -> ChatCompletion:
    """A chat completion as the OpenAI client parses vLLM's JSON (vLLM's extra fields included)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": content, "tool_calls": tool_calls}}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": f"t{i}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                          for i, lp in enumerate(logprobs)]}
    body: dict[str, Any] = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return ChatCompletion.model_validate(body)


class RecordingCompletions:
    """Stands in for the HTTP transport only: returns prepared responses and keeps the kwargs sent."""

    def __init__(self, responses: list[ChatCompletion]) -> None:
        self.responses = responses
        self.sent: list[dict[str, Any]] = []

    def create(self, **kwargs: Any) -> ChatCompletion:
        self.sent.append(kwargs)
        return self.responses.pop(0)


class Client:
    def __init__(self, responses: list[ChatCompletion]) -> None:
        self.completions = RecordingCompletions(responses)
        self.chat = type("Chat", (), {"completions": self.completions})()


class AsyncCompletions(RecordingCompletions):
    async def create(self, **kwargs: Any) -> ChatCompletion:  # type: ignore[override]
        return super().create(**kwargs)


class AsyncClient(Client):
    def __init__(self, responses: list[ChatCompletion]) -> None:
        self.completions = AsyncCompletions(responses)
        self.chat = type("Chat", (), {"completions": self.completions})()


def test_token_data_reads_vllm_extensions() -> None:
    prompt, ids, lps = token_data(completion("hi", token_ids=[5, 6], logprobs=[-0.5, -1.25], prompt_ids=[1, 2, 3]))
    assert (prompt, ids, lps) == ([1, 2, 3], [5, 6], [-0.5, -1.25])
    assert token_data(completion("hi")) == (None, None, None)


def test_sync_capture_requests_token_data_and_records_tool_exchange() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    client = Client([
        completion(None, tool_calls=[call], token_ids=[7], logprobs=[-0.1], prompt_ids=[1]),
        completion("2", token_ids=[8, 9], logprobs=[-0.2, -0.3], prompt_ids=[1, 7, 4]),
    ])
    wrapped = instrument(client)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "1+1?"}]
    with Recording(target_model="policy") as rec:
        first = wrapped.chat.completions.create(model="policy", messages=list(messages))
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": "2"})
        wrapped.chat.completions.create(model="policy", messages=list(messages))
    sent = client.completions.sent[0]
    assert sent["logprobs"] is True and sent["extra_body"] == {"return_token_ids": True}
    event = rec.to_event(run_id="r", example_id="e", group_id="g", group_size=2, generation_index=0,
                         policy="p", policy_version=3)
    assert [m.role for m in event.messages] == ["user", "assistant", "tool", "assistant"]
    assert event.messages[1].tool_calls[0].name == "add" and event.messages[2].tool_call_id == "call_1"
    assert [t.message_index for t in event.turns] == [1, 3]
    assert event.turns[1].completion_token_ids == [8, 9] and event.turns[1].completion_logprobs == [-0.2, -0.3]
    assert event.turns[1].prompt_token_ids == [1, 7, 4]


def test_target_functions_mark_only_calls_inside_them() -> None:
    client = Client([completion("a"), completion("b"), completion("c")])
    wrapped = instrument(client)

    @target_function("solver")
    def solve() -> None:
        wrapped.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])

    with Recording(target_functions=["solver"], target_model="policy") as rec:
        wrapped.chat.completions.create(model="policy", messages=[{"role": "user", "content": "plan"}])
        solve()
        wrapped.chat.completions.create(model="judge", messages=[{"role": "user", "content": "grade"}])
    assert [(c.turn.function, c.turn.trainable) for c in rec.calls] == [("<workflow>", False), ("solver", True)]
    assert "extra_body" not in client.completions.sent[2]  # the judge model is not captured


def test_calls_without_token_data_are_still_recorded_and_routing_rewrites_model() -> None:
    client = AsyncClient([completion("plain answer")])
    wrapped = instrument(client)

    async def agent() -> None:
        with routing(lambda m: "policy-v7" if m == "policy" else m):
            await wrapped.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])

    with Recording() as rec:
        asyncio.run(agent())
    assert client.completions.sent[0]["model"] == "policy-v7"
    turn = rec.turns()[0]
    assert turn.model == "policy" and turn.completion_token_ids is None and turn.completion_logprobs is None
    assert rec.calls[0].served_model == "policy-v7" and rec.final_text() == "plain answer"


def test_no_recording_passes_through_untouched() -> None:
    client = Client([completion("x")])
    instrument(client).chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    assert "extra_body" not in client.completions.sent[0] and "logprobs" not in client.completions.sent[0]


def chunks(text: str, token_ids: list[int], logprobs: list[float], prompt_ids: list[int]) -> list[Any]:
    """vLLM's streamed chunks (one token each; the first carries the prompt's token ids) as the client parses them."""
    from openai.types.chat import ChatCompletionChunk

    out = []
    for i, (piece, tid, lp) in enumerate(zip(text, token_ids, logprobs)):
        choice: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": piece} if i == 0 else
                                  {"content": piece}, "finish_reason": "stop" if i == len(text) - 1 else None,
                                  "token_ids": [tid],
                                  "logprobs": {"content": [{"token": piece, "logprob": lp, "bytes": None,
                                                            "top_logprobs": []}]}}
        body: dict[str, Any] = {"id": "s1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                "choices": [choice]}
        if i == 0:
            body["prompt_token_ids"] = prompt_ids
        out.append(ChatCompletionChunk.model_validate(body))
    return out


class StreamingCompletions:
    def __init__(self, stream: list[Any]) -> None:
        self.stream, self.sent = stream, []

    def create(self, **kwargs: Any) -> Any:
        self.sent.append(kwargs)
        return iter(self.stream)


class AsyncStreamingCompletions(StreamingCompletions):
    async def create(self, **kwargs: Any) -> Any:  # type: ignore[override]
        self.sent.append(kwargs)

        async def gen() -> Any:
            for chunk in self.stream:
                yield chunk
        return gen()


def test_streamed_calls_are_recorded_with_token_data_sync_and_async() -> None:
    stream = chunks("abc", [7, 8, 9], [-0.1, -0.2, -0.3], [1, 2])
    sync = StreamingCompletions(stream)
    client = instrument(type("C", (), {"chat": type("Chat", (), {"completions": sync})()})())
    with Recording() as rec:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}], stream=True))
    assert text == "abc"
    assert sync.sent[0]["logprobs"] is True and sync.sent[0]["extra_body"]["return_token_ids"] is True
    (turn,) = rec.turns()
    assert turn.prompt_token_ids == [1, 2] and turn.completion_token_ids == [7, 8, 9]
    assert turn.completion_logprobs == [-0.1, -0.2, -0.3] and turn.finish_reason == "stop"
    assert rec.final_text() == "abc"

    async def run() -> Recording:
        inner = AsyncStreamingCompletions(stream)
        aclient = instrument(type("C", (), {"chat": type("Chat", (), {"completions": inner})()})())
        async with Recording() as arec:
            got = await aclient.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                                        stream=True)
            assert [c.choices[0].delta.content async for c in got] == ["a", "b", "c"]
        return arec

    arec = asyncio.run(run())
    assert [t.completion_token_ids for t in arec.turns()] == [[7, 8, 9]]


def test_a_stream_left_unfinished_is_not_recorded() -> None:
    sync = StreamingCompletions(chunks("abc", [7, 8, 9], [-0.1, -0.2, -0.3], [1, 2]))
    client = instrument(type("C", (), {"chat": type("Chat", (), {"completions": sync})()})())
    with Recording() as rec:
        stream = iter(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                                     stream=True))
        next(stream)  # the caller stops reading after one chunk
    assert rec.turns() == []


def test_routed_turns_carry_their_version_and_temperature() -> None:
    """Each turn is tagged with the version its call was routed to (a reload between two calls of one trajectory
    shows turn by turn) and the temperature it asked for (1.0 when it asked none); without routing, no version."""
    client = AsyncClient([completion("one", token_ids=[5], logprobs=[-0.1], prompt_ids=[1]),
                          completion("two", token_ids=[6], logprobs=[-0.2], prompt_ids=[1, 5, 2]),
                          completion("judge"), completion("free")])
    wrapped = instrument(client)
    served = {"version": 3}

    async def agent() -> None:
        with routing(lambda m: f"policy-v{served['version']}" if m == "policy" else m,
                     version=lambda m: served["version"] if m == "policy" else None):
            await wrapped.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}],
                                                  temperature=0.7)
            served["version"] = 4  # the runner's router moved on: a reload in the middle of the trajectory
            await wrapped.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q2"}])
            await wrapped.chat.completions.create(model="judge", messages=[{"role": "user", "content": "j"}],
                                                  temperature=0)
        await wrapped.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q3"}])

    with Recording() as rec:
        asyncio.run(agent())
    assert [c["model"] for c in client.completions.sent] == ["policy-v3", "policy-v4", "judge", "policy"]
    assert [(t.policy_version, t.temperature) for t in rec.turns()] == [(3, 0.7), (4, 1.0), (None, 0.0),
                                                                        (None, 1.0)]


def test_a_streamed_turn_keeps_the_version_routed_when_the_call_was_made() -> None:
    sync = StreamingCompletions(chunks("abc", [7, 8, 9], [-0.1, -0.2, -0.3], [1, 2]))
    client = instrument(type("C", (), {"chat": type("Chat", (), {"completions": sync})()})())
    with Recording() as rec:
        with routing(lambda m: m, version=lambda m: 9):
            stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                                    stream=True, temperature=1.3)
        "".join(c.choices[0].delta.content or "" for c in stream)  # read after the routing block ended
    assert [(t.policy_version, t.temperature) for t in rec.turns()] == [(9, 1.3)]
