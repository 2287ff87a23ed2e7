"""The rollout services behind ``rlstream rollout``: the reference runner (``run``), simulated production users
(``users``) and shadow sampling (``shadow``); each wires its clients from the config and runs until done or
SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

from openai import AsyncOpenAI

from rlstream.rollout.capture import instrument
from rlstream.rollout.loading import load_callable, load_examples
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.rollout.routing import VersionRouter
from rlstream.rollout.runner import RolloutRunner, RunnerStats, dataset_examples, topic_examples
from rlstream.rollout.sampling import SamplingSettings
from rlstream.rollout.shadow import ShadowSampler, ShadowSettings, ShadowStats
from rlstream.rollout.users import Population, UserPopulation, UserStats, report_every
from rlstream.rollout.workflows import check_workflow
from rlstream.schemas.codec import codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.masking import PLACEHOLDER_API_KEY, secret_value
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.deadletter import dead_letter, send_dead_letter
from rlstream.transport.kafka import create_topics, make_consumer
from rlstream.transport.metrics import MetricsPublisher
from rlstream.transport.signals import stop_event
from rlstream.transport.topic_reader import TopicReader


def run_rollout(cfg: RlstreamConfig) -> RunnerStats:
    """Run ``cfg.rollout``'s workflow over its dataset (or prompts topic) and publish the trajectories.
    Raises ValueError when there are no examples."""
    return asyncio.run(_rollout(cfg))


async def _rollout(cfg: RlstreamConfig) -> RunnerStats:
    rcfg = cfg.rollout
    workflow = check_workflow(load_callable(rcfg.workflow or "rlstream.rollout.workflows:single_turn"))
    reward_ref = rcfg.reward_function or cfg.finetuning.reward_function.function
    reward_fn = load_callable(reward_ref) if reward_ref else None
    if not rcfg.prompts_topic and rcfg.dataset is None:  # before any client is opened
        raise ValueError("no examples: set rollout.dataset (--dataset) or rollout.prompts_topic")
    stop = stop_event()
    await create_topics(cfg.kafka, cfg.topics)
    topics = TopicNames.from_config(cfg.topics)
    publisher = TrajectoryPublisher.from_config(cfg.kafka, topics.trajectories, topics.rewards,
                                                max_in_flight=rcfg.max_in_flight,
                                                delivery_timeout_s=rcfg.delivery_timeout_s,
                                                codec=codec_for(cfg))  # its metrics go through it too
    await publisher.start()
    metrics = MetricsPublisher(publisher.producer, publisher.codec, topics.metrics, source="rollout", run_id=cfg.run_id,
                               prometheus_port=rcfg.prometheus_port)
    control = ControlPlane(cfg.redis.url, cfg.redis.retry_max_s)
    client = AsyncOpenAI(base_url=rcfg.base_url, api_key=secret_value(rcfg.api_key) or PLACEHOLDER_API_KEY)

    async def to_dlq(record: Any, exc: Exception) -> None:
        letter = dead_letter(topic=record.topic, partition=record.partition, offset=record.offset, key=record.key,
                             value=record.value, error=exc, service="rollout")
        await send_dead_letter(publisher.producer, publisher.codec, topics.dlq, letter)

    if rcfg.prompts_topic:
        examples = topic_examples(cfg, rcfg.prompts_topic, stop, on_bad_record=to_dlq)
    else:
        assert rcfg.dataset is not None
        examples = dataset_examples(load_examples(rcfg.dataset, rcfg.example_id_field), rcfg.mode, rcfg.epochs)
    runner = RolloutRunner(cfg, workflow, client, publisher, control, reward_fn, metrics)
    try:
        return await runner.run(examples, stop)
    finally:
        await publisher.close()
        await control.close()
        await client.close()


def run_users(cfg: RlstreamConfig, gateway: str, dataset: Path, reward_ref: str, population: Population, *,
              api_key: str | None = None, agent_ref: str | None = None, duration_s: float | None = None) -> UserStats:
    """Simulated production users against ``gateway`` until ``duration_s`` or SIGINT/SIGTERM; their figures go to
    ``rlstream status`` (Redis) every 5 s when Redis is configured."""
    users = UserPopulation(gateway, load_examples(dataset, cfg.rollout.example_id_field), load_callable(reward_ref),
                           population, api_key=api_key, agent=load_callable(agent_ref) if agent_ref else None)

    async def main() -> None:
        stop = stop_event(duration_s)
        control = ControlPlane(cfg.redis.url, retry_max_s=5.0) if cfg.redis.url else None

        async def to_status(figures: dict[str, int]) -> None:
            if control is not None:
                await control.set_status(cfg.run_id, figures, patience_s=2.0)

        reporter = asyncio.create_task(report_every(users.stats, 5.0, stop, to_status))
        try:
            await users.run(stop)
        finally:
            stop.set()
            await reporter
            if control is not None:
                await control.close()

    asyncio.run(main())
    return users.stats


def run_shadow(cfg: RlstreamConfig, reward_fn: Callable[..., Any], settings: ShadowSettings, base_url: str,
               max_groups: int | None = None, duration_s: float | None = None) -> ShadowStats:
    """Shadow sampling: complete production responses of ``trajectories`` into GRPO groups (consumer group
    ``<policy>-shadow``) until ``max_groups``, ``duration_s`` or SIGINT/SIGTERM."""
    return asyncio.run(_shadow(cfg, reward_fn, settings, base_url, max_groups, duration_s))


async def _shadow(cfg: RlstreamConfig, reward_fn: Callable[..., Any], settings: ShadowSettings, base_url: str,
                  max_groups: int | None, duration_s: float | None) -> ShadowStats:
    stop = stop_event(duration_s)
    names = TopicNames.from_config(cfg.topics)
    control = ControlPlane(cfg.redis.url, cfg.redis.retry_max_s)
    publisher = TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards)
    consumer = make_consumer(cfg.kafka, names.trajectories, group_id=f"{cfg.policy}-shadow")
    client = AsyncOpenAI(base_url=base_url, api_key=secret_value(cfg.rollout.api_key) or PLACEHOLDER_API_KEY)
    sampler = ShadowSampler(instrument(client), VersionRouter(control, cfg.policy, cfg.rollout.model), publisher,
                            reward_fn, SamplingSettings.from_config(cfg.rollout), settings)
    reader = TopicReader(consumer, codec_for(cfg), TrajectoryEvent)
    await publisher.start()
    await consumer.start()
    try:
        while not stop.is_set() and not (max_groups and sampler.stats.shadowed >= max_groups):
            batch = await reader.fetch(timeout_ms=500, max_records=16)
            if batch:
                await sampler.shadow_all([item.event for item in batch])
                await consumer.commit()  # at least once: a restart re-shadows with the same ids (dropped downstream)
    finally:
        await consumer.stop()
        await publisher.close()
        await client.close()
        await control.close()
    return sampler.stats
