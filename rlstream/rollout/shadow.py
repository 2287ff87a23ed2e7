"""Shadow sampling: production traffic is one response per prompt; this completes a production prompt into a
regular GRPO group. For each single-call production trajectory (optionally of one task), it samples
``group_size - 1`` more completions of the same prompt from the current policy, scores all ``group_size`` answers
(the production one included) with a configured reward function (a verifier or an LLM judge), and publishes the
group with source ``shadow``. The production trajectory itself is untouched: its own feedback still goes to it.

Trajectory ids of a shadow group are derived from the production trajectory's id, so that a shadow run restarted
on records it already handled publishes the same ids again, which the stream app drops as duplicates.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from rlstream.rollout.capture import Recording
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.routing import VersionRouter
from rlstream.rollout.runner import score
from rlstream.rollout.sampling import SamplingSettings
from rlstream.schemas.models import Message, TrajectoryEvent, TrajectorySource
from rlstream.transport.log import get_logger

log = get_logger(__name__)
RewardFn = Callable[[dict[str, Any], str], Any]


@dataclass(frozen=True)
class ShadowSettings:
    group_size: int = 4  # the production answer + group_size - 1 samples
    task: str | None = None  # only trajectories of this task (metadata["task"]); None = every one


@dataclass
class ShadowStats:
    seen: int = 0
    shadowed: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    failed: int = 0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def shadow_id(production_id: str, index: int) -> str:
    """The id of member ``index`` of the shadow group of a production trajectory (stable across restarts)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"rlstream-shadow/{production_id}/{index}"))


def _as_dict(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def why_not(event: TrajectoryEvent, settings: ShadowSettings) -> str | None:
    """Why a trajectory is not shadowed (None when it is)."""
    if event.source != TrajectorySource.production:
        return "not_production"
    if event.group_size != 1:
        return "already_a_group"
    if settings.task is not None and event.metadata.get("task") != settings.task:
        return "other_task"
    if len(event.messages) < 2 or event.messages[-1].role != "assistant" or len(event.turns) != 1:
        return "not_a_single_answer"
    return None


class ShadowSampler:
    """Turns single production responses into GRPO groups (see the module docstring)."""

    def __init__(self, client: Any, router: VersionRouter, publisher: TrajectoryPublisher, reward_fn: RewardFn,
                 sampling: SamplingSettings, settings: ShadowSettings, producer_id: str = "shadow") -> None:
        self.client = client  # instrumented (rlstream.instrument): the samples carry token ids and logprobs
        self.router = router
        self.publisher = publisher
        self.reward_fn = reward_fn
        self.sampling = sampling
        self.settings = settings
        self.producer_id = producer_id
        self.stats = ShadowStats()

    def example_of(self, event: TrajectoryEvent) -> dict[str, Any]:
        """What the reward function sees: the prompt's messages, its first user message as ``prompt``."""
        prompt = [_as_dict(m) for m in event.messages[:-1]]
        first_user = next((m["content"] for m in prompt if m["role"] == "user"), "")
        return {"id": event.example_id, "messages": prompt, "prompt": first_user, **event.metadata}

    async def shadow(self, event: TrajectoryEvent) -> list[TrajectoryEvent] | None:
        """The shadow group of one production trajectory (published), or None when it is not shadowed."""
        self.stats.seen += 1
        reason = why_not(event, self.settings)
        if reason is not None:
            self.stats.skip(reason)
            return None
        example = self.example_of(event)
        size = self.settings.group_size
        group_id = f"shadow-{event.trajectory_id}"
        reward, components = score(self.reward_fn(example, event.messages[-1].content or ""))
        members = [event.model_copy(update={
            "trajectory_id": shadow_id(event.trajectory_id, 0), "group_id": group_id, "group_size": size,
            "generation_index": 0, "source": TrajectorySource.shadow, "reward": reward,
            "reward_components": components, "producer_id": self.producer_id,
            "metadata": {**event.metadata, "shadow_of": event.trajectory_id}})]
        route = await self.router.current()
        for index in range(1, size):
            with Recording(target_model=self.sampling.model) as recording:
                await self.client.chat.completions.create(
                    model=route.model, messages=example["messages"], max_tokens=self.sampling.max_tokens,
                    temperature=self.sampling.temperature)
            reward, components = score(self.reward_fn(example, recording.final_text()))
            sample = recording.to_event(
                run_id=event.run_id, example_id=event.example_id, group_id=group_id, group_size=size,
                generation_index=index, policy=event.policy, policy_version=route.version, reward=reward,
                reward_components=components, source=TrajectorySource.shadow, producer_id=self.producer_id,
                metadata={**event.metadata, "shadow_of": event.trajectory_id, "served_model": route.model})
            members.append(sample.model_copy(update={"trajectory_id": shadow_id(event.trajectory_id, index)}))
        for member in members:
            await self.publisher.publish_trajectory(member)
        self.stats.shadowed += 1
        log.info("shadow group published", group_id=group_id, rewards=[round(m.reward or 0.0, 3) for m in members])
        return members

    async def shadow_all(self, events: list[TrajectoryEvent], concurrency: int = 4) -> None:
        """Shadow ``events`` (a batch read from the topic), a few at a time; a failure costs that one only."""
        slots = asyncio.Semaphore(concurrency)

        async def one(event: TrajectoryEvent) -> None:
            async with slots:
                try:
                    await self.shadow(event)
                except Exception as exc:  # the next record goes on
                    self.stats.failed += 1
                    log.warning("shadow sampling failed", trajectory_id=event.trajectory_id,
                                error=f"{type(exc).__name__}: {exc}")

        await asyncio.gather(*(one(e) for e in events))
