"""``rlstream streams``: the Faust group assembler.

Also runnable without the rest of the CLI: ``python -m rlstream.cli streams worker -c cfg.yaml -o key value``.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, LogLevel, load_or_exit

streams_app = typer.Typer(help="The stream app: trajectories + rewards -> filtered GRPO groups.", no_args_is_help=True)


@streams_app.callback()
def streams_group() -> None:
    """The stream app: trajectories + rewards -> filtered GRPO groups."""


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``-o KEY VALUE`` / ``--override KEY VALUE`` pairs from the command's extra arguments."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        if args[i] not in ("-o", "--override"):
            raise typer.BadParameter(f"unexpected argument {args[i]!r}; overrides are -o KEY VALUE")
        if i + 2 >= len(args):
            raise typer.BadParameter(f"{args[i]} needs KEY VALUE")
        pairs.append((args[i + 1], args[i + 2]))
        i += 3
    return pairs


@streams_app.command("worker", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(
    ctx: typer.Context,
    config: Optional[Path] = ConfigOption,
    worker_id: Optional[str] = typer.Option(None, "--worker-id", help="name of this worker (default host-pid); "
                                            "also its table data directory under streams.data_dir"),
    loglevel: LogLevel = typer.Option(LogLevel.WARNING, "--log-level", case_sensitive=False,
                                      help="log level of Faust and the worker"),
) -> None:
    """Run one worker of the group assembler; several with the same app_id share the partitions.

    Overrides: -o KEY VALUE (repeatable), e.g. -o streams.store rocksdb.
    """
    from rlstream.streams.app import run_worker

    cfg = load_or_exit(config, parse_overrides(list(ctx.args)))
    run_worker(cfg, worker_id or f"{socket.gethostname()}-{os.getpid()}", loglevel.value)
