"""The learner's distance from serving, the run of gate rejections that moves it back, and the check of the serving
version's weights before they are loaded (tampered files refused; control: the untouched version loads and the
model then holds exactly its weights)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstream.learner.policy import load_policy
from rlstream.learner.publish import write_version
from rlstream.learner.reset import fresh_trainer, load_serving_weights, verified_serving_weights, versions_ahead
from rlstream.learner.step import GRPOTrainerStep
from rlstream.schemas.config import LearnerConfig
from rlstream.schemas.models import DecisionKind, PromotionDecision
from rlstream.transport.manifest import ManifestError
from rlstream.transport.promotions import rejection_run
from rlstream.transport.serving import ServingPointer
from tests.support.learner_helpers import tiny_model

pytestmark = pytest.mark.unit


def test_versions_ahead_counts_along_what_the_learner_trained() -> None:
    assert versions_ahead(7, 3) == 4
    assert versions_ahead(2, 5) == 0  # serving ahead of the learner (a restarted learner catching up)
    assert versions_ahead(9, 0, reset_to=0, reset_at=7) == 2  # reset to 0 at version 7: 8 and 9 trained since
    assert versions_ahead(9, 8, reset_to=0, reset_at=7) == 1  # a version trained since the reset now serves
    assert versions_ahead(9, 0, reset_to=2, reset_at=7) == 4  # rolled back below the version reset to


def decision(version: int, kind: DecisionKind, policy: str = "p") -> PromotionDecision:
    return PromotionDecision(policy=policy, version=version, decision=kind)


def test_rejection_run_ends_when_serving_moves_and_ignores_versions_left_behind() -> None:
    rejected = [decision(v, DecisionKind.reject) for v in (1, 2, 3)]
    assert rejection_run(rejected, "p", above=0).count == 3
    assert rejection_run(rejected, "p", above=2).versions == frozenset({3})  # 1 and 2 predate a reset at 2
    moved = rejected[:2] + [decision(2, DecisionKind.promote)] + rejected[2:]
    assert rejection_run(moved, "p", above=0).count == 1
    canary = rejected[:2] + [decision(3, DecisionKind.canary)]
    assert rejection_run(canary, "p", above=0).count == 2  # a canary start moves nothing
    other = [decision(v, DecisionKind.reject, policy="q") for v in (1, 2)]
    assert rejection_run(other, "p", above=0).count == 0


@pytest.fixture()
def published(tmp_path: Path) -> tuple[LearnerConfig, Path, torch.Tensor]:
    cfg = LearnerConfig(model=str(tiny_model(tmp_path)), device="cpu")
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"enabled": True})})
    policy = load_policy(cfg)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.5)
    root = tmp_path / "versions"
    write_version(policy, root, "p", 3)
    return cfg, root, torch.cat([p.detach().flatten() for p in policy.trainable_parameters()])


def test_serving_weights_load_exactly_and_reset_the_optimizer(published: tuple[LearnerConfig, Path, torch.Tensor],
                                                              ) -> None:
    cfg, root, saved = published
    policy = load_policy(cfg)
    assert not torch.equal(torch.cat([p.detach().flatten() for p in policy.trainable_parameters()]), saved)
    weights = verified_serving_weights(ServingPointer(version=3), "p", root)
    load_serving_weights(policy, weights)
    assert torch.equal(torch.cat([p.detach().flatten() for p in policy.trainable_parameters()]), saved)
    old = GRPOTrainerStep(policy, cfg)
    old.optimizer.state[policy.trainable_parameters()[0]]["exp_avg"] = torch.ones(1)
    new = fresh_trainer(policy, cfg, old)
    assert not new.optimizer.state and new.scheduler.last_epoch == old.scheduler.last_epoch


def test_tampered_or_misnamed_serving_weights_are_refused(published: tuple[LearnerConfig, Path, torch.Tensor]) -> None:
    cfg, root, _ = published
    with pytest.raises(ManifestError, match="not the serving version"):
        verified_serving_weights(ServingPointer(version=3), "other-policy", root)
    with pytest.raises(ManifestError, match="does not name"):
        verified_serving_weights(ServingPointer(version=3, sha256="0" * 64), "p", root)
    outside = ServingPointer(version=3, uri=str(root / "v000003"))
    with pytest.raises(ManifestError, match="outside"):
        verified_serving_weights(outside, "p", root / "elsewhere")
    adapter = root / "v000003" / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-1] ^= 0xFF
    adapter.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="sha256"):
        verified_serving_weights(ServingPointer(version=3), "p", root)
