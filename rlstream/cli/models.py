"""``rlstream models``: local models to try rlstream with, without downloads."""
from __future__ import annotations

from pathlib import Path

import typer

from rlstream.cli.common import console, require_writable_dir

models_app = typer.Typer(help="Local models to try rlstream with (nothing is downloaded).", no_args_is_help=True)


@models_app.command("tiny")
def models_tiny(
    out_dir: Path = typer.Argument(..., help="the directory to write the model to (e.g. Qwen/Qwen2.5-3B-Instruct "
                                   "to stand in for that model id in a NAT config)"),
    seed: int = typer.Option(0, help="seed of the random weights and tokenizer"),
    pretrain_steps: int = typer.Option(0, min=0, help="steps of a copy-the-letter pretraining (0: random weights)"),
) -> None:
    """Build the project's tiny test model (a random 2-layer Qwen2 with a ChatML tokenizer and a tool-calling chat
    template, float32 safetensors) in OUT_DIR; vLLM serves it on CPU and the learner trains it in seconds."""
    from rlstream.ops.toy import build_tiny_model

    require_writable_dir(out_dir, "OUT_DIR")
    path = build_tiny_model(out_dir, seed=seed, pretrain_steps=pretrain_steps)
    console.print(f"tiny model in {path.resolve()}; serve it with `rlstream inference serve {out_dir} "
                  f"--served-model NAME` (LoRA and tool calling on)")
