"""``rlstream rollout``: the reference rollout runner."""
from __future__ import annotations

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
    from rlstream.rollout.service import run_rollout

    try:
        stats = run_rollout(cfg)
    except (ValueError, RuntimeError) as exc:
        err_console.print(f"[red]{exc}[/red]", markup=False, highlight=False)
        raise typer.Exit(code=2) from None
    console.print(f"groups {stats.groups_started}  generations ok {stats.generations_ok}  "
                  f"failed {stats.generations_failed}  admission pauses {stats.admission_waits}")
    if stats.generations_ok == 0 and stats.generations_failed:
        raise typer.Exit(code=1)


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
    from rlstream.rollout.service import run_users
    from rlstream.rollout.users import Population

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
    stats = run_users(cfg, gateway, source, reward_ref, population, api_key=api_key, agent_ref=agent,
                      duration_s=duration)
    console.print(" ".join(f"{k}={v}" for k, v in stats.figures().items()))


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
    from rlstream.rollout.service import run_shadow
    from rlstream.rollout.shadow import ShadowSettings

    cfg = load_or_exit(config, override)
    reward_ref = reward or cfg.rollout.reward_function
    if not reward_ref:
        err_console.print("shadow sampling needs a reward function: --reward or rollout.reward_function",
                          highlight=False)
        raise typer.Exit(code=2)
    settings = ShadowSettings(group_size=group_size, task=task)
    stats = run_shadow(cfg, load_callable(reward_ref), settings, base_url or cfg.rollout.base_url, max_groups,
                       duration)
    console.print(f"seen {stats.seen}  shadowed {stats.shadowed}  failed {stats.failed}  skipped {stats.skipped}")

