"""``rlstream learner``: the GRPO learner service (groups -> policy versions)."""
from __future__ import annotations

import asyncio
import signal
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
    from rlstream.learner.reporting import ReportingError
    from rlstream.learner.service import Learner

    cfg = load_or_exit(config, override)
    try:
        learner = Learner(cfg, holder=holder, kill_after_step=kill_after_step,
                          pause_in_announcement=pause_in_announcement)
    except ReportingError as exc:  # e.g. learner.report_to names a tracker whose package is not installed
        err_console.print(f"[red]{exc}[/red]", highlight=False)
        raise typer.Exit(code=1) from None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, learner.request_stop)
        state = await learner.run()
        console.print(f"learner stopped at step {state.step}, version {state.version}, "
                      f"{state.groups_trained} groups trained")

    try:
        asyncio.run(main())
    except ReportingError as exc:  # a tracker's run could not be started (no W&B API key, a store refused, ...)
        err_console.print(str(exc), style="red", markup=False, highlight=False)
        raise typer.Exit(code=1) from None
    if learner.lease_lost:
        err_console.print("the learner lease was lost to another learner: this one stopped without publishing",
                          highlight=False)
        raise typer.Exit(code=3)
