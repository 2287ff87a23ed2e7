"""``rlstream finetune``: the NAT harness's epoch loop (same options as ``nat finetune``) over rlstream's
Kafka pipeline."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import OverrideOption, console, err_console, pairs

#: Top-level sections of a NeMo Agent Toolkit config; an rlstream config has none of them.
NAT_SECTIONS = frozenset({"llms", "workflow", "functions", "function_groups", "eval", "embedders",
                          "trajectory_builders", "trainer_adapters", "trainers"})


def is_nat_config(path: Path) -> bool:
    """True when ``path`` is a NAT config (it has a NAT section and no rlstream-only top-level key)."""
    from rlstream.schemas.config import ConfigError, read_yaml

    try:
        data = read_yaml(path)
    except (ConfigError, OSError):
        return False  # the rlstream path reports the problem
    return isinstance(data, dict) and bool(NAT_SECTIONS & set(data)) and "finetuning" in data and not (
        {"kafka", "redis", "learner", "rollout", "streams", "inference"} & set(data))


def _run_nat(config_file: Path, overrides: list[tuple[str, str]], dataset: Optional[Path], result_json_path: str,
             endpoint: Optional[str], endpoint_timeout: float, validation_dataset: Optional[Path],
             validation_interval: Optional[int], validation_config_file: Optional[Path]) -> None:
    try:
        import nat.finetuning.finetuning_runtime  # noqa: F401  (NAT's runtime runs a NAT config)

        from rlstream.nat.run import NatFinetuneOptions, run_nat_finetune
    except ImportError as exc:
        err_console.print(f"{config_file} is a NeMo Agent Toolkit config: rlstream runs it with NAT's runtime, which "
                          f"is not installed ({exc.name or exc}). Install it with: pip install 'rlstream[nat]'",
                          markup=False, highlight=False)
        raise typer.Exit(code=2) from None
    opts = NatFinetuneOptions(config_file=config_file, overrides=overrides, dataset=dataset,
                              result_json_path=result_json_path, endpoint=endpoint,
                              endpoint_timeout_s=endpoint_timeout, validation_dataset=validation_dataset,
                              validation_interval=validation_interval, validation_config_file=validation_config_file)
    try:
        run_nat_finetune(opts)
    except Exception as exc:  # NAT's own CLI reports every failure the same way
        err_console.print(f"finetune failed: {type(exc).__name__}: {exc}", markup=False, highlight=False)
        raise typer.Exit(code=1) from None
    console.print("NAT finetuning run finished; outputs in the config's finetuning.output_dir")


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
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="NAT configs: a remote workflow endpoint "
                                           "(`nat serve`) to run the workflow through, as in nat finetune"),
    endpoint_timeout: float = typer.Option(300.0, "--endpoint_timeout", "--endpoint-timeout",
                                           help="seconds to wait for --endpoint (or --inference_url)"),
    result_json_path: str = typer.Option("$", "--result_json_path", "--result-json-path",
                                         help="NAT configs: a JSONPath into the workflow's output (NAT's meaning)"),
    inference_url: Optional[str] = typer.Option(None, "--inference_url", "--inference-url",
                                                help="rlstream configs: an OpenAI-compatible vLLM URL (http://host:port"
                                                " or .../v1); default: start vLLM on learner.model"),
    summary_json: Optional[Path] = typer.Option(None, "--summary_json", "--summary-json",
                                                help="rlstream configs: write the run's summary (JSON) here"),
) -> None:
    """Per epoch: generate num_generations per example, assemble groups, apply the curriculum, train,
    publish a version and load it into vLLM; validate every k epochs and after the last one.

    A NeMo Agent Toolkit config (one with llms/workflow/eval sections) runs through NAT's own runtime, exactly
    as `nat finetune` would, with rlstream's NAT components (rlstream[nat])."""
    from rlstream.finetune.run import FinetuneOptions, run_finetune
    from rlstream.finetune.runtime import FinetuneError
    from rlstream.schemas.config import ConfigError

    if is_nat_config(config_file):
        _run_nat(config_file, pairs(override), dataset, result_json_path, endpoint, endpoint_timeout,
                 validation_dataset, validation_interval, validation_config_file)
        return
    if endpoint:
        err_console.print("--endpoint is NAT's remote workflow endpoint (NAT configs only); give the vLLM server of "
                          "an rlstream config with --inference_url", markup=False, highlight=False)
        raise typer.Exit(code=2)
    if result_json_path != "$":
        err_console.print("--result_json_path is NAT's JSONPath into a workflow's output (NAT configs only); "
                          "--summary_json writes this run's summary", markup=False, highlight=False)
        raise typer.Exit(code=2)
    opts = FinetuneOptions(config_file=config_file, overrides=pairs(override), dataset=dataset,
                           validation_dataset=validation_dataset, validation_interval=validation_interval,
                           validation_config_file=validation_config_file, inference_url=inference_url,
                           endpoint_timeout_s=endpoint_timeout, summary_json=summary_json)
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

