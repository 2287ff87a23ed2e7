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
    from rlstream.schemas.topics import TopicNames

    rcfg = cfg.rollout
    workflow = check_workflow(load_callable(rcfg.workflow or "rlstream.rollout.workflows:single_turn"))
    reward_ref = rcfg.reward_function or cfg.finetuning.reward_function.function
    reward_fn = load_callable(reward_ref) if reward_ref else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await create_topics(cfg.kafka, cfg.topics)
    topics = TopicNames.from_config(cfg.topics)
    publisher = TrajectoryPublisher.from_config(cfg.kafka, topics.trajectories, topics.rewards,
                                                max_in_flight=rcfg.max_in_flight,
                                                delivery_timeout_s=rcfg.delivery_timeout_s)
    await publisher.start()
    metrics = MetricsPublisher(publisher.producer, publisher.codec, topics.metrics, source="rollout", run_id=cfg.run_id)
    control = ControlPlane(cfg.redis.url, cfg.redis.retry_max_s)
    client = AsyncOpenAI(base_url=rcfg.base_url, api_key=rcfg.api_key)

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
