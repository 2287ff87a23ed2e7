"""Support for the real-vLLM tests: one tiny model and ONE vLLM server per test session, and a
transformers (fp32) reference to compare logprobs with.

Each test module declares ``vllm = vllm_fixture()``; all of them share the same server (a start costs
~40-55 s and ~3 GB), which is stopped by PID at the end of the session.
"""
from __future__ import annotations

import asyncio
import atexit
import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from rlstream.ops.toy import build_tiny_model
from rlstream.ops.vllm import VllmServer, start_vllm_server
from rlstream.inference.manifest import digest_files
from rlstream.schemas.models import PolicyVersion, WeightsKind

SERVED_MODEL = "policy"
TOLERANCE = 1e-4
_state: dict[str, Any] = {}


def tiny_model_dir(factory: pytest.TempPathFactory) -> Path:
    if "model" not in _state:
        fixed = os.environ.get("RLSTREAM_TEST_MODEL_DIR")
        _state["model"] = build_tiny_model(Path(fixed) if fixed else factory.getbasetemp() / "tiny-model")
    return _state["model"]


def shared_server(factory: pytest.TempPathFactory) -> VllmServer:
    """The session's vLLM server on the tiny model (tool calling enabled for the capture tests)."""
    server = _state.get("server")
    if server is None and os.environ.get("RLSTREAM_TEST_VLLM_URL"):  # a server already running on the tiny
        url = os.environ["RLSTREAM_TEST_VLLM_URL"].rstrip("/")      # model (RLSTREAM_TEST_MODEL_DIR)
        server = VllmServer(url=url, model=SERVED_MODEL, model_dir=str(tiny_model_dir(factory)), pid=-1,
                            log_file="", port=int(url.rsplit(":", 1)[1]), external=True)
        _state["server"] = server
    if server is None or not server.alive():
        model_dir = tiny_model_dir(factory)
        # tool calling as rlstream starts vLLM by default (the toy model's template: the pythonic parser)
        server = start_vllm_server(model_dir, SERVED_MODEL, workdir=factory.getbasetemp() / "vllm")
        _state["server"] = server
        atexit.register(server.stop)
    return server


def vllm_fixture() -> Callable[..., VllmServer]:
    @pytest.fixture(scope="session")
    def vllm(tmp_path_factory: pytest.TempPathFactory) -> Any:
        server = shared_server(tmp_path_factory)
        yield server
        if _state.get("server") is server and server.alive():
            server.stop()
    return vllm


# --- transformers reference -----------------------------------------------------------------------------
def load_reference(model_dir: Path, adapter_dir: Path | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()


def reference_logprobs(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """log p(completion token | prefix) under ``model`` (fp32), one per completion token."""
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids)
    return [float(logprobs[start - 1 + i, tok]) for i, tok in enumerate(completion_ids)]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


# --- new weight versions (what the learner would publish) ---------------------------------------------------
def make_lora_version(base_dir: Path, out_dir: Path, seed: int = 1, rank: int = 8) -> Path:
    """A PEFT LoRA adapter with random (non-zero) weights on the attention projections."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = load_reference(base_dir)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    peft_model.save_pretrained(str(out_dir))
    (out_dir / "README.md").unlink(missing_ok=True)  # a version holds weights, JSON and tokenizer files only
    return out_dir


def make_full_version(base_dir: Path, out_dir: Path, seed: int = 2, scale: float = 0.05) -> Path:
    """The base model with every weight perturbed, saved as a new directory (untied embeddings)."""
    import torch

    torch.manual_seed(seed)
    model = load_reference(base_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * scale)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def policy_version(policy: str, version: int, kind: WeightsKind, weights_dir: Path, base_dir: Path) -> PolicyVersion:
    return PolicyVersion(policy=policy, version=version, base_model=str(base_dir), kind=kind, uri=str(weights_dir),
                         files=digest_files(weights_dir), learner_step=version)


async def wait_until(check: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
