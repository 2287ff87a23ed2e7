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
    """Resolve a version to its groups (topic/partition/offset, group ids) and their trajectory offsets, and list
    the promotion decisions about it."""
    from rlstream.ops.lineage import render_lineage, version_lineage
    from rlstream.ops.promotion import read_decisions

    cfg = load_or_exit(config, override)
    lineage = run_or_exit(version_lineage(cfg, version, policy))
    decisions = run_or_exit(read_decisions(cfg, policy or cfg.policy, version))
    if fmt == OutputFormat.json:
        print(json.dumps({**lineage.to_dict(), "decisions": [d.model_dump(mode="json") for d in decisions]}))
    else:
        render_lineage(lineage, console)
        for d in decisions:
            before = "-" if d.serving_before is None else d.serving_before
            console.print(f"decision {d.decided_at:%Y-%m-%d %H:%M:%S} {d.decision.value} (serving before: {before}, "
                          f"by {d.decided_by}): {d.reason}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``lineage`` as a top-level command of ``app``."""
    app.command("lineage")(lineage_command)
