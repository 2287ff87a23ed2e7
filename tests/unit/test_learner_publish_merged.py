"""A LoRA policy published merged (``learner.lora.publish_merged``): plain full weights with a verified sha256
manifest, kind ``full``, that transformers loads to the LoRA model's logprobs; the trained model keeps its adapter.
Control: the default publishes the adapter."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlstream.learner.policy import Policy, load_policy
from rlstream.learner.publish import write_version
from rlstream.learner.step import GRPOTrainerStep
from rlstream.schemas.config import LearnerConfig, LoraConfig
from rlstream.schemas.models import FileDigest, PolicyVersion, WeightsKind
from rlstream.transport.manifest import verify
from tests.support.learner_helpers import random_samples, tiny_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    """A LoRA policy after one learner step, set to publish merged."""
    torch.manual_seed(0)
    cfg = LearnerConfig(model=str(tiny_model(tmp_path_factory.mktemp("merged"))), device="cpu", learning_rate=2e-2,
                        micro_batch_size=4, lora=LoraConfig(enabled=True, publish_merged=True))
    policy = load_policy(cfg)
    assert policy.publish_merged
    stats = GRPOTrainerStep(policy, cfg).step(random_samples(seed=3))
    assert stats.optimizer_steps == cfg.num_iterations == 3
    return policy


def _record(directory: Path, manifest: dict) -> PolicyVersion:
    return PolicyVersion(policy=manifest["policy"], version=manifest["version"], base_model=manifest["base_model"],
                         kind=WeightsKind(manifest["kind"]), uri=str(directory), learner_step=1,
                         files=[FileDigest(path=f["path"], sha256=f["sha256"], size=f["size"])
                                for f in manifest["files"]])


def _logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)


def test_a_lora_policy_published_merged_is_verified_full_weights_with_the_lora_logprobs(
        trained: Policy, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    directory, manifest = write_version(trained, tmp_path / "versions", "p", 1)
    names = {p.name for p in directory.iterdir()}
    assert manifest["kind"] == "full"
    assert {"model.safetensors", "config.json", "manifest.json"} <= names
    assert not any(n.startswith("adapter_") for n in names)
    assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"] is False
    assert verify(_record(directory, manifest), roots=[tmp_path / "versions"]) == directory

    ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12, 64]])
    trained.model.eval()
    lora = _logprobs(trained.model, ids)
    merged = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, local_files_only=True)
    assert torch.allclose(_logprobs(merged, ids), lora, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(trained.base_model, dtype=torch.float32, local_files_only=True)
    assert (_logprobs(base, ids) - lora).abs().max() > 1e-3  # the adapter was trained: base weights would differ

    # the model being trained still carries its adapter (merged on a copy)
    assert any("lora_" in n for n, _ in trained.model.named_parameters())
    assert torch.equal(_logprobs(trained.model, ids), lora)


def test_control_the_default_publishes_the_adapter(trained: Policy, tmp_path: Path) -> None:
    adapter = Policy(model=trained.model, tokenizer=trained.tokenizer, device=trained.device, dtype=trained.dtype,
                     lora=True, base_model=trained.base_model)
    directory, manifest = write_version(adapter, tmp_path / "versions", "p", 1)
    names = {p.name for p in directory.iterdir()}
    assert manifest["kind"] == "lora"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    assert "model.safetensors" not in names
    assert verify(_record(directory, manifest), roots=[tmp_path / "versions"]) == directory
    assert LearnerConfig().lora.publish_merged is False
