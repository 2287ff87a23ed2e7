"""``rlstream export`` and ``rlstream import``: slices of ``trajectories`` as Parquet or ATIF files, and back."""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import (ConfigOption, OverrideOption, UsageProblem, console, err_console, load_or_exit,
                                 require_writable_file)
from rlstream.cli.ops import OutputFormat, run_or_exit


class ExportFormatOption(str, Enum):
    parquet = "parquet"
    atif = "atif"


class ImportFormatOption(str, Enum):
    atif = "atif"
    parquet = "parquet"


def require_export_extra(*modules: str) -> None:
    """Exit with the install line when a module of the ``[export]`` extra is missing."""
    from importlib.util import find_spec

    for module in modules:
        try:
            found = find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package (``nat``) is missing
            found = False
        if not found:
            err_console.print(f"[red]this command needs the [export] extra ({module} is not installed): "
                              f"pip install 'rlstream[export]'[/red]", highlight=False)
            raise typer.Exit(code=1)


class LayoutOption(str, Enum):
    messages = "messages"
    prompt_completion = "prompt-completion"
    dpo = "dpo"
    kto = "kto"


def export_command(
    out: Path = typer.Option(..., "--out", help="the file written (.parquet, or .jsonl for ATIF)",
                             dir_okay=False),
    export_format: ExportFormatOption = typer.Option(ExportFormatOption.parquet, "--format",
                                                     help="parquet (TRL / datasets) or atif (JSON Lines)"),
    layout: LayoutOption = typer.Option(LayoutOption.messages, "--layout",
                                        help="Parquet: `messages`, `prompt-completion`, or from groups `dpo` "
                                             "(prompt/chosen/rejected) or `kto` (prompt/completion/label)"),
    start: Optional[str] = typer.Option(None, "--from", help="offset, partition:offset[,..] or ISO time (default: beginning)"),
    stop: Optional[str] = typer.Option(None, "--to", help="exclusive; same forms (default: the end offsets of now)"),
    run: Optional[list[str]] = typer.Option(None, "--run", help="keep only trajectories of this run (repeatable)"),
    task: Optional[list[str]] = typer.Option(None, "--task", help="keep only this task, metadata['task'] (repeatable)"),
    source: Optional[list[str]] = typer.Option(None, "--source", help="keep only this trajectory source (repeatable)"),
    example: Optional[list[str]] = typer.Option(None, "--example", help="keep only this example id (repeatable)"),
    min_version: Optional[int] = typer.Option(None, "--min-version", help="lowest policy version kept"),
    max_version: Optional[int] = typer.Option(None, "--max-version", help="highest policy version kept"),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--report", help="the summary as a table or JSON"),
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Write a slice of `trajectories` as Parquet (TRL's conversational layout, token ids and logprobs as columns)
    or as ATIF trajectories (token ids per step)."""
    from rlstream.ops.export import ExportFilter, ExportFormat, ParquetLayout, export_trajectories
    from rlstream.ops.replay import ReplayError, check_range, parse_position

    require_export_extra("pyarrow" if export_format == ExportFormatOption.parquet else "nat.atif")
    require_writable_file(out, "--out")
    cfg = load_or_exit(config, override)
    try:
        selection = ExportFilter(sources=frozenset(source or ()), example_ids=frozenset(example or ()),
                                 run_ids=frozenset(run or ()), min_policy_version=min_version,
                                 max_policy_version=max_version, tasks=frozenset(task or ()))
        first = parse_position(start) if start else None
        last = parse_position(stop) if stop else None
        check_range(first, last)
    except ReplayError as exc:
        raise UsageProblem(str(exc)) from None
    report = run_or_exit(export_trajectories(cfg, out, ExportFormat(export_format.value), first, last, selection,
                                             layout=ParquetLayout(layout.value)))
    if fmt == OutputFormat.json:
        print(json.dumps(report.to_dict()))
        return
    groups = (f"; {report.groups} groups, {report.groups_without_preference} without a preference"
              if layout in (LayoutOption.dpo, LayoutOption.kto) else "")
    console.print(f"{report.path} ({report.format}): {report.written} rows, {report.turns} turns, "
                  f"{report.token_ids} token ids; read {report.read}, filtered {report.filtered}, "
                  f"duplicates {report.duplicates}, undecodable {report.undecodable}{groups}", highlight=False)


def import_command(
    path: Path = typer.Argument(..., exists=True, dir_okay=False,
                                help="ATIF file (JSON Lines, a JSON array or one object) or Parquet file"),
    import_format: ImportFormatOption = typer.Option(..., "--format", help="the file's format (atif or parquet)"),
    run_id: str = typer.Option(..., "--run-id", help="the new run id the trajectories are published under"),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--report", help="the summary as a table or JSON"),
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
) -> None:
    """Publish the trajectories of an ATIF or Parquet file to `trajectories` as a new run (source=replay); records
    that are not valid go to `dlq` with the reason. Importing the same file as the same run again publishes the
    same trajectory ids, which an export gives once."""
    from rlstream.ops.export import ImportFormat, import_trajectories

    require_export_extra("nat.atif" if import_format == ImportFormatOption.atif else "pyarrow")
    cfg = load_or_exit(config, override)
    report = run_or_exit(import_trajectories(cfg, path, run_id, ImportFormat(import_format.value)))
    if fmt == OutputFormat.json:
        print(json.dumps(report.to_dict()))
    else:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(report.reasons.items())) or "none"
        console.print(f"run {report.new_run_id}: {report.records} records, published {report.published}, "
                      f"dead-lettered {report.dead_lettered} ({reasons})", highlight=False)
    if report.dead_lettered:
        raise typer.Exit(code=3)


def register(app: typer.Typer) -> None:
    """Add ``export`` and ``import`` as top-level commands of ``app``."""
    app.command("export")(export_command)
    app.command("import")(import_command)
