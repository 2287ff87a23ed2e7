"""``rlstream learner``: the GRPO learner service (groups -> policy versions)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, OverrideOption, console, err_console, load_or_exit

learner_app = typer.Typer(help="The GRPO learner: consumes groups, publishes weight versions.", no_args_is_help=True)


@learner_app.callback()
def learner_group() -> None:
    """The GRPO learner: consumes groups, publishes weight versions."""


@learner_app.command("run")
def run(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
    holder: Optional[str] = typer.Option(None, help="lease holder name (default host:pid)"),
    kill_after_step: Optional[int] = typer.Option(None, hidden=True,
                                                  help="fault injection for tests: SIGKILL itself after this step"),
    pause_in_announcement: Optional[int] = typer.Option(
        None, hidden=True, help="fault injection for tests: SIGSTOP itself once this version's record is sent, "
                                "before its transaction commits"),
) -> None:
    """Train from `groups` until learner.total_steps (SIGINT/SIGTERM stop cleanly after the current step)."""
    from rlstream.learner.service import run_learner

    cfg = load_or_exit(config, override)
    # a tracker that cannot start, a model that is not a directory: answered by RlstreamGroup (one line)
    outcome = run_learner(cfg, holder=holder, kill_after_step=kill_after_step,
                          pause_in_announcement=pause_in_announcement)
    state = outcome.state
    console.print(f"learner stopped at step {state.step}, version {state.version}, "
                  f"{state.groups_trained} groups trained")
    if outcome.lease_lost:
        err_console.print("the learner lease was lost to another learner: this one stopped without publishing",
                          highlight=False)
        raise typer.Exit(code=3)
