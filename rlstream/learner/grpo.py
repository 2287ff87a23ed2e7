"""GRPO, one small function per concept (pure torch; no model, no Kafka).

Shapes: ``B`` sequences (one per trainable turn), ``T`` completion positions; ``mask`` is 1 on the
completion tokens that carry loss and 0 on padding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ScaleRewards = Literal["none", "group", "batch"]
LossAggregation = Literal["token_mean", "sequence_mean", "constant"]
LRSchedule = Literal["constant", "linear", "cosine"]
#: Added to the reward std before dividing (the value TRL uses, so that both agree).
STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scale: ScaleRewards = "group",
                     eps: float = STD_EPS) -> torch.Tensor:
    """Advantage of each trajectory: reward minus its group's mean, optionally divided by a std.

    ``group_index[i]`` numbers the group of trajectory ``i`` (0..G-1). ``scale``: ``none`` (Dr. GRPO),
    ``group`` (std of the trajectory's group), ``batch`` (std of all rewards). Stds are unbiased (n-1),
    0 for a group of one.
    """
    rewards = rewards.to(torch.float64)
    n_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(rewards))
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, rewards)
    means = sums / counts
    centred = rewards - means[group_index]
    if scale == "none":
        return centred.to(torch.float32)
    if scale == "group":
        sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, centred ** 2)
        std = torch.where(counts > 1, (sq / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))[group_index]
    elif scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else torch.zeros((), dtype=torch.float64)
    else:
        raise ValueError(f"unknown reward scaling {scale!r}")
    return (centred / (std + eps)).to(torch.float32)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under ``logits`` (same leading shape), in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def truncated_importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor | None,
                                 cap: float) -> torch.Tensor | None:
    """Truncated importance sampling: ``min(pi_old / pi_behaviour, cap)`` per token, without gradient.

    ``behaviour_logprobs`` are what the rollout's sampler recorded; None (on-policy data) gives None.
    """
    if behaviour_logprobs is None:
        return None
    return torch.exp(old_logprobs.detach() - behaviour_logprobs).clamp(max=cap)


def policy_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``pi_theta / pi_old`` per token (1 in value at the first iteration, with the gradient of logprobs)."""
    return torch.exp(logprobs - old_logprobs.detach())


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                      eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective as a per-token loss, and the mask of tokens where the clip was active.

    ``advantages`` is (B,) or (B, T); clip range is ``[1 - eps_low, 1 + eps_high]``.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.min(unclipped, clipped)
    active = (clipped < unclipped).detach()
    return loss, active


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: ``exp(r - l) - (r - l) - 1`` (>= 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: LossAggregation = "token_mean", *,
                   constant: float = 1024.0, total_tokens: float | None = None,
                   total_sequences: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    ``token_mean``: sum over all loss tokens / their count; ``sequence_mean``: mean over sequences of each
    sequence's token mean; ``constant``: sum / (sequences * constant) (Dr. GRPO). With gradient accumulation
    pass the whole step's ``total_tokens`` / ``total_sequences`` so that micro-batch losses add up to the
    full-batch loss.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        denom = total_tokens if total_tokens is not None else mask.sum().clamp(min=1.0)
        return (per_token * mask).sum() / denom
    if mode == "sequence_mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        denom = total_sequences if total_sequences is not None else per_token.size(0)
        return per_seq.sum() / denom
    if mode == "constant":
        denom = (total_sequences if total_sequences is not None else per_token.size(0)) * constant
        return (per_token * mask).sum() / denom
    raise ValueError(f"unknown loss aggregation {mode!r}")


@dataclass(frozen=True)
class LossConfig:
    """The knobs of :func:`grpo_loss` (mirrors the learner config)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    importance_cap: float = 2.0
    beta: float = 0.0
    aggregation: LossAggregation = "token_mean"
    loss_constant: float = 1024.0


@dataclass
class LossParts:
    """The loss and the figures reported with it (all but ``loss`` detached)."""

    loss: torch.Tensor
    per_token: torch.Tensor
    kl: torch.Tensor | None
    clipped: torch.Tensor
    is_weights: torch.Tensor | None


def grpo_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, *,
              old_logprobs: torch.Tensor | None = None, behaviour_logprobs: torch.Tensor | None = None,
              ref_logprobs: torch.Tensor | None = None, total_tokens: float | None = None,
              total_sequences: float | None = None) -> LossParts:
    """GRPO loss of one (micro-)batch: clipped surrogate x truncated IS weight + beta * k3 KL, aggregated.

    ``old_logprobs`` default to the detached current logprobs (one optimizer step per batch).
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = policy_ratio(logprobs, old)
    per_token, clipped = clipped_surrogate(ratio, advantages, cfg.epsilon_low, cfg.epsilon_high)
    weights = truncated_importance_weights(old, behaviour_logprobs, cfg.importance_cap)
    if weights is not None:
        per_token = per_token * weights
    kl = None
    if cfg.beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs reference logprobs")
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + cfg.beta * kl
    loss = aggregate_loss(per_token, mask, cfg.aggregation, constant=cfg.loss_constant, total_tokens=total_tokens,
                          total_sequences=total_sequences)
    return LossParts(loss=loss, per_token=per_token.detach(), kl=None if kl is None else kl.detach(),
                     clipped=clipped, is_weights=weights)


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: LRSchedule = "constant") -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based): linear warmup, then
    constant, linear decay to 0, or cosine decay to 0 at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` where ``mask`` is set (0.0 when empty)."""
    m = mask.to(values.dtype)
    n = m.sum()
    return float((values * m).sum() / n) if n > 0 else 0.0
