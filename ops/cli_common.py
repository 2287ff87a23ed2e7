"""Options and helpers shared by every ``rlstream`` command."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Coroutine, Optional, TypeVar

import typer
from rich.console import Console

from schemas.config import ConfigError, RlstreamConfig, load_config

T = TypeVar("T")
console = Console(stderr=False)
err_console = Console(stderr=True)

ConfigOption = typer.Option(None, "--config", "-c", help="YAML config file", exists=False, dir_okay=False)
OverrideOption = typer.Option(
    None, "--override", "-o", help="KEY VALUE: set a dotted config key (repeatable), e.g. -o learner.lora.r 16",
    metavar="KEY VALUE",
)


def pairs(raw: Optional[list[tuple[str, str]]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in (raw or [])]


def load_or_exit(config: Optional[Path], overrides: Optional[list[tuple[str, str]]]) -> RlstreamConfig:
    """Load the config or print every problem and exit with code 2."""
    try:
        return load_config(config, pairs(overrides))
    except ConfigError as exc:
        err_console.print(f"[red]{exc}[/red]", highlight=False, markup=False)
        raise typer.Exit(code=2) from None


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
