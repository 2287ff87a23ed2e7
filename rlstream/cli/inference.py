"""``rlstream inference``: the sync worker that keeps a vLLM server on the newest policy version, and
the vLLM launcher."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from rlstream.cli.common import ConfigOption, OverrideOption, console, load_or_exit


class Backend(str, Enum):
    """Inference servers the sync worker can drive."""

    vllm = "vllm"


inference_app = typer.Typer(help="Inference workers: load every new policy version into vLLM.", no_args_is_help=True)


@inference_app.command("sync")
def inference_sync(
    config: Optional[Path] = ConfigOption,
    override: Optional[list[str]] = OverrideOption,
    backend: Backend = typer.Option(Backend.vllm, help="inference backend"),
    url: Optional[str] = typer.Option(None, help="server URL, e.g. http://127.0.0.1:8000 (inference.url)"),
    worker_id: Optional[str] = typer.Option(None, help="this worker's id in Redis (inference.worker_id)"),
    served_model: Optional[str] = typer.Option(None, help="the server's base model name (inference.served_model)"),
) -> None:
    """Follow policy-versions; verify, load and heartbeat every new version until interrupted."""
    cfg = load_or_exit(config, override)
    updates = {k: v for k, v in {"url": url, "worker_id": worker_id, "served_model": served_model}.items() if v}
    if updates:
        cfg.inference = cfg.inference.model_validate({**cfg.inference.model_dump(), **updates})
    from rlstream.inference.service import run_sync

    run_sync(cfg)


@inference_app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def inference_serve(
    ctx: typer.Context,
    model_dir: Path = typer.Argument(..., help="a transformers model directory (untied embeddings)"),
    served_model: str = typer.Option("policy", help="the name clients request"),
    port: Optional[int] = typer.Option(None, help="port (default: a free one)"),
    venv: Optional[Path] = typer.Option(None, help="the vLLM virtualenv (created if missing)"),
    api_key: Optional[str] = typer.Option(None, envvar="RLSTREAM_INFERENCE__API_KEY", show_default=False,
                                          help="the key clients must send (vLLM's --api-key, handed over in its "
                                               "environment, never on its command line; /v1 routes including the "
                                               "LoRA admin ones need it); also RLSTREAM_INFERENCE__API_KEY"),
    tool_call_parser: str = typer.Option("auto", help="vLLM's tool-call parser (--enable-auto-tool-choice "
                                         "--tool-call-parser): 'auto' picks the model family's, 'none' starts vLLM "
                                         "without automatic tool choice"),
    vllm_arg: Optional[list[str]] = typer.Option(None, "--vllm-arg", help="one more vLLM option, as it is "
                                                 "(repeatable, e.g. --vllm-arg=--max-num-seqs=8); options after "
                                                 "'--' go to vLLM too"),
    restart: bool = typer.Option(True, "--restart/--no-restart", help="restart vLLM when its process exits or its "
                                 "/health fails 3 checks in a row (its engine died); --no-restart: the command ends "
                                 "with the server"),
) -> None:
    """Start a vLLM OpenAI server (CPU, fp32, LoRA enabled, tool calling on) and keep it running until interrupted.
    Any vLLM option passes through: ``rlstream inference serve MODEL -- --max-num-seqs 8``. A server that dies is
    restarted on the same port (``--no-restart``: not)."""
    from functools import partial

    from rlstream.ops.vllm import serve_in_foreground, start_vllm_server
    from rlstream.schemas.masking import remember_secret

    remember_secret(api_key)
    extra = [*(vllm_arg or []), *ctx.args]
    server = start_vllm_server(model_dir, served_model, port=port, venv_dir=venv, api_key=api_key,
                               extra_args=extra, tool_call_parser=tool_call_parser)
    again = partial(start_vllm_server, model_dir, served_model, port=server.port, venv_dir=venv, api_key=api_key,
                    workdir=Path(server.workdir), extra_args=extra, tool_call_parser=tool_call_parser)
    keyed = "; clients send its API key" if api_key else "; no API key: anyone who reaches it can use it"
    console.print(f"vLLM serving {served_model} at {server.base_url} (pid {server.pid}, log {server.log_file}{keyed})")
    serve_in_foreground(server, restart=again if restart else None)
