"""``rlstream rollout``: the reference rollout runner."""
from __future__ import annotations

import asyncio
import signal
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, OverrideOption, console, err_console, load_or_exit


class RolloutMode(str, Enum):
    """``epoch``: ``rollout.epochs`` passes over the dataset; ``continuous``: cycle it (or read a topic)."""

    epoch = "epoch"
    continuous = "continuous"


def stop_event(duration_s: float | None = None) -> asyncio.Event:
    """An event set by SIGINT/SIGTERM (and after ``duration_s`` when given), for the running loop's command."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if duration_s:
        loop.call_later(duration_s, stop.set)
    return stop


rollout_app = typer.Typer(help="Rollouts: run a workflow over a dataset and publish its trajectories.",
                          no_args_is_help=True)


@rollout_app.command("run")
def rollout_run(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
    dataset: Optional[Path] = typer.Option(None, help="JSON or JSONL examples (rollout.dataset)"),
    workflow: Optional[str] = typer.Option(None, help="module:function, async (example, client, sampling) -> output"),
    reward: Optional[str] = typer.Option(None, help="module:function (example, output) -> reward"),
    mode: Optional[RolloutMode] = typer.Option(None, help="epoch (rollout.epochs passes) | continuous (rollout.mode)"),
    base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint, e.g. http://host:8000/v1"),
    max_groups: Optional[int] = typer.Option(None, help="stop after this many groups"),
) -> None:
    """Run group_size generations per example, score them and publish them to the trajectories topic."""
    cfg = load_or_exit(config, override)
    updates = {k: v for k, v in {"dataset": dataset, "workflow": workflow, "reward_function": reward,
                                 "mode": mode.value if mode else None,
                                 "base_url": base_url, "max_groups": max_groups}.items() if v is not None}
    if updates:
        cfg.rollout = cfg.rollout.model_validate({**cfg.rollout.model_dump(), **updates})
    try:
        stats = asyncio.run(_run(cfg))
    except (ValueError, RuntimeError) as exc:
        err_console.print(f"[red]{exc}[/red]", markup=False, highlight=False)
        raise typer.Exit(code=2) from None
    console.print(f"groups {stats.groups_started}  generations ok {stats.generations_ok}  "
                  f"failed {stats.generations_failed}  admission pauses {stats.admission_waits}")
    if stats.generations_ok == 0 and stats.generations_failed:
        raise typer.Exit(code=1)


async def _run(cfg):  # type: ignore[no-untyped-def]
    from openai import AsyncOpenAI

    from rlstream.transport.control import ControlPlane
    from rlstream.transport.deadletter import dead_letter, send_dead_letter
    from rlstream.transport.kafka import create_topics
    from rlstream.transport.metrics import MetricsPublisher
    from rlstream.rollout.loading import load_callable, load_examples
    from rlstream.rollout.publisher import TrajectoryPublisher
    from rlstream.rollout.runner import RolloutRunner, dataset_examples, topic_examples
    from rlstream.rollout.workflows import check_workflow
    from rlstream.schemas.codec import codec_for
    from rlstream.schemas.masking import PLACEHOLDER_API_KEY, secret_value
    from rlstream.schemas.topics import TopicNames

    rcfg = cfg.rollout
    workflow = check_workflow(load_callable(rcfg.workflow or "rlstream.rollout.workflows:single_turn"))
    reward_ref = rcfg.reward_function or cfg.finetuning.reward_function.function
    reward_fn = load_callable(reward_ref) if reward_ref else None
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

    async def to_dlq(record, exc):  # type: ignore[no-untyped-def]
        letter = dead_letter(topic=record.topic, partition=record.partition, offset=record.offset, key=record.key,
                             value=record.value, error=exc, service="rollout")
        await send_dead_letter(publisher.producer, publisher.codec, topics.dlq, letter)

    if rcfg.prompts_topic:
        examples = topic_examples(cfg, rcfg.prompts_topic, stop, on_bad_record=to_dlq)
    else:
        if rcfg.dataset is None:
            raise ValueError("no examples: set rollout.dataset (--dataset) or rollout.prompts_topic")
        examples = dataset_examples(load_examples(rcfg.dataset, rcfg.example_id_field), rcfg.mode, rcfg.epochs)
    runner = RolloutRunner(cfg, workflow, client, publisher, control, reward_fn, metrics)
    try:
        return await runner.run(examples, stop)
    finally:
        await publisher.close()
        await control.close()
        await client.close()


@rollout_app.command("users")
def rollout_users(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
    gateway: str = typer.Option(..., help="the capture gateway, e.g. http://127.0.0.1:8100"),
    dataset: Optional[Path] = typer.Option(None, help="JSON or JSONL examples (rollout.dataset)"),
    reward: Optional[str] = typer.Option(None, help="module:function (example, answer) -> reward "
                                         "(rollout.reward_function): the users' feedback"),
    concurrency: int = typer.Option(8, min=1, help="simultaneous users"),
    task: str = typer.Option("toy", help="the task header (baseline key)"),
    feedback_share: float = typer.Option(0.7, min=0.0, max=1.0, help="conversations that get feedback"),
    feedback_min_s: float = typer.Option(5.0, min=0.0, help="earliest feedback, seconds after the answer"),
    feedback_max_s: float = typer.Option(60.0, min=0.0, help="latest feedback"),
    duration: Optional[float] = typer.Option(None, help="stop after this many seconds (default: SIGINT/SIGTERM)"),
    api_key: Optional[str] = typer.Option(None, envvar="RLSTREAM_GATEWAY_API_KEY", show_default=False,
                                          help="the gateway's client key (sent as Authorization: Bearer)"),
    agent: Optional[str] = typer.Option(None, help="module:function (example, client, sampling, headers) -> output: "
                                        "each conversation runs this agent (e.g. rlstream.ops.tool_task:tool_agent) "
                                        "instead of plain chat calls; the reward scores its output"),
) -> None:
    """Simulated production users: requests through the gateway (OpenAI client, streamed or not, and LangChain
    when installed), some two-turn sessions, feedback for a share of them after a delay."""
    from rlstream.rollout.loading import load_callable, load_examples
    from rlstream.rollout.users import Population, UserPopulation, report_every

    cfg = load_or_exit(config, override)
    source = dataset or cfg.rollout.dataset
    reward_ref = reward or cfg.rollout.reward_function
    if source is None or not reward_ref:
        err_console.print("users need a dataset (--dataset or rollout.dataset) and a reward (--reward or "
                          "rollout.reward_function)", highlight=False)
        raise typer.Exit(code=2)
    population = Population(concurrency=concurrency, feedback_share=feedback_share, task=task,
                            feedback_delay_s=(feedback_min_s, max(feedback_min_s, feedback_max_s)),
                            model=cfg.rollout.model, max_tokens=cfg.rollout.max_tokens,
                            temperature=cfg.rollout.temperature, seed=cfg.learner.seed)
    users = UserPopulation(gateway, load_examples(source, cfg.rollout.example_id_field), load_callable(reward_ref),
                           population, api_key=api_key, agent=load_callable(agent) if agent else None)

    async def main() -> None:
        from rlstream.transport.control import ControlPlane

        stop = stop_event(duration)
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
    console.print(" ".join(f"{k}={v}" for k, v in users.stats.figures().items()))


@rollout_app.command("shadow")
def rollout_shadow(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
    reward: Optional[str] = typer.Option(None, help="module:function (example, answer) -> reward, a verifier or "
                                         "an LLM judge (rollout.reward_function)"),
    group_size: int = typer.Option(4, min=2, help="the production answer + this many minus one samples"),
    task: Optional[str] = typer.Option(None, help="shadow only trajectories of this task (X-Rlstream-Task)"),
    base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint of the policy (rollout.base_url)"),
    max_groups: Optional[int] = typer.Option(None, help="stop after this many shadow groups"),
    duration: Optional[float] = typer.Option(None, help="stop after this many seconds"),
) -> None:
    """Complete production responses into GRPO groups: sample more answers to the same prompt from the policy,
    score them all, publish the group (source shadow). Consumer group `<policy>-shadow` on `trajectories`."""
    from rlstream.rollout.loading import load_callable
    from rlstream.rollout.shadow import ShadowSettings

    cfg = load_or_exit(config, override)
    reward_ref = reward or cfg.rollout.reward_function
    if not reward_ref:
        err_console.print("shadow sampling needs a reward function: --reward or rollout.reward_function",
                          highlight=False)
        raise typer.Exit(code=2)
    settings = ShadowSettings(group_size=group_size, task=task)
    stats = asyncio.run(_shadow(cfg, load_callable(reward_ref), settings, base_url or cfg.rollout.base_url,
                                max_groups, duration))
    console.print(f"seen {stats.seen}  shadowed {stats.shadowed}  failed {stats.failed}  skipped {stats.skipped}")


async def _shadow(cfg, reward_fn, settings, base_url, max_groups, duration):  # type: ignore[no-untyped-def]
    from openai import AsyncOpenAI

    from rlstream.rollout.capture import instrument
    from rlstream.rollout.publisher import TrajectoryPublisher
    from rlstream.rollout.routing import VersionRouter
    from rlstream.rollout.sampling import SamplingSettings
    from rlstream.rollout.shadow import ShadowSampler
    from rlstream.schemas.codec import codec_for
    from rlstream.schemas.masking import PLACEHOLDER_API_KEY, secret_value
    from rlstream.schemas.models import TrajectoryEvent
    from rlstream.schemas.topics import TopicNames
    from rlstream.transport.control import ControlPlane
    from rlstream.transport.kafka import make_consumer
    from rlstream.transport.topic_reader import TopicReader

    stop = stop_event(duration)
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
