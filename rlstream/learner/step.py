"""One GRPO optimizer step over a list of samples: advantages, micro-batches with gradient accumulation,
gradient clipping, optimizer and LR schedule."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from rlstream.learner.batch import Sample, behaviour_rows, collate
from rlstream.learner.grpo import LossConfig, group_advantages, grpo_loss, lr_factor, masked_mean
from rlstream.learner.policy import Policy, completion_logprobs
from rlstream.schemas.config import LearnerConfig
from rlstream.transport import metric_names as mn


def loss_config(cfg: LearnerConfig) -> LossConfig:
    return LossConfig(epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, importance_cap=cfg.importance_cap,
                      beta=cfg.beta, aggregation=cfg.loss_aggregation, loss_constant=float(cfg.loss_constant))


def assign_advantages(samples: Sequence[Sample], scale: str) -> None:
    """Fill ``sample.advantage`` from the rewards of its group (per trajectory: every turn of a trajectory
    shares its reward, so the statistics are over the group's samples)."""
    if not samples:
        return
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    index = torch.tensor([s.group for s in samples], dtype=torch.long)
    adv = group_advantages(rewards, index, scale)  # type: ignore[arg-type]
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a


@dataclass
class StepStats:
    """Figures of one optimizer step (reported as MetricEvents)."""

    loss: float
    kl: float
    clip_fraction: float
    is_ratio_mean: float
    is_ratio_min: float
    is_ratio_max: float
    reward_mean: float
    reward_std: float
    advantage_mean: float
    advantage_std: float
    grad_norm: float
    learning_rate: float
    tokens: int
    sequences: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def figures(self) -> dict[str, float]:
        """Every figure by its field name (what a PolicyVersion's ``metrics`` hold)."""
        d = {k: float(v) for k, v in self.__dict__.items()}
        d["tokens_per_s"] = self.tokens_per_s
        return d


#: The metric name of each figure of :meth:`StepStats.figures`.
STEP_METRICS: dict[str, str] = {
    "loss": mn.LEARNER_LOSS, "kl": mn.LEARNER_KL, "clip_fraction": mn.LEARNER_CLIP_FRACTION,
    "is_ratio_mean": mn.LEARNER_IS_RATIO_MEAN, "is_ratio_min": mn.LEARNER_IS_RATIO_MIN,
    "is_ratio_max": mn.LEARNER_IS_RATIO_MAX, "reward_mean": mn.LEARNER_REWARD_MEAN,
    "reward_std": mn.LEARNER_REWARD_STD, "advantage_mean": mn.LEARNER_ADVANTAGE_MEAN,
    "advantage_std": mn.LEARNER_ADVANTAGE_STD, "grad_norm": mn.LEARNER_GRAD_NORM,
    "learning_rate": mn.LEARNER_LEARNING_RATE, "tokens": mn.LEARNER_TOKENS, "sequences": mn.LEARNER_SEQUENCES,
    "seconds": mn.LEARNER_SECONDS, "tokens_per_s": mn.LEARNER_TOKENS_PER_S,
}


def step_figures(stats: StepStats | None, n_groups: int, policy_lag: Sequence[int]) -> dict[str, float]:
    """The ``learner/*`` metrics of one learner step, keyed by their names in :mod:`metric_names`:
    groups trained on, policy lag (when groups were), and the optimizer step's figures (when it ran)."""
    out: dict[str, float] = {mn.LEARNER_GROUPS: float(n_groups)}
    if policy_lag:
        out[mn.LEARNER_POLICY_LAG_MEAN] = sum(policy_lag) / len(policy_lag)
        out[mn.LEARNER_POLICY_LAG_MAX] = float(max(policy_lag))
    if stats is not None:
        out.update({STEP_METRICS[k]: v for k, v in stats.figures().items()})
    return out


class GRPOTrainerStep:
    """Owns the optimizer and scheduler of a :class:`Policy` and runs optimizer steps."""

    def __init__(self, policy: Policy, cfg: LearnerConfig) -> None:
        self.policy = policy
        self.cfg = cfg
        self.loss_cfg = loss_config(cfg)
        self.optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.learning_rate,
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.total_steps, cfg.lr_schedule))

    def accumulate(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Forward and backward of every micro-batch (gradients accumulate); returns loss figures."""
        cfg, policy = self.cfg, self.policy
        total_tokens = float(sum(len(s.completion_ids) for s in samples))
        total_seqs = float(len(samples))
        loss_sum, kl_sum, clip_sum, n_tok = 0.0, 0.0, 0.0, 0.0
        is_vals: list[torch.Tensor] = []
        for start in range(0, len(samples), cfg.micro_batch_size):
            batch = collate(samples[start:start + cfg.micro_batch_size], policy.pad_id).to(policy.device)
            mask = batch.completion_mask
            logprobs = completion_logprobs(policy.model, batch)
            old = logprobs.detach()
            behaviour = None
            if batch.behaviour_logprobs is not None:
                rows = behaviour_rows(batch).to(policy.device)
                behaviour = torch.where(rows[:, None], batch.behaviour_logprobs, old)
            ref = None
            if self.loss_cfg.beta > 0:
                with torch.no_grad(), policy.reference_mode() as ref_model:
                    ref = completion_logprobs(ref_model, batch)
            parts = grpo_loss(logprobs, batch.advantages, mask, self.loss_cfg, old_logprobs=old,
                              behaviour_logprobs=behaviour, ref_logprobs=ref, total_tokens=total_tokens,
                              total_sequences=total_seqs)
            parts.loss.backward()
            tokens = float(mask.sum())
            loss_sum += float(parts.loss.detach())
            if parts.kl is not None:
                kl_sum += masked_mean(parts.kl, mask) * tokens
            clip_sum += masked_mean(parts.clipped.float(), mask) * tokens
            n_tok += tokens
            if parts.is_weights is not None:
                is_vals.append(parts.is_weights[mask.bool()].float().cpu())
        is_all = torch.cat(is_vals) if is_vals else torch.ones(1)
        return {"loss": loss_sum, "kl": kl_sum / max(n_tok, 1.0), "clip_fraction": clip_sum / max(n_tok, 1.0),
                "is_ratio_mean": float(is_all.mean()), "is_ratio_min": float(is_all.min()),
                "is_ratio_max": float(is_all.max()), "tokens": n_tok}

    def step(self, samples: Sequence[Sample]) -> StepStats:
        """Advantages, accumulate gradients over micro-batches, clip, optimizer and scheduler step."""
        started = time.perf_counter()
        assign_advantages(samples, self.cfg.scale_rewards)
        self.optimizer.zero_grad(set_to_none=True)
        figures = self.accumulate(samples)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), self.cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        rewards = torch.tensor([s.reward for s in samples] or [0.0])
        adv = torch.tensor([s.advantage for s in samples] or [0.0])
        return StepStats(
            loss=figures["loss"], kl=figures["kl"], clip_fraction=figures["clip_fraction"],
            is_ratio_mean=figures["is_ratio_mean"], is_ratio_min=figures["is_ratio_min"],
            is_ratio_max=figures["is_ratio_max"], reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()) if rewards.numel() > 1 else 0.0, advantage_mean=float(adv.mean()),
            advantage_std=float(adv.std()) if adv.numel() > 1 else 0.0, grad_norm=float(grad_norm),
            learning_rate=float(lr), tokens=int(figures["tokens"]), sequences=len(samples),
            seconds=time.perf_counter() - started)
