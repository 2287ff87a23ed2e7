"""Builders of realistic events for tests and benchmarks."""
from __future__ import annotations

import random
import uuid

from rlstream.schemas.models import Message, RewardEvent, ToolCall, TrajectoryEvent, Turn


def make_trajectory(
    *,
    run_id: str = "run-0",
    example_id: str = "ex-0",
    group_id: str | None = None,
    group_size: int = 4,
    generation_index: int = 0,
    policy: str = "policy",
    policy_version: int = 0,
    reward: float | None = 1.0,
    turns: int = 1,
    completion_tokens: int = 8,
    prompt_tokens: int = 8,
    with_tool_call: bool = False,
    seed: int | None = None,
) -> TrajectoryEvent:
    """A well-formed trajectory: system + user, then ``turns`` assistant turns with token data."""
    rng = random.Random(seed)
    messages = [Message(role="system", content="You are terse."), Message(role="user", content=f"question {example_id}")]
    turn_records = []
    for t in range(turns):
        if with_tool_call and t == 0:
            messages.append(Message(role="assistant", content=None,
                                    tool_calls=[ToolCall(id="call_1", name="lookup", arguments='{"q": "x"}')]))
            messages.append(Message(role="tool", content="42", tool_call_id="call_1"))
        else:
            messages.append(Message(role="assistant", content=f"answer {t}"))
            if t < turns - 1:
                messages.append(Message(role="user", content="go on"))
        turn_records.append(
            Turn(
                message_index=len(messages) - (2 if with_tool_call and t == 0 else 1),
                model="policy",
                function="<workflow>",
                prompt_token_ids=[rng.randrange(1000) for _ in range(prompt_tokens)],
                completion_token_ids=[rng.randrange(1000) for _ in range(completion_tokens)],
                completion_logprobs=[-rng.random() * 3 for _ in range(completion_tokens)],
            )
        )
    return TrajectoryEvent(
        run_id=run_id,
        example_id=example_id,
        group_id=group_id or f"{run_id}:{example_id}",
        group_size=group_size,
        generation_index=generation_index,
        policy=policy,
        policy_version=policy_version,
        messages=messages,
        turns=turn_records,
        reward=reward,
        reward_components={"correct": reward} if reward is not None else {},
        metadata={"task": "test"},
        target="<workflow>",
        producer_id="tests",
    )


def make_reward(trajectory: TrajectoryEvent, reward: float) -> RewardEvent:
    return RewardEvent(trajectory_id=trajectory.trajectory_id, group_id=trajectory.group_id,
                       example_id=trajectory.example_id, run_id=trajectory.run_id, reward=reward)


def new_uuid() -> str:
    return str(uuid.uuid4())
