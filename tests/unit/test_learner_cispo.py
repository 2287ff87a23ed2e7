"""CISPO (learner.importance_correction: cispo): a hand-computed two-token, two-version case, and its gradient
against finite differences on a tiny model."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlstream.learner.batch import collate
from rlstream.learner.grpo import LossConfig, cispo_loss, grpo_loss
from rlstream.learner.policy import completion_logprobs, load_policy
from rlstream.learner.step import loss_config
from rlstream.schemas.config import LearnerConfig, LoraConfig
from tests.support.learner_helpers import random_samples, tiny_model


def test_two_tokens_two_versions_by_hand() -> None:
    # token 1: pi 0.5 now, mu 0.25 when sampled (version behind): weight 2 = the cap; token 2: pi 0.2, mu 0.4: 0.5
    logprobs = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    behaviour = torch.tensor([[math.log(0.25), math.log(0.4)]])
    per_token, clipped, weights = cispo_loss(logprobs, torch.tensor([1.0]), behaviour, cap=1.5)
    assert weights[0].tolist() == pytest.approx([1.5, 0.5])  # 2 clipped to the cap 1.5
    assert clipped.tolist() == [[True, False]]
    assert per_token[0].tolist() == pytest.approx([-1.5 * math.log(0.5), -0.5 * math.log(0.2)])
    per_token.sum().backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-1.5, -0.5])  # every token keeps a gradient
    # control: PPO's clipped surrogate with truncated IS zeroes the gradient of a token outside the trust region
    logprobs_ppo = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.2)]])  # token 1 moved x2 since the batch start: clipped
    parts = grpo_loss(logprobs_ppo, torch.tensor([1.0]), torch.ones(1, 2), LossConfig(), old_logprobs=old,
                      behaviour_logprobs=behaviour)
    parts.loss.backward()
    assert logprobs_ppo.grad[0, 0] == 0.0 and logprobs_ppo.grad[0, 1] != 0.0
    cispo = grpo_loss(logprobs.detach().requires_grad_(), torch.tensor([1.0]), torch.ones(1, 2),
                      LossConfig(importance_correction="cispo", importance_cap=1.5), old_logprobs=old,
                      behaviour_logprobs=behaviour)
    assert cispo.is_weights[0].tolist() == pytest.approx([1.5, 0.5])


def test_cispo_gradient_matches_finite_differences_on_a_tiny_model(tmp_path: Path) -> None:
    cfg = LearnerConfig(model=str(tiny_model(tmp_path)), lora=LoraConfig(enabled=False), device="cpu",
                        importance_correction="cispo", importance_cap=1.5)
    policy = load_policy(cfg)
    model = policy.model.double()
    samples = random_samples(groups=1, per_group=2, seed=4)
    for s, a in zip(samples, (1.0, -1.0)):
        s.advantage = a
    batch = collate(samples, policy.pad_id)
    lcfg = loss_config(cfg)
    assert lcfg.importance_correction == "cispo"
    with torch.no_grad():
        weights = cispo_loss(completion_logprobs(model, batch).double(), batch.advantages.double(),
                             batch.behaviour_logprobs.double(), 1.5)[2]

    def loss_at() -> torch.Tensor:
        # the detached weight is a constant of the objective: finite differences hold it fixed
        logprobs = completion_logprobs(model, batch).double()
        per_token = -(weights * batch.advantages.double().unsqueeze(-1)) * logprobs
        return (per_token * batch.completion_mask).sum() / batch.completion_mask.sum()

    param = model.lm_head.weight if hasattr(model, "lm_head") else next(model.parameters())
    logprobs = completion_logprobs(model, batch)
    parts = grpo_loss(logprobs, batch.advantages, batch.completion_mask, lcfg,
                      behaviour_logprobs=batch.behaviour_logprobs)
    parts.loss.backward()
    analytic = param.grad.clone()
    eps = 1e-3  # the logprobs are computed in float32 (the chunked log-softmax), so a wider step
    largest = torch.topk(analytic.abs().flatten(), 3).indices
    for flat in largest.tolist():
        index = divmod(flat, analytic.shape[1])
        with torch.no_grad():
            original = param[index].item()
            param[index] = original + eps
            up = float(loss_at())
            param[index] = original - eps
            down = float(loss_at())
            param[index] = original
        assert analytic[index].item() == pytest.approx((up - down) / (2 * eps), rel=2e-3)
