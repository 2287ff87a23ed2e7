"""How far the learner is ahead of the serving version, and moving it back to the serving version's weights.

Under a promotion gate the rollout samples only the serving version, so the learner's distance from it is how
off-policy its data is. :func:`versions_ahead` counts that distance along the versions the learner trained;
:func:`load_serving_weights` reloads a published version into the model being trained after checking it as the
inference side does (:func:`rlstream.transport.manifest.verify`: under the versions root, only listed files of
allowed types, every sha256) and, where the serving pointer names a digest, that the digest names these files.
docs/off-policy.md states the rule.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlstream.learner.checkpoint import MANIFEST
from rlstream.learner.policy import Policy
from rlstream.learner.distributed import DataParallel
from rlstream.learner.publish import version_dir
from rlstream.learner.step import GRPOTrainerStep
from rlstream.schemas.config import LearnerConfig
from rlstream.schemas.models import FileDigest, PolicyVersion, WeightsKind
from rlstream.transport.weight_store import is_remote
from rlstream.transport.manifest import ManifestError, local_dir, verify
from rlstream.transport.serving import ServingPointer, files_digest


def versions_ahead(version: int, serving: int, reset_to: int | None = None, reset_at: int | None = None) -> int:
    """Versions between ``serving`` and the learner's weights at ``version``, counted along what it trained.

    Without a reset that is ``version - serving``. After a reset to ``reset_to``'s weights at version number
    ``reset_at`` (the versions up to ``reset_at`` are no longer the learner's ancestors), a serving version at or
    below ``reset_at`` counts from the reset: ``(version - reset_at) + max(0, reset_to - serving)``."""
    if reset_at is None or reset_to is None or serving > reset_at:
        return max(0, version - serving)
    return max(0, version - reset_at) + max(0, reset_to - serving)


@dataclass(frozen=True)
class ServingWeights:
    """A verified published version to train on from."""

    version: int
    directory: Path
    kind: WeightsKind


def verified_serving_weights(pointer: ServingPointer, policy_name: str, versions_root: Path) -> ServingWeights:
    """The serving version's weights directory once verified (raises :class:`ManifestError` otherwise).

    The directory is the pointer's ``uri`` (the version's own directory under ``versions_root`` when the pointer
    has none); its ``manifest.json`` must name this policy and version; the files are checked by
    :func:`rlstream.transport.manifest.verify` with ``versions_root`` as the only allowed root; a ``sha256`` on
    the pointer must be the digest of those files (:func:`files_digest`, or the single file's sha256)."""
    # a pointer naming a URL (a remote weight store): the learner's own copy under versions_root
    directory = local_dir(pointer.uri) if pointer.uri and not is_remote(pointer.uri) else \
        version_dir(versions_root, pointer.version)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"serving version {pointer.version}: no readable {MANIFEST} in {directory}: {exc}") from exc
    if manifest.get("policy") != policy_name or manifest.get("version") != pointer.version:
        raise ManifestError(f"{directory} holds version {manifest.get('version')} of {manifest.get('policy')!r}, "
                            f"not the serving version {pointer.version} of {policy_name!r}")
    kind = WeightsKind(manifest.get("kind", "lora"))
    record = PolicyVersion(policy=policy_name, version=pointer.version, base_model=str(manifest.get("base_model", "")),
                           kind=kind, uri=str(directory), learner_step=0,
                           files=[FileDigest(path=f["path"], sha256=f["sha256"], size=f["size"])
                                  for f in manifest.get("files", [])])
    checked = verify(record, roots=[versions_root])
    if pointer.sha256:
        named = {files_digest(record)} | ({record.files[0].sha256} if len(record.files) == 1 else set())
        if pointer.sha256.lower() not in named:
            raise ManifestError(f"serving pointer's sha256 {pointer.sha256} does not name the files of version "
                                f"{pointer.version} in {directory}")
    return ServingWeights(pointer.version, checked, kind)


def load_serving_weights(policy: Policy, weights: ServingWeights) -> None:
    """Copy ``weights`` into the model being trained (the adapter for LoRA, every parameter for full weights);
    raises :class:`ManifestError` when they do not fit the model."""
    if weights.kind == WeightsKind.lora:
        if not policy.lora:
            raise ManifestError(f"serving version {weights.version} is a LoRA adapter; the learner trains full weights")
        from peft import set_peft_model_state_dict

        state = load_file(str(weights.directory / "adapter_model.safetensors"))
        if policy.sharding is not None:
            _load_sharded(policy, weights, {_adapter_parameter(k): v for k, v in state.items()})
            return
        result = set_peft_model_state_dict(policy.model, state)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ManifestError(f"serving version {weights.version}'s adapter does not fit the model: {unexpected[:3]}")
        return
    if policy.lora:
        raise ManifestError(f"serving version {weights.version} holds full weights; the learner trains a LoRA adapter")
    state = {}
    for path in sorted(weights.directory.glob("*.safetensors")):
        state.update(load_file(str(path)))
    if policy.sharding is not None:
        _load_sharded(policy, weights, state)
        return
    params = dict(policy.model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    if missing:
        raise ManifestError(f"serving version {weights.version} lacks parameters of the model: {missing[:3]}")
    with torch.no_grad():
        for name, tensor in state.items():
            if name in params:
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))


def _adapter_parameter(key: str, adapter: str = "default") -> str:
    """The model's parameter name of a saved PEFT adapter tensor (saved files leave the adapter name out)."""
    for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        key = key.replace(f".{part}.weight", f".{part}.{adapter}.weight").replace(f".{part}.bias", f".{part}.{adapter}.bias")
    return key


def _load_sharded(policy: Policy, weights: ServingWeights, state: dict[str, torch.Tensor]) -> None:
    """Every rank takes its shards of the full tensors it read (no collective: the ranks reach this at different
    times); the trainable parameters must all be there."""
    from rlstream.learner.sharded import load_full_weights

    wanted = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    missing = sorted(wanted - set(state))
    if missing:
        raise ManifestError(f"serving version {weights.version} lacks parameters of the model: {missing[:3]}")
    load_full_weights(policy.model, state)


def fresh_trainer(policy: Policy, cfg: LearnerConfig, old: GRPOTrainerStep,
                  parallel: DataParallel | None = None) -> GRPOTrainerStep:
    """A trainer with a new optimizer (no moments: they belong to the weights left behind) whose learning-rate
    schedule goes on where ``old``'s was."""
    trainer = GRPOTrainerStep(policy, cfg, parallel)
    trainer.scheduler.load_state_dict(old.scheduler.state_dict())
    for group, lr in zip(trainer.optimizer.param_groups, trainer.scheduler.get_last_lr()):
        group["lr"] = lr
    return trainer
