"""Masked importance sampling (``LossConfig.importance_correction="mask"``) against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from rlstream.learner.grpo import LossConfig, grpo_loss, masked_importance_weights

pytestmark = pytest.mark.unit


def test_masked_importance_weights_keep_the_band_and_zero_the_rest() -> None:
    old = torch.tensor([[-1.0, -1.0, -3.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -1.5, -1.0, -3.0]])  # ratios 1, e^.5 = 1.65, e^-2 = 0.135, e^2 = 7.39
    w = masked_importance_weights(old, behaviour, low=0.5, high=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, math.exp(0.5), 0.0, 0.0])
    assert masked_importance_weights(old, None, low=0.5, high=2.0) is None


def test_grpo_loss_with_the_mask_drops_tokens_outside_the_band() -> None:
    lp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.5, -4.0, 0.5]])  # ratios e^.5 (kept), e^3 (masked), e^-1.5 = 0.22 (masked)
    cfg = LossConfig(epsilon_low=0.2, epsilon_high=0.2, importance_cap=2.0, importance_correction="mask",
                     importance_mask_low=0.5)
    parts = grpo_loss(lp, torch.tensor([2.0]), torch.tensor([[1, 1, 1]]), cfg, behaviour_logprobs=behaviour)
    # ratio 1 -> surrogate -A = -2 per token, weights [e^.5, 0, 0], token mean over 3 tokens
    assert parts.loss.item() == pytest.approx(-2.0 * math.exp(0.5) / 3, rel=1e-6)
    parts.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-2.0 * math.exp(0.5) / 3, 0.0, 0.0], rel=1e-6)
    truncated = grpo_loss(lp.detach(), torch.tensor([2.0]), torch.tensor([[1, 1, 1]]),
                          LossConfig(epsilon_low=0.2, epsilon_high=0.2, importance_cap=2.0),
                          behaviour_logprobs=behaviour)  # the default keeps a capped share of every token
    assert truncated.loss.item() == pytest.approx(-2.0 * (math.exp(0.5) + 2.0 + math.exp(-1.5)) / 3, rel=1e-6)
