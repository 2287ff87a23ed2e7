"""Sequence-level importance sampling (``LossConfig.importance_correction="sequence"``, GSPO's geometric-mean ratio
per turn) against values computed by hand: two tokens, a behaviour policy one version older."""
from __future__ import annotations

import math

import pytest
import torch

from rlstream.learner.grpo import LossConfig, grpo_loss, sequence_importance_weights, truncated_importance_weights

pytestmark = pytest.mark.unit


def test_one_weight_per_turn_the_geometric_mean_of_its_token_ratios() -> None:
    old = torch.tensor([[math.log(0.4), math.log(0.5)], [math.log(0.9), -1.0]])
    behaviour = torch.tensor([[math.log(0.1), math.log(0.5)],  # token ratios 4 and 1 -> sqrt(4) = 2
                              [math.log(0.1), 0.0]])  # ratio 9 on its one real token (the second is padding)
    mask = torch.tensor([[1, 1], [1, 0]])
    w = sequence_importance_weights(old, behaviour, mask, cap=5.0)
    assert w.flatten().tolist() == pytest.approx([2.0, 2.0, 5.0, 5.0])  # 9 truncated at the cap
    assert sequence_importance_weights(old, None, mask, cap=5.0) is None
    # token-level truncation weighs the same two tokens 4 -> capped and 1
    assert truncated_importance_weights(old, behaviour, cap=5.0)[0].tolist() == pytest.approx([4.0, 1.0])


def test_grpo_loss_with_sequence_weights() -> None:
    lp = torch.tensor([[math.log(0.4), math.log(0.5)]], requires_grad=True)
    behaviour = torch.tensor([[math.log(0.1), math.log(0.5)]])
    cfg = LossConfig(importance_cap=2.0, importance_correction="sequence")
    parts = grpo_loss(lp, torch.tensor([1.5]), torch.tensor([[1, 1]]), cfg, behaviour_logprobs=behaviour)
    # ratio to the batch-start policy 1: surrogate -A per token, times the turn's weight min(2, 2) = 2, token mean
    assert parts.loss.item() == pytest.approx(-1.5 * 2.0, rel=1e-6)
    parts.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-1.5 * 2.0 / 2, -1.5 * 2.0 / 2], rel=1e-6)
    token = grpo_loss(lp.detach(), torch.tensor([1.5]), torch.tensor([[1, 1]]), LossConfig(importance_cap=2.0),
                      behaviour_logprobs=behaviour)  # token-level: weights min(4, 2) = 2 and 1
    assert token.loss.item() == pytest.approx(-1.5 * (2.0 + 1.0) / 2, rel=1e-6)
