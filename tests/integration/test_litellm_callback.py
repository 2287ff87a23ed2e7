"""The LiteLLM callback (rlstream.integrations.litellm) publishing calls to the real broker, called through LiteLLM's
documented hook ``async_log_success_event(kwargs, response_obj, start_time, end_time)`` with a response as LiteLLM
hands it over (an OpenAI-compatible pydantic ModelResponse carrying vLLM's token-id extras). LiteLLM itself is not a
dependency (see docs/gateway.md): this checks the callback against its interface."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from openai.types.chat import ChatCompletion

from rlstream.integrations.litellm import RlstreamLogger
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.models import TrajectoryEvent, TrajectorySource
from tests.support.learner_helpers import read_topic

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Repeat the letter c."}]


def vllm_response(with_tokens: bool) -> ChatCompletion:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": "ccc"},
                              "logprobs": {"content": [{"token": "c", "logprob": -0.5, "bytes": [99],
                                                        "top_logprobs": []}] * 3} if with_tokens else None}
    body: dict[str, Any] = {"id": "chatcmpl-litellm-1", "object": "chat.completion", "created": 0,
                            "model": "policy", "choices": [choice]}
    if with_tokens:
        choice["token_ids"] = [66, 66, 66]
        body["prompt_token_ids"] = [1, 2, 3, 4]
    return ChatCompletion.model_validate(body)


def call_kwargs(model: str, task: str | None = None) -> dict[str, Any]:
    metadata = {"rlstream_task": task} if task else {}
    return {"model": model, "messages": MESSAGES, "optional_params": {"temperature": 0.7},
            "litellm_params": {"metadata": metadata}, "litellm_call_id": "abc"}


async def test_litellm_calls_become_trajectories(rl_config: Any, created_topics: Any) -> None:
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    logger = RlstreamLogger(publisher, run_id=rl_config.run_id, policy=rl_config.policy, policy_version=4,
                            models={"policy"})
    now = datetime.now(timezone.utc)
    exact = call_kwargs("policy", task="letters")
    await logger.async_log_success_event(exact, vllm_response(True), now, now)
    await logger.async_log_success_event(call_kwargs("policy"), vllm_response(False), now, now)
    await logger.async_log_success_event(call_kwargs("gpt-other"), vllm_response(True), now, now)  # not the policy
    await logger.async_log_success_event({"model": "policy", "input": ["embed me"]}, {"data": []}, now, now)
    await logger.close()
    assert (logger.stats.published, logger.stats.skipped, logger.stats.failed) == (2, 1, 1)

    events = await read_topic(rl_config, created_topics.trajectories, TrajectoryEvent, expect=2)
    assert len(events) == 2
    by_task = {e.metadata.get("task"): e for e in events}
    exact_event = by_task["letters"]
    assert exact_event.trajectory_id == exact["litellm_params"]["metadata"]["rlstream_trajectory_id"]
    assert exact_event.source == TrajectorySource.production and exact_event.group_size == 1
    assert exact_event.policy == rl_config.policy and exact_event.policy_version == 4
    assert exact_event.example_id == "letters" and exact_event.metadata["response_id"] == "chatcmpl-litellm-1"
    assert [m.role for m in exact_event.messages] == ["system", "user", "assistant"]
    assert exact_event.messages[-1].content == "ccc"
    (turn,) = exact_event.turns
    assert turn.prompt_token_ids == [1, 2, 3, 4] and turn.completion_token_ids == [66, 66, 66]
    assert turn.completion_logprobs == [-0.5] * 3 and turn.temperature == 0.7
    (plain,) = [e for e in events if e is not exact_event]
    assert plain.turns[0].prompt_token_ids is None and plain.messages[-1].content == "ccc"
