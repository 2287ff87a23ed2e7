"""Operator commands: ``rlstream replay``, ``tail``, ``status`` and ``plot`` (top-level commands).

Registered on the main app by :func:`register`; heavy imports stay inside the commands.
"""
from __future__ import annotations

import json
import socket
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Coroutine, Optional, TypeVar

import typer

from rlstream.cli.common import (ConfigOption, OverrideOption, UsageProblem, console, err_console, load_or_exit,
                                 run_async)

T = TypeVar("T")


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


class TailKind(str, Enum):
    metrics = "metrics"
    groups = "groups"
    dlq = "dlq"
    versions = "versions"
    promotions = "promotions"


def run_or_exit(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; turn the errors an operator can act on into a message and an exit code."""
    from rlstream.ops.plot import NoMetricsError
    from rlstream.ops.replay import ReplayError
    from rlstream.transport.topic_reader import TopicMissingError

    try:
        return run_async(coro)
    except ReplayError as exc:
        err_console.print(f"[red]{exc}[/red]", highlight=False)
        raise typer.Exit(code=2) from None
    except (TopicMissingError, NoMetricsError, ValueError) as exc:
        err_console.print(f"[red]{exc}[/red]", highlight=False)
        raise typer.Exit(code=1) from None
    except (ConnectionError, socket.gaierror) as exc:  # other errors (a file, Kafka's own): RlstreamGroup answers
        err_console.print(f"cannot reach Kafka: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(code=1) from None


def replay_command(
    run_id: str = typer.Option(..., "--run-id", help="the new run id the slice is published under"),
    start: Optional[str] = typer.Option(None, "--from", help="offset, partition:offset[,..] or ISO time (default: beginning)"),
    stop: Optional[str] = typer.Option(None, "--to", help="exclusive; same forms (default: the end offsets of now)"),
    source: Optional[list[str]] = typer.Option(None, "--source", help="keep only this trajectory source (repeatable)"),
    example: Optional[list[str]] = typer.Option(None, "--example", help="keep only this example id (repeatable)"),
    from_run: Optional[list[str]] = typer.Option(None, "--from-run", help="keep only events of this run (repeatable)"),
    min_version: Optional[int] = typer.Option(None, "--min-version", help="lowest policy version kept"),
    max_version: Optional[int] = typer.Option(None, "--max-version", help="highest policy version kept"),
    into_prefix: Optional[str] = typer.Option(None, "--into-prefix", help="publish into the topics of this prefix"),
    join_rewards: bool = typer.Option(True, "--join-rewards/--no-join-rewards",
                                      help="fill missing rewards from the rewards topic"),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format"),
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Re-publish a slice of `trajectories` as a new run (source=replay) while the live run goes on."""
    from rlstream.ops.replay import ReplayError, ReplayFilter, check_range, parse_position, replay

    cfg = load_or_exit(config, override)
    try:
        selection = ReplayFilter(sources=frozenset(source or ()), example_ids=frozenset(example or ()),
                                 run_ids=frozenset(from_run or ()), min_policy_version=min_version,
                                 max_policy_version=max_version)
        first = parse_position(start) if start else None
        last = parse_position(stop) if stop else None
        check_range(first, last)
    except ReplayError as exc:
        raise UsageProblem(str(exc)) from None
    report = run_or_exit(replay(cfg, run_id, first, last, selection, into_prefix=into_prefix,
                                 join_rewards=join_rewards))
    if fmt == OutputFormat.json:
        print(json.dumps(report.to_dict()))
        return
    from rich.table import Table

    table = Table("partition", "from", "to (excl.)", title=f"replay {report.source_topic} -> {report.target_topic}")
    for partition, (a, b) in sorted(report.ranges.items()):
        table.add_row(str(partition), str(a), str(b))
    console.print(table)
    console.print(f"run {report.new_run_id}: read {report.read}, published {report.published}, "
                  f"filtered {report.filtered}, dead-lettered {report.dead_lettered}, "
                  f"rewards joined {report.rewards_joined}, without reward {report.without_reward}")


def tail_command(
    kind: TailKind = typer.Argument(..., help="metrics | groups | dlq | versions | promotions"),
    run: Optional[str] = typer.Option(None, "--run", help="only events of this run"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep reading new records (live table)"),
    from_beginning: bool = typer.Option(False, "--from-beginning", help="start at the beginning of each partition"),
    last: int = typer.Option(10, "--last", min=0, help="records per partition shown before the end"),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", help="table, or json lines (for jq)"),
    max_messages: Optional[int] = typer.Option(None, "--max-messages", min=1, help="stop after N records"),
    idle_timeout: Optional[float] = typer.Option(None, "--idle-timeout", min=0.0,
                                                 help="stop after S seconds without a record"),
    group: Optional[str] = typer.Option(None, "--group", help="also show this consumer group's lag"),
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Show the records of a topic; `--follow` keeps a live table (or JSON lines) going."""
    from rlstream.ops.tail import TailOptions, run_tail

    cfg = load_or_exit(config, override)
    options = TailOptions(run=run, follow=follow, from_beginning=from_beginning, last=last, max_messages=max_messages,
                          idle_timeout_s=idle_timeout, group=group)
    try:
        run_or_exit(run_tail(cfg, kind.value, options, fmt.value, out=sys.stdout))
    except KeyboardInterrupt:
        raise typer.Exit(code=130) from None


def status_command(
    run: Optional[str] = typer.Option(None, "--run", help="run whose metrics and status are shown (default: run_id)"),
    versions: int = typer.Option(5, "--versions", min=1, help="recent policy versions shown"),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format"),
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Policy versions, learner lease, inference workers, lag per topic and group, latest metrics."""
    from rlstream.ops.status import collect_status, render_status

    cfg = load_or_exit(config, override)
    status = run_or_exit(collect_status(cfg, run, versions))
    if fmt == OutputFormat.json:
        print(json.dumps(status, default=str))
    else:
        render_status(status, console)


def plot_command(
    run: str = typer.Option(..., "--run", help="run id whose metrics are drawn"),
    out: Optional[Path] = typer.Option(None, "--out", help="PNG path (default reward_plot_<run>.png)"),
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Draw reward, validation and curriculum curves of a run from the metrics topic."""
    from rlstream.ops.plot import plot_run

    cfg = load_or_exit(config, override)
    path, metrics = run_or_exit(plot_run(cfg, run, out))
    points = sum(len(s.points) for s in metrics.series.values())
    print(f"{path}  ({len(metrics.series)} series, {points} points)")


def register(app: typer.Typer) -> None:
    """Add replay, tail, status and plot as top-level commands of ``app``."""
    app.command("replay")(replay_command)
    app.command("tail")(tail_command)
    app.command("status")(status_command)
    app.command("plot")(plot_command)
