"""``rlstream lineage VERSION``: the groups and trajectories a published weight version was trained on."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, OverrideOption, console, load_or_exit
from rlstream.cli.ops import OutputFormat, run_or_exit


def lineage_command(
    version: int = typer.Argument(..., min=0, help="the policy version (as on policy-versions)"),
    policy: Optional[str] = typer.Option(None, "--policy", help="the policy (default: the config's policy)"),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", help="tables, or one JSON document"),
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Resolve a version to its groups (topic/partition/offset, group ids) and their trajectory offsets."""
    from rlstream.ops.lineage import render_lineage, version_lineage

    cfg = load_or_exit(config, override)
    lineage = run_or_exit(version_lineage(cfg, version, policy))
    if fmt == OutputFormat.json:
        print(json.dumps(lineage.to_dict()))
    else:
        render_lineage(lineage, console)


def register(app: typer.Typer) -> None:
    """Add ``lineage`` as a top-level command of ``app``."""
    app.command("lineage")(lineage_command)
