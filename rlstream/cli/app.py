"""``rlstream``: the command line of rlstream."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from rlstream.cli.common import (ConfigOption, LogFormat, LogLevel, OverrideOption, RlstreamGroup, console,
                                 err_console, load_or_exit, require_writable_dir, run_async)
from rlstream.transport.log import configure_logging
from rlstream.schemas.config import dump_config

app = typer.Typer(help="rlstream: continuous GRPO training of LLM agents from their own traffic, over Kafka.",
                  cls=RlstreamGroup, no_args_is_help=True, pretty_exceptions_show_locals=False)
infra_app = typer.Typer(help="The embedded local broker (noida-db) and Redis.", no_args_is_help=True)
topics_app = typer.Typer(help="Kafka topics of rlstream.", no_args_is_help=True)
config_app = typer.Typer(help="Configuration: validate and show the effective config.", no_args_is_help=True)
app.add_typer(infra_app, name="infra")
app.add_typer(topics_app, name="topics")
app.add_typer(config_app, name="config")
from rlstream.cli.ops import register as register_ops; register_ops(app)  # noqa: E402,E702
from rlstream.cli.lineage import register as register_lineage; register_lineage(app)  # noqa: E402,E702
from rlstream.cli.export import register as register_export; register_export(app)  # noqa: E402,E702
from rlstream.cli.promotion import register as register_promotion; register_promotion(app)  # noqa: E402,E702
from rlstream.cli.gate import register as register_gate; register_gate(app)  # noqa: E402,E702
from rlstream.cli.streams import streams_app; app.add_typer(streams_app, name="streams")  # noqa: E402,E702
from rlstream.cli.rollout import rollout_app; app.add_typer(rollout_app, name="rollout")  # noqa: E402,E702
from rlstream.cli.inference import inference_app; app.add_typer(inference_app, name="inference")  # noqa: E402,E702
from rlstream.cli.learner import learner_app; app.add_typer(learner_app, name="learner")  # noqa: E402,E702
from rlstream.cli.up import register as register_up; register_up(app)  # noqa: E402,E702
from rlstream.cli.finetune import register as register_finetune; register_finetune(app)  # noqa: E402,E702
from rlstream.cli.gateway import gateway_app; app.add_typer(gateway_app, name="gateway")  # noqa: E402,E702
from rlstream.cli.models import models_app; app.add_typer(models_app, name="models")  # noqa: E402,E702
from rlstream.cli.console import register as register_console; register_console(app)  # noqa: E402,E702

DEFAULT_STATE = Path(os.environ.get("RLSTREAM_HOME", "runs")) / "infra"


DISTRIBUTION = "rlstream"


def installed_version() -> str:
    """The version of the installed ``rlstream`` distribution (``unknown`` when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        console.print(f"{DISTRIBUTION} {installed_version()}", highlight=False)
        raise typer.Exit()


@app.callback()
def global_options(
    log_format: LogFormat = typer.Option(LogFormat.auto, "--log-format",
                                         help="auto (console on a terminal, else json) | json | console"),
    log_level: LogLevel = typer.Option(LogLevel.INFO, "--log-level", case_sensitive=False,
                                       help="lowest level logged"),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="print the installed version and exit"),
    debug: bool = typer.Option(False, "--debug", envvar="RLSTREAM_DEBUG",
                               help="show the traceback of an error instead of its one-line answer"),
) -> None:
    """Options that apply to every command."""
    configure_logging(log_format.value, level=log_level.value)  # type: ignore[arg-type]


# --- infra ----------------------------------------------------------------------------
@infra_app.command("up")
def infra_up(
    state_dir: Path = typer.Option(DEFAULT_STATE, help="where data dirs and the state file live"),
    kafka_port: Optional[int] = typer.Option(None, help="broker port (default: a free one)"),
    redis_port: Optional[int] = typer.Option(None, help="Redis port (default: a free one)"),
) -> None:
    """Start noida-db and redis-server in the background and print their addresses.

    A small supervisor process owns them (they die with it, however it ends); it lives until `infra down`.
    Interrupted before the services answer, `infra up` takes them down with it."""
    from rlstream.ops.infra import InfraError
    from rlstream.ops.infra_daemon import AlreadyRunning, bring_up

    require_writable_dir(state_dir, "--state-dir")
    try:
        stack = bring_up(state_dir, kafka_port, redis_port)
    except AlreadyRunning as exc:
        err_console.print(str(exc))
        _print_addresses(exc.stack)
        raise typer.Exit(code=1) from None
    except InfraError as exc:
        err_console.print(f"[red]{exc}[/red]", markup=False, highlight=False)
        raise typer.Exit(code=1) from None
    _print_addresses(stack)


def _print_addresses(stack) -> None:  # type: ignore[no-untyped-def]
    from rlstream.schemas.masking import mask_url

    console.print(f"RLSTREAM_KAFKA_BOOTSTRAP={stack.bootstrap}")
    console.print(f"RLSTREAM_REDIS_URL={mask_url(stack.redis_url)}")  # a password (external Redis) is not printed


@infra_app.command("down")
def infra_down(state_dir: Path = typer.Option(DEFAULT_STATE)) -> None:
    """Stop the services started by ``infra up`` (by PID, only when the process with that PID is still the one
    that was started: its start time must match the state file)."""
    from rlstream.ops.infra_daemon import take_down

    taken = take_down(state_dir)
    if taken is None:
        console.print("nothing running (no state file)")
        return
    stack, outcome = taken
    pids = {svc.name: svc.pid for svc in (stack.supervisor, *stack.services()) if svc is not None}
    for name, what in outcome.items():
        if what == "refused":
            err_console.print(f"{name}: pid {pids.get(name)} now belongs to another process (its start time "
                              "differs from the state file): not signalled", markup=False, highlight=False)
        elif what != "external":
            console.print(f"{name} (pid {pids.get(name)}): {what}", highlight=False)


@infra_app.command("status")
def infra_status(state_dir: Path = typer.Option(DEFAULT_STATE)) -> None:
    """Show whether the embedded services run, and where."""
    from rlstream.ops.infra import STATE_FILE, LocalStack
    from rlstream.schemas.masking import mask_url

    state_file = state_dir / STATE_FILE
    if not state_file.exists():
        console.print("not running")
        raise typer.Exit(code=1)
    stack = LocalStack.load(state_file)
    table = Table("service", "address", "pid", "alive")
    for name, info in stack.status().items():
        table.add_row(name, mask_url(str(info["address"])), str(info["pid"]), str(info["alive"]))
    console.print(table)


# --- topics ---------------------------------------------------------------------------
@topics_app.command("create")
def topics_create(config: Optional[Path] = ConfigOption, override: Optional[list[str]] = OverrideOption) -> None:
    """Create every rlstream topic (idempotent)."""
    from rlstream.transport.kafka import create_topics

    cfg = load_or_exit(config, override)
    outcome = run_async(create_topics(cfg.kafka, cfg.topics))
    for topic, state in outcome.items():
        console.print(f"{topic}\t{state}")


@topics_app.command("list")
def topics_list(config: Optional[Path] = ConfigOption, override: Optional[list[str]] = OverrideOption) -> None:
    """List the topics on the cluster with their partition counts."""
    from rlstream.transport.kafka import list_topics

    cfg = load_or_exit(config, override)
    table = Table("topic", "partitions")
    for topic, parts in run_async(list_topics(cfg.kafka)).items():
        table.add_row(topic, str(parts))
    console.print(table)


# --- config ---------------------------------------------------------------------------
@config_app.command("validate")
def config_validate(config: Optional[Path] = ConfigOption, override: Optional[list[str]] = OverrideOption) -> None:
    """Check a config; print every problem (exit 2) or 'ok'."""
    load_or_exit(config, override)
    console.print("ok")


@config_app.command("show")
def config_show(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Print the effective config after YAML, environment and overrides (secrets masked: passwords show as
    ********** and so does the password part of a URL)."""
    cfg = load_or_exit(config, override)
    if as_json:
        console.print_json(json.dumps(cfg.model_dump(mode="json")))
    else:
        print(dump_config(cfg), end="")


# --- entry point ------------------------------------------------------------------------------
def main() -> None:
    """The ``rlstream`` script (errors are answered by :class:`rlstream.cli.common.RlstreamGroup`)."""
    app()


if __name__ == "__main__":
    main()
