"""One GRPO learner step over a list of samples: trajectory-level advantages, ``num_iterations`` optimizer steps
against the batch-start policy, micro-batches with gradient accumulation, gradient clipping, a non-finite guard,
optimizer and LR schedule."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlstream.learner.batch import Batch, Sample, behaviour_rows, collate
from rlstream.learner.distributed import DataParallel
from rlstream.learner.grpo import (LossConfig, baseline_advantage, group_advantages, grpo_loss, lr_factor, masked_mean,
                                   turn_advantages)
from rlstream.learner.policy import Policy, completion_logprobs_and_entropy
from rlstream.learner.sharded import local_part
from rlstream.schemas.config import LearnerConfig
from rlstream.transport import metric_names as mn
from rlstream.transport.log import get_logger

log = get_logger(__name__)


def loss_config(cfg: LearnerConfig) -> LossConfig:
    return LossConfig(epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, importance_cap=cfg.importance_cap,
                      importance_correction=cfg.importance_correction, importance_mask_low=cfg.importance_mask_low,
                      beta=cfg.beta, aggregation=cfg.loss_aggregation, loss_constant=float(cfg.loss_constant))


@dataclass(frozen=True)
class Trajectories:
    """The trajectories behind a list of samples (turns): one entry per trajectory, in order of first turn."""

    rewards: torch.Tensor  # (N,) float64
    group_index: torch.Tensor  # (N,) long
    tokens: torch.Tensor  # (N,) float64: completion (loss) tokens over all the trajectory's turns
    of_sample: torch.Tensor  # (B,) long: the trajectory of each sample

    @property
    def count(self) -> int:
        return int(self.rewards.numel())


def trajectories_of(samples: Sequence[Sample]) -> Trajectories:
    """Number the trajectories of ``samples``: the turns of one trajectory (same group and ``trajectory`` id)
    map to one entry; a sample without a trajectory id is a trajectory of its own."""
    index: dict[tuple[int, str] | int, int] = {}
    rewards: list[float] = []
    groups: list[int] = []
    tokens: list[float] = []
    of_sample: list[int] = []
    for i, s in enumerate(samples):
        key: tuple[int, str] | int = (s.group, s.trajectory) if s.trajectory is not None else i
        t = index.get(key)
        if t is None:
            t = index[key] = len(rewards)
            rewards.append(s.reward)
            groups.append(s.group)
            tokens.append(0.0)
        tokens[t] += len(s.completion_ids)
        of_sample.append(t)
    return Trajectories(rewards=torch.tensor(rewards, dtype=torch.float64),
                        group_index=torch.tensor(groups, dtype=torch.long),
                        tokens=torch.tensor(tokens, dtype=torch.float64),
                        of_sample=torch.tensor(of_sample, dtype=torch.long))


def assign_advantages(samples: Sequence[Sample], scale: str, baseline_min_count: int = 2,
                      single_cap: float | None = None) -> Trajectories | None:
    """Fill ``sample.advantage``: group statistics over *trajectories* (a trajectory of five turns counts once,
    like one of a single turn), and every turn of a trajectory gets its trajectory's advantage; a single response
    that carries a keyed baseline is scored against it (:func:`grpo.baseline_advantage`), its magnitude bounded by
    ``single_cap`` where advantages are scaled (a window of n equal rewards would allow sqrt(n + 1))."""
    if not samples:
        return None
    trajs = trajectories_of(samples)
    adv = group_advantages(trajs.rewards, trajs.group_index, scale)  # type: ignore[arg-type]
    for s, a in zip(samples, turn_advantages(adv, trajs.of_sample).tolist()):
        b = s.baseline
        if b is None:
            s.advantage = a
            continue
        single = baseline_advantage(s.reward, b.mean, b.std, b.count, scale,  # type: ignore[arg-type]
                                    baseline_min_count)
        if single_cap is not None and scale != "none":
            single = max(-single_cap, min(single_cap, single))
        s.advantage = single
    return trajs


def trajectory_advantages(samples: Sequence[Sample], trajs: Trajectories) -> torch.Tensor:
    """The advantage each trajectory trains with (group members and single responses alike), shape ``(N,)``."""
    out = torch.zeros(trajs.count, dtype=torch.float64)
    for s, t in zip(samples, trajs.of_sample.tolist()):
        out[t] = float(s.advantage)
    return out


@dataclass
class MicroBatch:
    """One micro-batch on the device, with what stays fixed over the ``num_iterations`` optimizer steps."""

    batch: Batch
    trajectory_tokens: torch.Tensor  # (b,) loss tokens of each row's trajectory over the whole step
    old_logprobs: torch.Tensor | None = None  # the batch-start policy's, set by the first pass
    behaviour: torch.Tensor | None = None  # recorded logprobs (rows without them: old_logprobs)
    ref_logprobs: torch.Tensor | None = None
    padding: bool = False  # sharded: a zero-weight pass that keeps this rank in step with the others


@dataclass
class PreparedStep:
    """A step's samples cut into micro-batches, with the step totals the loss is normalised by."""

    micro_batches: list[MicroBatch]
    total_tokens: float
    total_sequences: float
    total_trajectories: float
    trajectories: Trajectories
    samples: list[Sample] = field(default_factory=list)


@dataclass
class StepStats:
    """Figures of one learner step (reported as MetricEvents). Loss, KL, clip and IS figures and the gradient norm
    are means over the optimizer steps applied (the last attempt's when none was); reward and advantage figures are
    over trajectories."""

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
    entropy: float
    grad_norm: float
    learning_rate: float
    tokens: int
    sequences: int
    trajectories: int
    optimizer_steps: int
    nonfinite_skipped: int
    seconds: float
    rows_dropped_nonfinite: int = 0
    rows_without_logprobs: int = 0
    rows_without_logprobs_dropped: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def trained(self) -> bool:
        """True when at least one optimizer step changed the weights."""
        return self.optimizer_steps > 0

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
    "advantage_std": mn.LEARNER_ADVANTAGE_STD, "entropy": mn.LEARNER_ENTROPY, "grad_norm": mn.LEARNER_GRAD_NORM,
    "learning_rate": mn.LEARNER_LEARNING_RATE, "tokens": mn.LEARNER_TOKENS, "sequences": mn.LEARNER_SEQUENCES,
    "trajectories": mn.LEARNER_TRAJECTORIES, "optimizer_steps": mn.LEARNER_OPTIMIZER_STEPS,
    "nonfinite_skipped": mn.LEARNER_NONFINITE_SKIPPED, "rows_dropped_nonfinite": mn.LEARNER_ROWS_DROPPED_NONFINITE,
    "rows_without_logprobs": mn.LEARNER_ROWS_WITHOUT_LOGPROBS,
    "rows_without_logprobs_dropped": mn.LEARNER_ROWS_WITHOUT_LOGPROBS_DROPPED,
    "seconds": mn.LEARNER_SECONDS,
    "tokens_per_s": mn.LEARNER_TOKENS_PER_S,
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


def micro_batch_bounds(samples: Sequence[Sample], max_rows: int,
                       max_tokens: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` of each micro-batch, in order: at most ``max_rows`` rows, and with ``max_tokens``, at most
    that many padded tokens (rows x the longest prompt + completion); a row longer than the budget goes alone."""
    bounds: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, sample in enumerate(samples):
        length = len(sample.prompt_ids) + len(sample.completion_ids)
        rows = i - start
        over_tokens = max_tokens is not None and rows > 0 and (rows + 1) * max(longest, length) > max_tokens
        if rows >= max_rows or over_tokens:
            bounds.append((start, i))
            start, longest = i, 0
        longest = max(longest, length)
    if start < len(samples):
        bounds.append((start, len(samples)))
    return bounds


def _std(values: torch.Tensor) -> float:
    return float(values.std()) if values.numel() > 1 else 0.0


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused (one kernel over all parameters; TRL's default, ``adamw_torch_fused``) where the parameters'
    device and dtype support it, else the multi-tensor implementation. Same update and state either way."""
    fusable = {"cpu", "cuda", "mps", "xpu"}
    if params and all(p.device.type in fusable and p.is_floating_point() for p in params):
        try:
            return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
        except (RuntimeError, ValueError):  # a dtype/device combination this torch build does not fuse
            pass
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


class GRPOTrainerStep:
    """Owns the optimizer and scheduler of a :class:`Policy` and runs learner steps."""

    def __init__(self, policy: Policy, cfg: LearnerConfig, parallel: DataParallel | None = None) -> None:
        self.policy = policy
        self.cfg = cfg
        self.parallel = parallel  # data parallel: this rank's share of the micro-batches, gradients summed
        self.loss_cfg = loss_config(cfg)
        self.optimizer = adamw(list(policy.trainable_parameters()), cfg.learning_rate, cfg.weight_decay)
        total_optimizer_steps = cfg.total_steps * cfg.num_iterations
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total_optimizer_steps, cfg.lr_schedule))

    def prepare(self, samples: Sequence[Sample], every_micro_batch: bool = False) -> PreparedStep:
        """Cut ``samples`` (advantages assigned) into collated micro-batches on the device, with step totals (under
        data parallel only this rank's micro-batches, unless ``every_micro_batch``; sharded, every rank gets as many
        micro-batches as the busiest, the missing ones as zero-weight passes over the first micro-batch)."""
        trajs = trajectories_of(samples)
        row_traj_tokens = trajs.tokens[trajs.of_sample].to(torch.float32)
        micro = []
        bounds = micro_batch_bounds(samples, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens)

        def micro_batch(start: int, end: int, padding: bool = False) -> MicroBatch:
            batch = collate(samples[start:end], self.policy.pad_id).to(self.policy.device)
            return MicroBatch(batch, row_traj_tokens[start:end].to(self.policy.device), padding=padding)

        for index, (start, end) in enumerate(bounds):
            if self.parallel is not None and not every_micro_batch and not self.parallel.owns(index):
                continue  # another rank's micro-batch (the totals above and below are the whole step's)
            micro.append(micro_batch(start, end))
        if self.parallel is not None and self.parallel.sharded and not every_micro_batch:
            while len(micro) < self.parallel.rounds(len(bounds)):  # every forward/backward is a collective
                micro.append(micro_batch(*bounds[0], padding=True))
        return PreparedStep(micro_batches=micro, total_tokens=float(sum(len(s.completion_ids) for s in samples)),
                            total_sequences=float(len(samples)), total_trajectories=float(trajs.count),
                            trajectories=trajs, samples=list(samples))

    def entropy_stride(self, mask: torch.Tensor) -> int | None:
        """Every how many completion positions the entropy is measured so that about ``learner.entropy_positions``
        of a micro-batch's positions are (None: entropy off)."""
        wanted = self.cfg.entropy_positions
        if wanted <= 0:
            return None
        return max(1, math.ceil(mask.numel() / wanted))

    def accumulate(self, samples: Sequence[Sample] | PreparedStep) -> dict[str, float]:
        """Forward and backward of every micro-batch (gradients accumulate); returns loss figures.

        The first pass over a :class:`PreparedStep` records each micro-batch's logprobs as the batch-start
        policy's (``old_logprobs``; computed once, before any optimizer step of the batch), and the reference
        logprobs when ``beta > 0``; later passes reuse them, so the ratio measures how far the policy moved. The
        first pass also measures the batch-start policy's mean entropy over completion tokens (``entropy``), on a
        strided sample of about ``learner.entropy_positions`` positions per micro-batch.
        """
        prepared = samples if isinstance(samples, PreparedStep) else self.prepare(samples)
        policy, chunk = self.policy, self.cfg.logprob_chunk_size
        loss_sum, kl_sum, clip_sum, n_tok, entropy_sum, entropy_tok = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        first_pass = any(mb.old_logprobs is None for mb in prepared.micro_batches)
        is_vals: list[torch.Tensor] = []
        for mb in prepared.micro_batches:
            batch = mb.batch
            mask = batch.completion_mask
            stride = self.entropy_stride(mask) if mb.old_logprobs is None else None
            logprobs, entropy = completion_logprobs_and_entropy(policy.model, batch, chunk_size=chunk,
                                                                entropy_stride=stride)
            if entropy is not None and stride is not None and not mb.padding:
                sampled = mask[:, ::stride]
                entropy_sum += float((entropy * sampled).sum())
                entropy_tok += float(sampled.sum())
            if mb.old_logprobs is None:
                mb.old_logprobs = logprobs.detach()
                if batch.behaviour_logprobs is not None:
                    rows = behaviour_rows(batch).to(policy.device)
                    mb.behaviour = torch.where(rows[:, None], batch.behaviour_logprobs, mb.old_logprobs)
                if self.loss_cfg.beta > 0:
                    with torch.no_grad(), policy.reference_mode() as ref_model:
                        mb.ref_logprobs = completion_logprobs_and_entropy(ref_model, batch, chunk_size=chunk,
                                                                          entropy_stride=None)[0]
            parts = grpo_loss(logprobs, batch.advantages, mask, self.loss_cfg, old_logprobs=mb.old_logprobs,
                              behaviour_logprobs=mb.behaviour, ref_logprobs=mb.ref_logprobs,
                              total_tokens=prepared.total_tokens, total_sequences=prepared.total_sequences,
                              trajectory_tokens=mb.trajectory_tokens, total_trajectories=prepared.total_trajectories)
            if mb.padding:
                (parts.loss * 0.0).backward()  # the sharded collectives of a backward pass, no gradient
                continue
            parts.loss.backward()
            tokens = float(mask.sum())
            loss_sum += float(parts.loss.detach())
            if parts.kl is not None:
                kl_sum += masked_mean(parts.kl, mask) * tokens
            clip_sum += masked_mean(parts.clipped.float(), mask) * tokens
            n_tok += tokens
            if parts.is_weights is not None:
                is_vals.append(parts.is_weights[mask.bool()].float().cpu())
        is_all = torch.cat(is_vals) if is_vals else torch.zeros(0)
        is_sum, is_count = float(is_all.sum()), float(is_all.numel())
        is_min = float(is_all.min()) if is_count else math.inf
        is_max = float(is_all.max()) if is_count else -math.inf
        if self.parallel is not None:  # the whole step's gradient and figures, on every rank
            if not self.parallel.sharded:  # sharded: summed by FSDP's reduce-scatter in each backward pass
                self.parallel.sum_gradients(self.policy.trainable_parameters())
            loss_sum, kl_sum, clip_sum, n_tok, is_sum, is_count, entropy_sum, entropy_tok = self.parallel.sum(
                [loss_sum, kl_sum, clip_sum, n_tok, is_sum, is_count, entropy_sum, entropy_tok])
            is_min, is_max = self.parallel.extreme(is_min, "min"), self.parallel.extreme(is_max, "max")
        if not is_count:
            is_sum, is_count, is_min, is_max = 1.0, 1.0, 1.0, 1.0
        figures = {"entropy": entropy_sum / max(entropy_tok, 1.0)} if first_pass else {}
        return {**figures, "loss": loss_sum, "kl": kl_sum / max(n_tok, 1.0), "clip_fraction": clip_sum / max(n_tok, 1.0),
                "is_ratio_mean": is_sum / is_count, "is_ratio_min": is_min, "is_ratio_max": is_max, "tokens": n_tok}

    def optimizer_step(self, prepared: PreparedStep, iteration: int = 0) -> tuple[dict[str, float], bool]:
        """One optimizer step on ``prepared``: accumulate, clip, then step optimizer and scheduler, unless the
        loss or the gradient norm is not finite (then the gradients are dropped and nothing changes).

        Returns the figures (with ``grad_norm`` and ``learning_rate``) and whether the step was applied.
        """
        self.optimizer.zero_grad(set_to_none=True)
        figures = self.accumulate(prepared)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), self.cfg.max_grad_norm))
        figures["grad_norm"] = grad_norm
        figures["learning_rate"] = float(self.scheduler.get_last_lr()[0])
        if not (math.isfinite(figures["loss"]) and math.isfinite(grad_norm)):
            log.warning("non-finite loss or gradient: optimizer step skipped", loss=figures["loss"],
                        grad_norm=grad_norm, iteration=iteration, sequences=len(prepared.samples))
            self.optimizer.zero_grad(set_to_none=True)
            return figures, False
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return figures, True

    def nonfinite_rows(self, samples: Sequence[Sample]) -> list[int]:
        """Indices of the rows whose own loss or gradient is not finite, each row checked alone (a forward and
        backward per row: run only after a step's gradient came out non-finite). Under data parallel each rank checks
        the rows of its own micro-batches (sharded: every rank checks every row together, each its own shards of
        the gradient) and every rank returns the union."""
        bad = [0.0] * len(samples)
        bounds = micro_batch_bounds(samples, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens)
        params = self.policy.trainable_parameters()
        for index, (start, end) in enumerate(bounds):
            if self.parallel is not None and not self.parallel.sharded and not self.parallel.owns(index):
                continue
            for row in range(start, end):
                self.optimizer.zero_grad(set_to_none=True)
                alone = self.prepare([samples[row]], every_micro_batch=True)
                loss = self.accumulate_local(alone)
                finite = math.isfinite(loss) and all(bool(torch.isfinite(local_part(p.grad)).all()) for p in params
                                                     if p.grad is not None)
                bad[row] = 0.0 if finite else 1.0
        self.optimizer.zero_grad(set_to_none=True)
        if self.parallel is not None:
            bad = self.parallel.sum(bad)
        return [i for i, flag in enumerate(bad) if flag > 0]

    def accumulate_local(self, prepared: PreparedStep) -> float:
        """Forward and backward of ``prepared`` on this rank alone (no collective); returns the loss."""
        parallel, self.parallel = self.parallel, None
        try:
            return float(self.accumulate(prepared)["loss"])
        finally:
            self.parallel = parallel

    def step(self, samples: Sequence[Sample]) -> StepStats:
        """One learner step: trajectory-level advantages, then ``num_iterations`` optimizer steps on the same
        batch against the batch-start policy (stopping at the first non-finite loss or gradient).

        When the first optimizer step's loss or gradient is not finite, the rows that make it so are found (each
        checked alone), dropped and counted (``rows_dropped_nonfinite``), and the step runs on the others: one
        poisoned row (a turn sampled at a near-zero temperature, whose gradient scales with 1/T) no longer costs
        the whole step. Advantages stay those computed with every row.

        Rows marked not ``trainable`` (turns without behaviour logprobs beyond ``learner.max_lag_without_logprobs``,
        marked by the learner service) count in their group's statistics but are not trained; they are counted
        (``rows_without_logprobs_dropped``), as are all rows without behaviour logprobs (``rows_without_logprobs``)."""
        started = time.perf_counter()
        trajs = assign_advantages(samples, self.cfg.scale_rewards, self.cfg.baseline_min_count,
                                  self.cfg.single_advantage_cap)
        without_logprobs = sum(1 for s in samples if s.behaviour_logprobs is None)
        rows = [s for s in samples if s.trainable]
        applied: list[dict[str, float]] = []
        # the figures of a step none of whose rows may be trained (nothing changes)
        last: dict[str, float] = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "is_ratio_mean": 1.0,
                                  "is_ratio_min": 1.0, "is_ratio_max": 1.0, "grad_norm": 0.0, "tokens": 0.0,
                                  "learning_rate": float(self.scheduler.get_last_lr()[0])}
        skipped, dropped = 0, 0
        prepared = self.prepare(rows) if rows else None
        for iteration in range(self.cfg.num_iterations if prepared is not None else 0):
            assert prepared is not None
            last, ok = self.optimizer_step(prepared, iteration)
            if not ok and iteration == 0 and not dropped and len(rows) > 1:
                bad = self.nonfinite_rows(rows)
                if bad and len(bad) < len(rows):
                    log.warning("rows with a non-finite loss or gradient dropped from the step", rows=len(bad),
                                sequences=len(rows))
                    dropped = len(bad)
                    kept = [s for i, s in enumerate(rows) if i not in set(bad)]
                    prepared = self.prepare(kept)
                    last, ok = self.optimizer_step(prepared, iteration)
            if not ok:
                skipped += 1
                break
            applied.append(last)
        reported = applied or [last]

        def mean(key: str) -> float:
            return sum(f[key] for f in reported) / len(reported)

        rewards = trajs.rewards if trajs is not None else torch.zeros(1, dtype=torch.float64)
        adv = trajectory_advantages(samples, trajs) if trajs is not None else torch.zeros(1)
        return StepStats(
            loss=mean("loss"), kl=mean("kl"), clip_fraction=mean("clip_fraction"),
            is_ratio_mean=mean("is_ratio_mean"), is_ratio_min=min(f["is_ratio_min"] for f in reported),
            is_ratio_max=max(f["is_ratio_max"] for f in reported), reward_mean=float(rewards.mean()),
            reward_std=_std(rewards), advantage_mean=float(adv.mean()), advantage_std=_std(adv),
            entropy=float(reported[0].get("entropy", 0.0)),
            grad_norm=mean("grad_norm"), learning_rate=reported[0]["learning_rate"],
            tokens=int(reported[0]["tokens"]), sequences=len(rows),
            trajectories=trajs.count if trajs is not None else 0, optimizer_steps=len(applied),
            nonfinite_skipped=skipped, seconds=time.perf_counter() - started, rows_dropped_nonfinite=dropped,
            rows_without_logprobs=without_logprobs, rows_without_logprobs_dropped=len(samples) - len(rows))
