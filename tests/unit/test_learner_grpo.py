"""Each GRPO function against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from rlstream.learner.batch import Sample, collate
from rlstream.learner.grpo import (LossConfig, aggregate_loss, clipped_surrogate, group_advantages, grpo_loss, k3_kl,
                          lr_factor, policy_ratio, token_logprobs, truncated_importance_weights)


def test_group_advantages_scalings_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0])
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    none = group_advantages(rewards, index, "none")
    assert none.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, -1.0, 1.0])
    group = group_advantages(rewards, index, "group")
    # group 0: std (n-1) = sqrt(0.5); group 1: std 0; group 2: std sqrt(2)
    s0, s2 = math.sqrt(0.5), math.sqrt(2.0)
    assert group.tolist() == pytest.approx([0.5 / (s0 + 1e-4), -0.5 / (s0 + 1e-4), 0.0, 0.0,
                                            -1.0 / (s2 + 1e-4), 1.0 / (s2 + 1e-4)], rel=1e-6)
    batch = group_advantages(rewards, index, "batch")
    mean = 8.0 / 6
    std = math.sqrt(sum((r - mean) ** 2 for r in [1, 0, .5, .5, 2, 4]) / 5)
    assert batch.tolist() == pytest.approx([v / (std + 1e-4) for v in [0.5, -0.5, 0, 0, -1, 1]], rel=1e-6)
    with pytest.raises(ValueError):
        group_advantages(rewards, index, "bogus")  # type: ignore[arg-type]


def test_token_logprobs_by_hand() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probs 1/4, 3/4
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
    assert token_logprobs(logits, torch.tensor([[0]]), temperature=0.5).item() == pytest.approx(math.log(1 / 10))


def test_truncated_importance_weights_cap_and_on_policy() -> None:
    old = torch.tensor([[-1.0, -1.0, -3.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -1.0]])
    w = truncated_importance_weights(old, behaviour, cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, math.exp(-2.0)])  # e^1 = 2.718 capped at 2
    assert truncated_importance_weights(old, None, cap=2.0) is None


def test_clipped_surrogate_by_hand() -> None:
    ratio = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    adv = torch.tensor([2.0, -1.0])
    loss, active = clipped_surrogate(ratio, adv, eps_low=0.2, eps_high=0.3)
    # A>0: -min(r*A, clip(r)*A): r=.5 -> -min(1.0, 1.6) = -1.0 ; r=1.5 -> -min(3.0, 2.6) = -2.6 (clipped)
    # A<0: r=.5 -> -min(-.5, -.8) = .8 (clipped); r=1.5 -> -min(-1.5, -1.3) = 1.5
    assert loss.tolist()[0] == pytest.approx([-1.0, -2.0, -2.6])
    assert loss.tolist()[1] == pytest.approx([0.8, 1.0, 1.5])
    assert active.tolist() == [[False, False, True], [True, False, False]]


def test_policy_ratio_is_one_with_gradient_of_logprobs() -> None:
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    r = policy_ratio(lp, lp.detach())
    assert r.tolist() == [1.0, 1.0]
    r.sum().backward()
    assert lp.grad.tolist() == [1.0, 1.0]


def test_k3_kl_by_hand() -> None:
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -1.5])
    kl = k3_kl(lp, ref)
    assert kl.tolist() == pytest.approx([0.0, math.e - 1 - 1, math.exp(-1) + 1 - 1])
    assert (kl >= 0).all()


def test_aggregate_loss_modes_by_hand() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(per_token, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(per_token, mask, "sequence_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate_loss(per_token, mask, "constant", constant=5).item() == pytest.approx(10 / (2 * 5))
    # micro-batch halves with whole-step totals add up to the full-batch value
    halves = sum(aggregate_loss(per_token[i:i + 1], mask[i:i + 1], "token_mean", total_tokens=4.0) for i in (0, 1))
    assert float(halves) == pytest.approx(10 / 4)
    seq_halves = sum(aggregate_loss(per_token[i:i + 1], mask[i:i + 1], "sequence_mean", total_sequences=2.0)
                     for i in (0, 1))
    assert float(seq_halves) == pytest.approx(3.0)


def test_grpo_loss_combines_is_and_kl_by_hand() -> None:
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.5, -2.0]])
    ref = torch.tensor([[-1.0, -1.0]])
    cfg = LossConfig(epsilon_low=0.2, epsilon_high=0.2, importance_cap=1.5, beta=0.1)
    parts = grpo_loss(lp, torch.tensor([2.0]), torch.tensor([[1, 1]]), cfg, behaviour_logprobs=behaviour,
                      ref_logprobs=ref)
    # ratio 1 -> surrogate -A = -2 per token; IS weights [min(e^.5,1.5)=1.5, 1]; kl [0, e-2]
    expected = ((-2.0 * 1.5) + (-2.0 * 1.0 + 0.1 * (math.e - 2))) / 2
    assert parts.loss.item() == pytest.approx(expected, rel=1e-6)
    parts.loss.backward()
    # d/dl: surrogate -A*w*r -> -A*w; kl d/dl = 1 - exp(ref - l)
    assert lp.grad.tolist()[0] == pytest.approx([(-2.0 * 1.5) / 2, (-2.0 + 0.1 * (1 - math.e)) / 2], rel=1e-6)
    with pytest.raises(ValueError):
        grpo_loss(lp, torch.tensor([1.0]), torch.tensor([[1, 1]]), cfg)


def test_lr_factor_warmup_and_schedules() -> None:
    assert [lr_factor(s, 4, 10) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert lr_factor(4, 4, 10, "linear") == pytest.approx(1.0)
    assert lr_factor(7, 4, 10, "linear") == pytest.approx(0.5)
    assert lr_factor(10, 4, 10, "linear") == pytest.approx(0.0)
    assert lr_factor(7, 4, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(10, 0, 10, "cosine") == pytest.approx(0.0)


def test_collate_left_pads_prompts_right_pads_completions() -> None:
    samples = [Sample([5, 6], [7], [-0.5], 1.0, 0, 0), Sample([8], [9, 10], None, 0.0, 0, 0)]
    b = collate(samples, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 0], [0, 8, 9, 10]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 2], [0, 0, 1, 2]]
    assert b.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert b.behaviour_logprobs.tolist() == [[-0.5, 0.0], [0.0, 0.0]]
