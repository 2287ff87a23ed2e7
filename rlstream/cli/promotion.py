"""``rlstream rollback`` and ``rlstream promote``: an operator's decision about the serving version
(docs/promotion.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, OverrideOption, console, load_or_exit
from rlstream.cli.ops import run_or_exit


def _move(version: int, decision: str, reason: str, policy: Optional[str], timeout_s: float,
          config: Optional[Path], override: Optional[list[str]]) -> None:
    from rlstream.ops.promotion import OperatorMoveError, operator_move
    from rlstream.schemas.models import DecisionKind

    cfg = load_or_exit(config, override)
    try:
        outcome = run_or_exit(operator_move(cfg, version, DecisionKind(decision), reason, policy, timeout_s))
    except OperatorMoveError as exc:
        console.print(f"not moved: {exc}", highlight=False)
        raise typer.Exit(1) from None
    if not outcome.moved:
        console.print(f"serving not moved: {outcome.reason}", highlight=False)
        raise typer.Exit(1)
    before = outcome.decision.serving_before if outcome.decision is not None else None
    console.print(f"serving {policy or cfg.policy}: {before if before is not None else '-'} -> {version} "
                  f"({decision}; {outcome.reason}); recorded on promotions", highlight=False)


def rollback_command(
    to: int = typer.Option(..., "--to", min=0, help="the version production goes back to"),
    policy: Optional[str] = typer.Option(None, "--policy", help="the policy (default: the config's policy)"),
    reason: str = typer.Option("operator rollback", "--reason", help="why (recorded with the decision)"),
    timeout_s: float = typer.Option(120.0, "--timeout", help="seconds to wait for every alive replica to load it"),
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Move serving back to an older version once every alive replica has it loaded (fenced; recorded as a
    rollback on promotions). The versions rolled back from never serve again by themselves: the next promotion is
    a newer candidate. A running canary ends with it (recorded as its rejection); ``--to`` the serving version ends
    the canary alone."""
    _move(to, "rollback", reason, policy, timeout_s, config, override)


def promote_command(
    version: int = typer.Argument(..., min=0, help="the version to serve"),
    policy: Optional[str] = typer.Option(None, "--policy", help="the policy (default: the config's policy)"),
    reason: str = typer.Option("operator promotion", "--reason", help="why (recorded with the decision)"),
    timeout_s: float = typer.Option(120.0, "--timeout", help="seconds to wait for every alive replica to load it"),
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Force a version to serve, without the gate (fenced; recorded as force_promote on promotions), once every
    alive replica has it loaded. A running canary ends with it (recorded as its rejection unless it is the version
    promoted)."""
    _move(version, "force_promote", reason, policy, timeout_s, config, override)


def register(app: typer.Typer) -> None:
    """Add ``rollback`` and ``promote`` as top-level commands of ``app``."""
    app.command("rollback")(rollback_command)
    app.command("promote")(promote_command)
