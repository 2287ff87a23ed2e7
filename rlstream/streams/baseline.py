"""Keyed baselines for single responses: production traffic is one response per request, not N generations of
one prompt, so a trajectory with ``group_size == 1`` is scored against the rewards that came before it for the
same key ``(policy, task)`` (task: the trajectory's ``metadata["task"]``, the gateway's ``X-Rlstream-Task``
header; default the policy).

* ``window`` (default): the mean and sample std of the last ``baseline_window`` rewards of the key. The scored
  reward is not in its own baseline (leave-one-out); it joins the window afterwards.
* ``ema``: an exponential moving mean and variance (``baseline_ema_alpha``), updated after scoring.

Each partition keeps its own baseline per key (in the changelog-backed group table), as the curriculum keeps its
window: records of one key spread over partitions by example id, so each partition sees a sample of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rlstream.schemas.models import GroupBaseline, TrajectoryEvent

BASELINE_MARK = "baseline"
Method = Literal["window", "ema"]


@dataclass(frozen=True)
class BaselineRules:
    method: Method = "window"
    window: int = 64
    ema_alpha: float = 0.1


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


def sample_std(values: list[float]) -> float:
    """Unbiased (n-1) standard deviation, as the group advantages use; 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def score(state: BaselineState, reward: float, key: str, rules: BaselineRules) -> GroupBaseline:
    """The baseline ``reward`` is scored against (what came before it), then ``reward`` joins ``state``."""
    if rules.method == "ema":
        baseline = GroupBaseline(key=key, method="ema", mean=state.ema_mean, std=math.sqrt(max(state.ema_var, 0.0)),
                                 count=state.count)
        if state.count == 0:
            state.ema_mean, state.ema_var = reward, 0.0
        else:
            diff = reward - state.ema_mean
            state.ema_mean += rules.ema_alpha * diff
            state.ema_var = (1.0 - rules.ema_alpha) * (state.ema_var + rules.ema_alpha * diff * diff)
        state.count += 1
        return baseline
    window = state.rewards
    baseline = GroupBaseline(key=key, method="window", mean=sum(window) / len(window) if window else 0.0,
                             std=sample_std(window), count=len(window))
    window.append(reward)
    del window[:-rules.window]
    state.count = len(window)
    return baseline
