"""``rlstream gate``: the promotion gate service (docs/gate.md)."""
from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, OverrideOption, err_console, load_or_exit


def gate_command(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Evaluate every candidate version against the serving one; promote, reject, canary and roll back."""
    from rlstream.gate.evaluation import EvaluationSetError

    cfg = load_or_exit(config, override)
    try:
        asyncio.run(_run(cfg))
    except EvaluationSetError as exc:
        err_console.print(f"gate: {exc}", highlight=False)
        raise typer.Exit(2) from None


async def _run(cfg) -> None:  # type: ignore[no-untyped-def]
    from rlstream.gate.service import run_gate

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_gate(cfg, stop)


def register(app: typer.Typer) -> None:
    app.command("gate")(gate_command)
