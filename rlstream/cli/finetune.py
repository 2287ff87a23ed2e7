"""``rlstream finetune``: the NAT harness's epoch loop (same options as ``nat finetune``) over rlstream's
Kafka pipeline."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import OverrideOption, console, err_console, pairs

def register(app: typer.Typer) -> None:
    """Add ``finetune`` to the root ``rlstream`` app."""
    app.command("finetune")(finetune)


def finetune(
    config_file: Path = typer.Option(..., "--config_file", "--config-file", "-c", help="YAML config (required)",
                                     dir_okay=False),
    override: Optional[list[str]] = OverrideOption,
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="training examples, JSON or JSONL "
                                           "(rollout.dataset)"),
    validation_dataset: Optional[Path] = typer.Option(None, "--validation_dataset", "--validation-dataset",
                                                      help="held-out examples, never trained on"),
    validation_interval: Optional[int] = typer.Option(None, "--validation_interval", "--validation-interval",
                                                      min=1, help="validate every k epochs (epoch mod k == 0) "
                                                      "and after the last one"),
    validation_config_file: Optional[Path] = typer.Option(None, "--validation_config_file",
                                                          "--validation-config-file",
                                                          help="YAML merged over the config for validation passes"),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="an OpenAI-compatible vLLM URL "
                                           "(http://host:port or .../v1); default: start vLLM on learner.model"),
    endpoint_timeout: float = typer.Option(300.0, "--endpoint_timeout", "--endpoint-timeout",
                                           help="seconds to wait for the endpoint"),
    result_json_path: Optional[Path] = typer.Option(None, "--result_json_path", "--result-json-path",
                                                    help="write the run's summary (JSON) here"),
) -> None:
    """Per epoch: generate num_generations per example, assemble groups, apply the curriculum, train,
    publish a version and load it into vLLM; validate every k epochs and after the last one."""
    from rlstream.finetune.run import FinetuneOptions, run_finetune
    from rlstream.finetune.runtime import FinetuneError
    from rlstream.schemas.config import ConfigError

    opts = FinetuneOptions(config_file=config_file, overrides=pairs(override), dataset=dataset,
                           validation_dataset=validation_dataset, validation_interval=validation_interval,
                           validation_config_file=validation_config_file, endpoint=endpoint,
                           endpoint_timeout_s=endpoint_timeout, result_json_path=result_json_path)
    try:
        summary = run_finetune(opts)
    except ConfigError as exc:
        err_console.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(code=2) from None
    except (FinetuneError, ValueError) as exc:
        err_console.print(f"finetune failed: {exc}", markup=False, highlight=False)
        raise typer.Exit(code=1) from None
    console.print(f"run {summary['run_id']}: {summary['epochs']} epochs; outputs in {summary['output_dir']}")
    if summary["final_validation"]:
        console.print(f"final validation mean reward {summary['final_validation']['avg_reward']:.4f}")
    if summary["failed_jobs"]:
        err_console.print(f"{summary['failed_jobs']} training job(s) did not complete; see the log")
        raise typer.Exit(code=1)

