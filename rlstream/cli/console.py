"""``rlstream console``: the read-only web page of a running stack (top-level command)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, OverrideOption, console, load_or_exit


def console_command(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
    host: str = typer.Option("127.0.0.1", help="address to bind; any but loopback needs an admin key"),
    port: int = typer.Option(8790, min=0, max=65535, help="port to serve (0 = a free port)"),
    api_key: Optional[list[str]] = typer.Option(None, "--api-key", help="a key readers send (Authorization: Bearer "
                                                "KEY); repeatable; also RLSTREAM_GATEWAY_API_KEYS (comma separated)"),
    api_keys_file: Optional[Path] = typer.Option(None, help="the gateway's YAML or JSON keys file: keys with the "
                                                 "admin scope may read the console"),
) -> None:
    """Serve a read-only web page of the run: reward and guard curves per version, the promotion gate's timeline
    with its figures, feedback and dead-letter rates, sample trajectories, two versions' answers side by side
    (docs/console.md)."""
    from rlstream.ops.console.app import ConsoleOptions, run_console

    cfg = load_or_exit(config, override)
    run_console(cfg, ConsoleOptions(host=host, port=port, api_keys=api_key or [], api_keys_file=api_keys_file),
                say=lambda line: console.print(line, highlight=False, markup=False))


def register(app: typer.Typer) -> None:
    """Add ``rlstream console`` to the main app."""
    app.command("console")(console_command)
