"""Keyed baselines for single responses: production traffic is one response per request, not N generations of
one prompt, so a trajectory with ``group_size == 1`` is scored against the rewards that came before it for the
same key ``(policy, task)`` (task: the trajectory's ``metadata["task"]``, the gateway's ``X-Rlstream-Task``
header; default the policy).

* ``window`` (default): the mean and sample std of the last ``baseline_window`` rewards of the key. The scored
  reward is not in its own baseline (leave-one-out); it joins the window afterwards.
* ``ema``: an exponential moving mean and variance (``baseline_ema_alpha``), updated after scoring.

Each partition keeps its own baseline per key (in the changelog-backed group table), as the curriculum keeps its
window: records of one key spread over partitions by example id, so each partition sees a sample of them.

What a baseline reports is ``(mean, std, count)``; the learner turns it into an advantage with
:func:`rlstream.learner.grpo.baseline_advantage`, which divides by the spread of the window *together with* the
scored reward, so an equal-reward window cannot blow the advantage up. ``count`` is the window's length, or for
the EMA its equivalent window ``min(rewards seen, 2 / alpha - 1)``, the length of a window whose mean is as noisy.

No reward can freeze a key: only finite rewards inside ``streams.reward_range`` are scored (the stream dead-letters
the others before they get here, :func:`score` refuses them without touching the state), the spread is computed
without squaring raw values (:func:`mean_and_std`: no overflow for any finite input), and a stored state is read
leniently (:meth:`BaselineState.from_stored`: values a state must not hold are dropped, an unreadable state
starts afresh), so even a state written before these rules scores the next reward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rlstream.schemas.models import GroupBaseline, TrajectoryEvent
from rlstream.streams.validation import DEFAULT_REWARD_RANGE, RewardRange
from rlstream.transport.log import get_logger

log = get_logger(__name__)

BASELINE_MARK = "baseline"
Method = Literal["window", "ema"]


@dataclass(frozen=True)
class BaselineRules:
    method: Method = "window"
    window: int = 64
    ema_alpha: float = 0.1
    reward_range: RewardRange = DEFAULT_REWARD_RANGE  # streams.reward_range: the rewards a baseline may hold

    def ema_equivalent_window(self) -> int:
        """The window whose mean is as noisy as this EMA's: ``2 / alpha - 1`` (alpha 0.1: 19; alpha 1: 1)."""
        return max(1, round(2.0 / self.ema_alpha - 1.0))


def task_of(event: TrajectoryEvent) -> str:
    return event.metadata.get("task") or event.policy


def baseline_key(policy: str, task: str) -> str:
    return f"{policy}|{task}"


def table_key(partition: int, key: str) -> str:
    """The group-table key of a partition's baseline for ``key`` (never a group id: it starts with a mark)."""
    return f"{BASELINE_MARK}|{partition}|{key}"


def is_baseline(data: Any) -> bool:
    return isinstance(data, dict) and data.get("kind") == BASELINE_MARK


@dataclass
class BaselineState:
    """The rewards behind one key's baseline in one partition."""

    partition: int
    rewards: list[float] = field(default_factory=list)  # window: the last K, oldest first
    ema_mean: float = 0.0
    ema_var: float = 0.0
    count: int = 0  # rewards seen (ema) / held (window)

    def to_json(self) -> dict[str, Any]:
        return {"kind": BASELINE_MARK, "p": self.partition, "rw": list(self.rewards), "m": self.ema_mean,
                "v": self.ema_var, "n": self.count}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BaselineState":
        return cls(partition=int(data["p"]), rewards=[float(r) for r in data.get("rw", [])],
                   ema_mean=float(data.get("m", 0.0)), ema_var=float(data.get("v", 0.0)), count=int(data.get("n", 0)))

    @classmethod
    def from_stored(cls, data: Any, partition: int, rules: BaselineRules, key: str = "") -> "BaselineState":
        """The stored state of a key, made usable: window rewards that are not finite or outside the reward range
        are dropped and a non-finite EMA starts again (a changelog may hold what an older version let in), and a
        state that cannot be read at all is replaced by an empty one. Never raises: a key must never freeze."""
        if not is_baseline(data):
            return cls(partition)
        try:
            state = cls.from_json(data)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            log.warning("unreadable baseline state replaced by an empty one", key=key, error=str(exc))
            return cls(partition)
        kept = [r for r in state.rewards if rules.reward_range.admits(r)]
        ema_ok = math.isfinite(state.ema_mean) and math.isfinite(state.ema_var) and state.ema_var >= 0
        if len(kept) != len(state.rewards) or not ema_ok or state.count < 0:
            log.warning("baseline state held values outside the reward range; dropped", key=key,
                        dropped=len(state.rewards) - len(kept), ema_reset=not ema_ok)
            state.rewards = kept
            if not ema_ok or state.count < 0:
                state.ema_mean, state.ema_var, state.count = 0.0, 0.0, 0
            if rules.method == "window":
                state.count = len(kept)
        return state


def mean_and_std(values: list[float], ddof: int = 1) -> tuple[float, float]:
    """Mean and standard deviation (``ddof`` 1: unbiased, as the group advantages use; 0: population) of finite
    values, without overflow for any of them: Welford's update over the values divided by the largest magnitude,
    scaled back at the end, so no raw value is ever squared (``(1e200 - m) ** 2`` overflows). The std is 0 for
    ``len(values) <= ddof``; the mean of no values is 0."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    scale = max(abs(v) for v in values)
    if scale == 0.0:
        return 0.0, 0.0
    mean = m2 = 0.0
    for i, v in enumerate(values, start=1):
        x = v / scale
        delta = x - mean
        mean += delta / i
        m2 += delta * (x - mean)
    std = math.sqrt(max(m2, 0.0) / (n - ddof)) * scale if n > ddof else 0.0
    return mean * scale, std


def sample_std(values: list[float]) -> float:
    """Unbiased (n-1) standard deviation, as the group advantages use; 0 for fewer than two values."""
    return mean_and_std(values, ddof=1)[1]


def score(state: BaselineState, reward: float, key: str, rules: BaselineRules) -> GroupBaseline:
    """The baseline ``reward`` is scored against (what came before it), then ``reward`` joins ``state``.

    Raises ``ValueError`` for a reward that is not finite or outside ``rules.reward_range``, leaving ``state`` as
    it was (the stream rejects such rewards before they get here)."""
    if not rules.reward_range.admits(reward):
        raise ValueError(f"reward {reward} is not a finite number in {rules.reward_range}; not scored")
    if rules.method == "ema":
        baseline = GroupBaseline(key=key, method="ema", mean=state.ema_mean, std=math.sqrt(max(state.ema_var, 0.0)),
                                 count=min(state.count, rules.ema_equivalent_window()))
        if state.count == 0:
            state.ema_mean, state.ema_var = reward, 0.0
        else:
            diff = reward - state.ema_mean  # at most the range's width: its square stays finite
            state.ema_mean += rules.ema_alpha * diff
            state.ema_var = (1.0 - rules.ema_alpha) * (state.ema_var + rules.ema_alpha * diff * diff)
        state.count += 1
        return baseline
    window = state.rewards
    mean, std = mean_and_std(window)
    baseline = GroupBaseline(key=key, method="window", mean=mean, std=std, count=len(window))
    window.append(reward)
    del window[:-rules.window]
    state.count = len(window)
    return baseline
