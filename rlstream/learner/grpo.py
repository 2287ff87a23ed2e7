"""GRPO, one small function per concept (pure torch; no model, no Kafka).

Shapes: ``B`` sequences (one per trainable *turn*: one LLM call of the target), ``T`` completion positions,
``V`` the vocabulary; ``N`` trajectories (one agent run: one or more turns sharing one reward) and ``G`` groups
(the trajectories of one prompt). ``mask`` is 1 on the completion tokens that carry loss and 0 on padding.

References:
- GRPO: Shao et al. 2024, *DeepSeekMath* (arXiv:2402.03300): group-relative advantages, clipped objective.
- PPO: Schulman et al. 2017 (arXiv:1707.06347): the clipped surrogate and several epochs (``num_iterations``) per batch.
- DAPO: Yu et al. 2025 (arXiv:2503.14476): clip-higher (separate low/high epsilon) and the token-level mean.
- Dr. GRPO: Liu et al. 2025, *Understanding R1-Zero-Like Training* (arXiv:2503.20783): no std scaling, a constant
  normaliser instead of the sequence length.
- k3: Schulman 2020, *Approximating KL Divergence* (joschu.net/blog/kl-approx.html).
- Masked importance sampling (MIS: tokens whose ratio leaves a band get no loss): verl's rollout correction
  presets (token-level MIS); prime-rl masks off-policy tokens the same way.
- Truncated importance sampling against the sampler's logprobs: Yao et al. 2025, *Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training* (the fix TRL applies as ``vllm_importance_sampling_correction``).
- Decoupled PPO: Fu et al. 2025, *AReaL* (arXiv:2505.24298): the batch-start policy as the proximal policy of the
  clip and the importance weight proximal / behaviour for stale samples (``truncate`` with ``num_iterations`` > 1).
- Multi-turn: advantages per trajectory, not per turn (the turn-count bias of agent-lightning#444/#445).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch

ScaleRewards = Literal["none", "group", "batch"]
LossAggregation = Literal["token_mean", "sequence_mean", "trajectory_mean", "constant"]
LRSchedule = Literal["constant", "linear", "cosine"]
#: Added to the reward std before dividing (the value TRL uses, so that both agree).
STD_EPS = 1e-4
#: Tokens whose full-vocabulary log-softmax :func:`token_logprobs` holds in float32 at once.
DEFAULT_LOGPROB_CHUNK = 1024


def baseline_advantage(reward: float, mean: float, std: float, count: int, scale: ScaleRewards = "group",
                       min_count: int = 2, eps: float = STD_EPS) -> float:
    r"""
    Advantage of a single response (production traffic: one response per prompt) against the keyed baseline
    of the $n$ rewards that came before it: centred on their mean (leave-one-out, as RLOO, Ahmadian et al. 2024),
    scaled by the spread of those $n$ rewards *together with this one*, as GRPO scales by the std of the group the
    response belongs to (Shao et al. 2024):

    $$A = \frac{r - \bar r}{\tilde\sigma + \epsilon}, \qquad
      \tilde\sigma^2 = \frac{(n-1)\,\sigma^2 + \frac{n}{n+1}(r - \bar r)^2}{n}$$

    where $\bar r$, $\sigma$ (unbiased) and $n$ are the baseline's and $\tilde\sigma$ is the unbiased std of the
    $n + 1$ rewards. Dividing by the baseline's own $\sigma$ instead is unbounded: after $n$ equal rewards
    $\sigma = 0$ and a differing reward gets $(r - \bar r) / \epsilon$ (two thumbs-up then a thumbs-down: $-10^4$).
    With $\tilde\sigma$, $|A| \le \sqrt{n + 1}$ whatever the rewards, reached exactly when the window's rewards
    are equal (the GRPO counterpart: one differing answer in a group of $G$ equal ones gets $(G-1)/\sqrt{G}$; the
    leave-one-out centring is that group-mean centring times $(n+1)/n$). A reward equal to an equal-reward
    window's mean gets 0. Computed on values scaled by $\max(|r - \bar r|, \sigma)$, so nothing overflows.

    Hand-computed: window $[1, 1]$, $r = 0$: $\tilde\sigma^2 = (0 + \frac23) / 2 = \frac13$, $A = -\sqrt3
    \approx -1.732$; window $[1]$, $r = 0$ (with ``min_count`` 1): $\tilde\sigma^2 = \frac12$, $A = -\sqrt2$.

    Args:
        reward (`float`): the response's reward.
        mean (`float`), std (`float`), count (`int`): the baseline (never including this reward): mean, unbiased
            std and how many rewards are behind it ($n$; for an EMA, its equivalent window).
        scale (`str`, *optional*, defaults to `"group"`): `"none"` keeps $r - \bar r$ (Dr. GRPO); `"group"` and
            `"batch"` divide by $\tilde\sigma$ (a single response has no group of its own).
        min_count (`int`, *optional*, defaults to 2): fewer rewards behind the baseline give advantage 0 (so does
            an empty baseline, whatever ``min_count``).
        eps (`float`, *optional*, defaults to `1e-4`): added to $\tilde\sigma$.

    Returns:
        `float`: the advantage; 0 when an input is not finite.
    """
    if count < max(min_count, 1) or not all(math.isfinite(x) for x in (reward, mean, std)):
        return 0.0
    centred = reward - mean
    if scale == "none":
        return centred
    size = max(abs(centred), abs(std))
    if size == 0.0:
        return 0.0
    c, s, n = centred / size, abs(std) / size, float(count)
    pooled = math.sqrt(((n - 1.0) * s * s + n / (n + 1.0) * c * c) / n)
    return c / (pooled + eps / size)


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scale: ScaleRewards = "group",
                     eps: float = STD_EPS) -> torch.Tensor:
    r"""
    Group-relative advantage of each *trajectory* (GRPO, Shao et al. 2024; Dr. GRPO, Liu et al. 2025).

    $$A_i = \frac{r_i - \operatorname{mean}_{j \in g(i)} r_j}{\sigma + \epsilon}$$

    The statistics are over the trajectories of a group: one entry per trajectory, whatever its number of turns
    (give per-trajectory rewards here and spread the result over turns with :func:`turn_advantages`).

    Args:
        rewards (`torch.Tensor`):
            Reward of each trajectory, shape `(N,)`.
        group_index (`torch.Tensor`):
            Group of each trajectory, numbered `0..G-1`, shape `(N,)`, long.
        scale (`str`, *optional*, defaults to `"group"`):
            The $\sigma$: `"none"` (no division: Dr. GRPO), `"group"` (std of the trajectory's group) or `"batch"`
            (std of all `N` rewards). Stds are unbiased (n-1), 0 for a group of one.
        eps (`float`, *optional*, defaults to `1e-4`):
            Added to $\sigma$ (TRL's value).

    Returns:
        `torch.Tensor`: advantages, shape `(N,)`, float32.
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


def turn_advantages(trajectory_advantages: torch.Tensor, trajectory_index: torch.Tensor) -> torch.Tensor:
    r"""
    The advantage of each turn: its trajectory's, $A_b = A_{\tau(b)}$ (every turn of a trajectory shares it).

    Args:
        trajectory_advantages (`torch.Tensor`):
            Advantage of each trajectory (:func:`group_advantages`), shape `(N,)`.
        trajectory_index (`torch.Tensor`):
            Trajectory $\tau(b)$ of each turn, shape `(B,)`, long, values in `0..N-1`.

    Returns:
        `torch.Tensor`: advantages, shape `(B,)`.
    """
    return trajectory_advantages[trajectory_index]


class _SelectiveLogSoftmax(torch.autograd.Function):
    """``log_softmax(logits / T)[token]`` computed and differentiated one chunk of positions at a time.

    Saves only the logits (in their own dtype), the tokens and a float32 logsumexp per position; the backward pass
    recomputes each chunk's softmax, so no full-vocabulary float32 tensor of the whole batch ever exists. ``T`` is a
    float, or a float32 tensor with one temperature per row (the first dimension of ``tokens``).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor,
                chunk: int) -> torch.Tensor:
        out = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for block in _position_blocks(tuple(tokens.shape), chunk):
            x = _tempered(logits[block].float(), temperature, block)
            block_lse = torch.logsumexp(x, dim=-1)
            lse[block] = block_lse
            out[block] = x.gather(-1, tokens[block].unsqueeze(-1)).squeeze(-1) - block_lse
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        logits, tokens, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for block in _position_blocks(tuple(tokens.shape), ctx.chunk):
            x = _tempered(logits[block].float(), ctx.temperature, block)
            g_out = grad_out[block].unsqueeze(-1).float()
            # d/dx log softmax(x)[k] = onehot(k) - softmax(x); chain through x = logits / T
            g = torch.exp(x - lse[block].unsqueeze(-1)).mul_(g_out.neg())
            g.scatter_add_(-1, tokens[block].unsqueeze(-1), g_out)
            grad[block] = _tempered(g, ctx.temperature, block).to(grad.dtype)
        return grad, None, None, None


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                  chunk_size: int = DEFAULT_LOGPROB_CHUNK) -> torch.Tensor:
    r"""
    Entropy of the policy's next-token distribution at each position, chunked like :func:`token_logprobs`.

    $$H_t = -\sum_v \pi_v \log \pi_v = \operatorname{logsumexp}_v(x_{t,v}) - \sum_v \pi_v\, x_{t,v},
      \qquad x = z / \tau$$

    Collapsing entropy (the policy becoming deterministic before it is good) is the classic failure of GRPO-style
    training (DAPO, Yu et al. 2025, raises the upper clip for it); the learner reports the mean over completion
    tokens every step.

    Args:
        logits (`torch.Tensor`): shape `(B, T, V)`, any float dtype; may be a non-contiguous view.
        temperature (`float` or `torch.Tensor`, *optional*): as in :func:`token_logprobs` (one per row allowed).
        chunk_size (`int`, *optional*): positions per chunk.

    Returns:
        `torch.Tensor`: entropies in nats, shape `(B, T)`, float32, without gradient.
    """
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.detach().to(device=logits.device, dtype=torch.float32)
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    for block in _position_blocks(tuple(out.shape), chunk_size):
        x = _tempered(logits[block].float(), temperature, block)
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        out[block] = (lse.squeeze(-1) - (torch.exp(x - lse) * x).sum(-1))
    return out


def _tempered(x: torch.Tensor, temperature: float | torch.Tensor, block: tuple[Any, ...]) -> torch.Tensor:
    """``x / T`` for the positions of ``block`` (``T`` a float, or one temperature per row of the batch)."""
    if isinstance(temperature, torch.Tensor):
        t = temperature[block[0]]  # the block's rows: a slice of rows, or one row
        return x / t.view(-1, *([1] * (x.dim() - 1))) if t.dim() == 1 else x / t
    return x / temperature if temperature != 1.0 else x


def _position_blocks(shape: tuple[int, ...], chunk: int) -> Iterator[tuple[Any, ...]]:
    """Index tuples that cover a tensor of leading ``shape`` in blocks of at most ``chunk`` positions (blocks are
    basic slices: views, never copies, also of non-contiguous logits such as ``logits[:, -T-1:-1]``)."""
    if not shape:
        yield (Ellipsis,)
        return
    per_row = math.prod(shape[1:])
    if per_row <= chunk:
        rows = max(1, chunk // max(per_row, 1))
        for start in range(0, shape[0], rows):
            yield (slice(start, start + rows),)
        return
    per_col = math.prod(shape[2:])
    cols = max(1, chunk // max(per_col, 1))
    for row in range(shape[0]):
        for start in range(0, shape[1], cols):
            yield (row, slice(start, start + cols))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                   chunk_size: int = DEFAULT_LOGPROB_CHUNK) -> torch.Tensor:
    r"""
    Log-probability of each token, a chunked *selective* log-softmax.

    $$\log \pi(y_t) = z_{t, y_t} / \tau - \operatorname{logsumexp}_v (z_{t, v} / \tau)$$

    computed `chunk_size` positions at a time: the logsumexp of a chunk is taken in float32 and the token's logit
    gathered, so the float32 log-softmax of the whole batch, `(B, T, V)`, is never materialised (the backward
    pass recomputes each chunk's softmax from the saved logits). Equal to
    `torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None])[..., 0]`.

    Args:
        logits (`torch.Tensor`):
            Logits, shape `(B, T, V)` (any leading shape), any float dtype; may be a non-contiguous view.
        tokens (`torch.Tensor`):
            Token ids, shape `(B, T)` (the leading shape of `logits`), long.
        temperature (`float` or `torch.Tensor`, *optional*, defaults to `1.0`):
            The sampling temperature $\tau$ the logits are divided by (TRL divides by its one `temperature`): a
            float for every row, or one per row, shape `(B,)` (each turn at the temperature it was sampled at).
        chunk_size (`int`, *optional*, defaults to `1024`):
            Positions per chunk (peak extra memory about `2 * chunk_size * V * 4` bytes).

    Returns:
        `torch.Tensor`: log-probabilities, shape `(B, T)`, float32.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() != 1 or tokens.dim() < 1 or temperature.numel() != tokens.size(0):
            raise ValueError(f"one temperature per row: got shape {tuple(temperature.shape)} for tokens of shape "
                             f"{tuple(tokens.shape)}")
        temperature = temperature.detach().to(device=logits.device, dtype=torch.float32)
        if not bool((torch.isfinite(temperature) & (temperature > 0)).all()):
            raise ValueError(f"temperatures must be finite and > 0, got {temperature.tolist()}")
        if temperature.numel() and bool((temperature == temperature[0]).all()):
            temperature = float(temperature[0])  # one temperature for the batch: the plain path
    else:
        temperature = float(temperature)
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    return _SelectiveLogSoftmax.apply(logits, tokens, temperature, int(chunk_size))


def truncated_importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor | None,
                                 cap: float) -> torch.Tensor | None:
    r"""
    Truncated importance sampling weight of each token against the rollout's sampler (Yao et al. 2025).

    $$w_t = \min\left(\frac{\pi_{\theta_\text{old}}(y_t)}{\mu(y_t)}, C\right)$$

    where $\mu$ is the behaviour policy (the inference engine's recorded logprobs). No gradient.

    Args:
        old_logprobs (`torch.Tensor`):
            $\log \pi_{\theta_\text{old}}$, the batch-start policy, shape `(B, T)`.
        behaviour_logprobs (`torch.Tensor` or `None`):
            $\log \mu$, shape `(B, T)`; `None` for on-policy data.
        cap (`float`):
            The truncation $C$.

    Returns:
        `torch.Tensor` or `None`: weights, shape `(B, T)`; `None` when `behaviour_logprobs` is `None`.
    """
    if behaviour_logprobs is None:
        return None
    return torch.exp(old_logprobs.detach() - behaviour_logprobs).clamp(max=cap)


def masked_importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor | None, low: float,
                              high: float) -> torch.Tensor | None:
    r"""
    Masked importance sampling weight of each token against the rollout's sampler: the ratio where it lies in
    $[L, H]$, 0 elsewhere (token-level masked IS, "MIS", as verl's rollout correction presets do; prime-rl masks
    tokens the same way). Where truncation keeps a capped share of a token the current policy has
    moved far from, masking drops it from the loss.

    $$w_t = \frac{\pi_{\theta_\text{old}}(y_t)}{\mu(y_t)}\,\mathbb{1}\left[L \le
    \frac{\pi_{\theta_\text{old}}(y_t)}{\mu(y_t)} \le H\right]$$

    No gradient.

    Args:
        old_logprobs (`torch.Tensor`):
            $\log \pi_{\theta_\text{old}}$, the batch-start policy, shape `(B, T)`.
        behaviour_logprobs (`torch.Tensor` or `None`):
            $\log \mu$, shape `(B, T)`; `None` for on-policy data.
        low (`float`):
            $L$, the smallest ratio kept (0 keeps every token the current policy finds less likely).
        high (`float`):
            $H$, the largest ratio kept.

    Returns:
        `torch.Tensor` or `None`: weights, shape `(B, T)`; `None` when `behaviour_logprobs` is `None`.
    """
    if behaviour_logprobs is None:
        return None
    ratio = torch.exp(old_logprobs.detach() - behaviour_logprobs)
    return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))


def sequence_importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor | None,
                                mask: torch.Tensor, cap: float) -> torch.Tensor | None:
    r"""
    Sequence-level importance weight of each turn against the rollout's sampler: GSPO's length-normalised ratio
    (Zheng et al. 2025, "Group Sequence Policy Optimization"), the geometric mean of the turn's token ratios,
    truncated, and shared by every token of the turn.

    $$w_b = \min\left(\exp\left(\frac{1}{|y_b|} \sum_t m_{bt}
    \left(\log\pi_{\theta_\text{old}}(y_{bt}) - \log\mu(y_{bt})\right)\right), C\right)$$

    A token-level weight follows each token's own drift (high variance when the behaviour policy is several versions
    old); the sequence weight averages the log-ratios of the turn first. No gradient. Hand-computed: two tokens with
    $\log\pi_{\theta_\text{old}} - \log\mu = \log 4$ and $0$: weight $\exp(\log 4 / 2) = 2$ on both (token-level:
    4 capped to $C$, and 1).

    Args:
        old_logprobs (`torch.Tensor`):
            $\log \pi_{\theta_\text{old}}$, the batch-start policy, shape `(B, T)`.
        behaviour_logprobs (`torch.Tensor` or `None`):
            $\log \mu$, shape `(B, T)`; `None` for on-policy data.
        mask (`torch.Tensor`):
            $m$, the turn's completion tokens, shape `(B, T)`.
        cap (`float`):
            The truncation $C$.

    Returns:
        `torch.Tensor` or `None`: weights, shape `(B, T)` (one value per row); `None` when `behaviour_logprobs` is
        `None`.
    """
    if behaviour_logprobs is None:
        return None
    m = mask.to(old_logprobs.dtype)
    mean_log_ratio = ((old_logprobs.detach() - behaviour_logprobs) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return torch.exp(mean_log_ratio).clamp(max=cap).unsqueeze(-1).expand_as(old_logprobs)


def policy_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    r"""
    Probability ratio of each token between the current and the batch-start policy (PPO).

    $$\rho_t(\theta) = \frac{\pi_\theta(y_t)}{\pi_{\theta_\text{old}}(y_t)} = \exp(\log\pi_\theta - \log\pi_{\theta_\text{old}})$$

    1 in value at the first of `num_iterations` optimizer steps, with the gradient of `logprobs`.

    Args:
        logprobs (`torch.Tensor`):
            $\log \pi_\theta$, shape `(B, T)`, with gradient.
        old_logprobs (`torch.Tensor`):
            $\log \pi_{\theta_\text{old}}$, shape `(B, T)` (detached here).

    Returns:
        `torch.Tensor`: ratios, shape `(B, T)`.
    """
    return torch.exp(logprobs - old_logprobs.detach())


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                      eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    PPO's clipped objective as a per-token loss, with DAPO's separate clip bounds (clip-higher).

    $$\ell_t = -\min\left(\rho_t A,\ \operatorname{clip}(\rho_t, 1 - \epsilon_\text{low}, 1 + \epsilon_\text{high}) A\right)$$

    Args:
        ratio (`torch.Tensor`):
            $\rho_t$ (:func:`policy_ratio`), shape `(B, T)`.
        advantages (`torch.Tensor`):
            $A$, shape `(B,)` (one per turn) or `(B, T)`.
        eps_low (`float`):
            $\epsilon_\text{low}$.
        eps_high (`float`):
            $\epsilon_\text{high}$.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: the per-token loss `(B, T)`, and the mask `(B, T)` of tokens where the
        clipped term was the one taken (the clip was active: no gradient flows through them).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.min(unclipped, clipped)
    active = (clipped < unclipped).detach()
    return loss, active


def cispo_loss(logprobs: torch.Tensor, advantages: torch.Tensor, behaviour_logprobs: torch.Tensor | None,
               cap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""
    CISPO's per-token loss (MiniMax-M1, 2025): REINFORCE with a clipped, detached importance weight.

    $$\ell_t = -\operatorname{sg}\left(\min\left(\frac{\pi_\theta(y_t)}{\mu(y_t)}, C\right)\right) A \log \pi_\theta(y_t)$$

    PPO's clip zeroes the gradient of a token whose ratio left the trust region; CISPO clips the *weight* instead,
    so every token keeps a (bounded) gradient $\min(\rho_t, C) A \nabla \log \pi_\theta(y_t)$, which is the
    importance-corrected policy gradient with the weight truncated at $C$. $\mu$ is the behaviour policy (the
    recorded logprobs); without them the weight is 1 (on-policy). Hand-computed: $\log\pi = \log 0.5$,
    $\log\mu = \log 0.25$, $C = 2$, $A = 1$: weight 2, loss $-2\log 0.5 = 1.386$, gradient in $\log\pi$: $-2$.

    Args:
        logprobs (`torch.Tensor`): $\log\pi_\theta$, shape `(B, T)`, with gradient.
        advantages (`torch.Tensor`): $A$, shape `(B,)` or `(B, T)`.
        behaviour_logprobs (`torch.Tensor` or `None`): $\log\mu$, shape `(B, T)`.
        cap (`float`): $C$ (``learner.importance_cap``).

    Returns:
        `tuple`: the per-token loss `(B, T)`, the mask of tokens whose weight was clipped, and the weights (detached).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    current = logprobs.detach()
    raw = torch.ones_like(current) if behaviour_logprobs is None else torch.exp(current - behaviour_logprobs)
    weights = raw.clamp(max=cap)
    return -(weights * adv) * logprobs, (raw > cap), weights


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    r"""
    Schulman's k3 estimator of $\mathrm{KL}(\pi_\theta \,\|\, \pi_\text{ref})$ per token (always >= 0).

    $$k_3 = \exp(\log\pi_\text{ref} - \log\pi_\theta) - (\log\pi_\text{ref} - \log\pi_\theta) - 1$$

    Args:
        logprobs (`torch.Tensor`):
            $\log \pi_\theta$, shape `(B, T)`.
        ref_logprobs (`torch.Tensor`):
            $\log \pi_\text{ref}$, shape `(B, T)`.

    Returns:
        `torch.Tensor`: the estimate, shape `(B, T)`.
    """
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: LossAggregation = "token_mean", *,
                   constant: float = 1024.0, total_tokens: float | None = None,
                   total_sequences: float | None = None, trajectory_tokens: torch.Tensor | None = None,
                   total_trajectories: float | None = None) -> torch.Tensor:
    r"""
    Reduce a per-token loss to the scalar that is differentiated.

    With $m$ the mask, $b$ a turn (row), $\tau(b)$ its trajectory and $|\cdot|$ counts of loss tokens:

    - `"token_mean"` (DAPO; TRL's `"bnpo"`): $\sum_{b,t} \ell m / \sum_{b,t} m$: every token weighs the same.
    - `"sequence_mean"` (GRPO; TRL's `"grpo"`): $\frac{1}{B} \sum_b \frac{\sum_t \ell m}{|b|}$: every turn weighs the same.
    - `"trajectory_mean"`: $\frac{1}{N} \sum_b \frac{\sum_t \ell m}{|\tau(b)|}$: each trajectory's token mean over all of
      its turns, averaged over trajectories; every trajectory weighs the same, however many turns (LLM calls) it has.
    - `"constant"` (Dr. GRPO; TRL's `"dr_grpo"`): $\sum_{b,t} \ell m / (B \cdot L)$ with the constant $L$.

    With gradient accumulation pass the whole step's totals, so that the micro-batch losses add up to the loss of
    the full batch.

    Args:
        per_token (`torch.Tensor`):
            $\ell$, shape `(B, T)`.
        mask (`torch.Tensor`):
            $m$, shape `(B, T)`.
        mode (`str`, *optional*, defaults to `"token_mean"`):
            One of the four above.
        constant (`float`, *optional*, defaults to `1024.0`):
            $L$ of `"constant"`.
        total_tokens (`float`, *optional*):
            `"token_mean"`: loss tokens of the whole step (default: of this batch).
        total_sequences (`float`, *optional*):
            `"sequence_mean"`, `"constant"`: turns of the whole step (default: `B`).
        trajectory_tokens (`torch.Tensor`, *optional*):
            `"trajectory_mean"`: $|\tau(b)|$ for each row, the loss tokens of its trajectory over the whole step,
            shape `(B,)` (default: each row is a trajectory of its own).
        total_trajectories (`float`, *optional*):
            `"trajectory_mean"`: $N$ of the whole step (default: the trajectories this batch holds entirely,
            $\sum_b |b| / |\tau(b)|$).

    Returns:
        `torch.Tensor`: the loss, a scalar.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        denom = total_tokens if total_tokens is not None else mask.sum().clamp(min=1.0)
        return (per_token * mask).sum() / denom
    if mode == "sequence_mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        denom = total_sequences if total_sequences is not None else per_token.size(0)
        return per_seq.sum() / denom
    if mode == "trajectory_mean":
        row_tokens = mask.sum(-1)
        traj_tokens = (row_tokens if trajectory_tokens is None
                       else trajectory_tokens.to(per_token.dtype)).clamp(min=1.0)
        n_traj = total_trajectories if total_trajectories is not None else (row_tokens / traj_tokens).sum()
        return ((per_token * mask).sum(-1) / traj_tokens).sum() / n_traj
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
    #: ``"truncate"``: :func:`truncated_importance_weights` at ``importance_cap``; ``"mask"``:
    #: :func:`masked_importance_weights` keeping ratios in [``importance_mask_low``, ``importance_cap``];
    #: ``"cispo"``: :func:`cispo_loss` (no PPO clip; clipped, detached weights against the behaviour policy);
    #: ``"sequence"``: :func:`sequence_importance_weights` at ``importance_cap`` (one weight per turn)
    importance_correction: Literal["truncate", "mask", "cispo", "sequence"] = "truncate"
    importance_mask_low: float = 0.5
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
              total_sequences: float | None = None, trajectory_tokens: torch.Tensor | None = None,
              total_trajectories: float | None = None) -> LossParts:
    r"""
    The GRPO loss of one (micro-)batch: clipped surrogate x IS weight (truncated, masked with
    ``cfg.importance_correction="mask"``, or one per turn with ``"sequence"``; ``"cispo"`` replaces the surrogate
    with :func:`cispo_loss`) + beta * k3 KL, aggregated.

    $$\ell_t = -\min\left(\rho_t A, \operatorname{clip}(\rho_t, 1-\epsilon_\text{low}, 1+\epsilon_\text{high}) A\right) w_t
    + \beta\, k_3, \qquad \mathcal{L} = \operatorname{aggregate}(\ell, m)$$

    Args:
        logprobs (`torch.Tensor`):
            $\log\pi_\theta$, shape `(B, T)`, with gradient.
        advantages (`torch.Tensor`):
            Per turn, shape `(B,)` (:func:`turn_advantages`).
        mask (`torch.Tensor`):
            Loss mask, shape `(B, T)`.
        cfg (`LossConfig`):
            Clip bounds, IS cap, beta, aggregation.
        old_logprobs (`torch.Tensor`, *optional*):
            $\log\pi_{\theta_\text{old}}$ of the batch-start policy, shape `(B, T)`; defaults to the detached
            `logprobs` (right for the first optimizer step of a batch only).
        behaviour_logprobs (`torch.Tensor`, *optional*):
            The rollout sampler's logprobs, shape `(B, T)`, for truncated importance sampling.
        ref_logprobs (`torch.Tensor`, *optional*):
            $\log\pi_\text{ref}$, shape `(B, T)`; needed when `cfg.beta > 0`.
        total_tokens, total_sequences, trajectory_tokens, total_trajectories:
            Step totals for :func:`aggregate_loss`.

    Returns:
        `LossParts`: the loss and its detached parts.
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = policy_ratio(logprobs, old)
    weights: torch.Tensor | None
    if cfg.importance_correction == "cispo":  # the weight is inside the loss, and no PPO clip
        per_token, clipped, weights = cispo_loss(logprobs, advantages, behaviour_logprobs, cfg.importance_cap)
    else:
        per_token, clipped = clipped_surrogate(ratio, advantages, cfg.epsilon_low, cfg.epsilon_high)
        if cfg.importance_correction == "mask":
            weights = masked_importance_weights(old, behaviour_logprobs, cfg.importance_mask_low,
                                                cfg.importance_cap)
        elif cfg.importance_correction == "sequence":
            weights = sequence_importance_weights(old, behaviour_logprobs, mask, cfg.importance_cap)
        else:
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
                          total_sequences=total_sequences, trajectory_tokens=trajectory_tokens,
                          total_trajectories=total_trajectories)
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
