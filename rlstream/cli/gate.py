"""``rlstream gate``: the promotion gate service (docs/gate.md)."""
from __future__ import annotations

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
    from rlstream.gate.service import serve_gate

    cfg = load_or_exit(config, override)
    try:
        serve_gate(cfg)
    except EvaluationSetError as exc:
        err_console.print(f"gate: {exc}", highlight=False)
        raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    app.command("gate")(gate_command)
