"""Options and helpers shared by every ``rlstream`` command."""
from __future__ import annotations

import asyncio
import os
from enum import Enum
from pathlib import Path
from typing import Any, Coroutine, Optional, Sequence, TypeVar

import typer
from rich.console import Console, ConsoleDimensions
from typer.core import TyperGroup

from rlstream.schemas.config import ConfigError, RlstreamConfig, load_config

T = TypeVar("T")
#: Off a terminal (a pipe, a file, a test) tables are rendered this wide instead of rich's 80 columns, so that ids
#: and offsets are never cut with an ellipsis; ``COLUMNS`` overrides it.
PIPE_WIDTH = 240


class CliConsole(Console):
    """A rich console that, when its output is not a terminal, is ``COLUMNS`` (else :data:`PIPE_WIDTH`) wide.

    Decided at each print, not at import: the same console serves a terminal, a pipe and typer's test runner."""

    @property
    def size(self) -> ConsoleDimensions:
        if self.is_terminal:
            return super().size
        columns = os.environ.get("COLUMNS", "")
        return ConsoleDimensions(int(columns) if columns.isdigit() else PIPE_WIDTH, super().size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


console = CliConsole(stderr=False)
err_console = CliConsole(stderr=True)


class LogFormat(str, Enum):
    """``--log-format``: ``auto`` is console on a terminal, JSON lines otherwise."""

    auto = "auto"
    json = "json"
    console = "console"


class LogLevel(str, Enum):
    """``--log-level`` (and the Faust worker's ``--loglevel``); accepted in any case."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


ConfigOption = typer.Option(None, "--config", "-c", help="YAML config file", exists=False, dir_okay=False)
#: ``-o KEY VALUE`` (repeatable). Annotate the parameter ``Optional[list[str]]`` (typer cannot express a list of
#: pairs): :class:`RlstreamGroup` hands it ``KEY=VALUE`` tokens, and :func:`pairs` / :func:`load_or_exit` split them.
OverrideOption = typer.Option(
    None, "--override", "-o", help="KEY VALUE: set a dotted config key (repeatable), e.g. -o learner.lora.r 16",
    metavar="KEY VALUE",
)


def pairs(raw: Optional[Sequence[Any]]) -> list[tuple[str, str]]:
    """Override pairs from ``[(key, value)]`` or ``["key=value"]`` items."""
    out: list[tuple[str, str]] = []
    for item in raw or []:
        if isinstance(item, str):
            key, sep, value = item.partition("=")
            if not sep:
                raise typer.BadParameter(f"override {item!r} needs a value: -o KEY VALUE", param_hint="-o")
            out.append((key, value))
        else:
            key, value = item
            out.append((str(key), str(value)))
    return out


OVERRIDE_FLAGS = ("-o", "--override")


def join_override_pairs(args: list[str]) -> list[str]:
    """``-o KEY VALUE`` -> ``-o KEY=VALUE``: typer takes one token per option use; keys hold no ``=``,
    so a token that already has one (``-o key=value``) is left alone."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in OVERRIDE_FLAGS and i + 2 < len(args) and "=" not in args[i + 1]:
            out += [args[i], f"{args[i + 1]}={args[i + 2]}"]
            i += 3
        else:
            out.append(args[i])
            i += 1
    return out


def _takes_overrides(command: Any, args: list[str]) -> bool:
    """Whether the leaf command that ``args`` lead to (through sub-groups) has an ``override`` option."""
    while isinstance(getattr(command, "commands", None), dict):
        name = next((a for a in args if a in command.commands), None)
        if name is None:
            return False
        args = args[args.index(name) + 1:]
        command = command.commands[name]
    return any(getattr(p, "name", None) == "override" for p in command.params)


class RlstreamGroup(TyperGroup):
    """The root ``rlstream`` group: lets every command declaring :data:`OverrideOption` take
    ``-o KEY VALUE`` pairs as NAT does (typer alone cannot express a repeated option with two values)."""

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[Any, Any, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None and _takes_overrides(command, rest):
            rest = join_override_pairs(rest)
        return name, command, rest


def load_or_exit(config: Optional[Path], overrides: Optional[Sequence[Any]]) -> RlstreamConfig:
    """Load the config or print every problem (stderr) and exit with code 2."""
    try:
        cfg = load_config(config, pairs(overrides))
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(code=2) from None
    from rlstream.transport.metrics import set_default_prometheus_addr

    set_default_prometheus_addr(cfg.metrics_host)  # every Prometheus endpoint of this process binds there
    return cfg


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
