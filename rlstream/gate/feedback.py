"""What the gate reads of user feedback: per-version online reward statistics (canaries) and the
feedback-to-serving latency.

**Online rewards** (:class:`OnlineRewards`). While a canary runs the gate joins ``trajectories`` (each carries the
``policy_version`` that answered) with ``rewards`` (feedback by ``trajectory_id``) from the canary's start, for the
canary and the serving version only. A trajectory that carries its reward counts at once; a reward whose trajectory
is not read yet waits (bounded); a repeated reward of a trajectory replaces the earlier one (a correction). This is
read from the topics rather than from ``groups`` because the staleness filter drops the serving version's groups once
the learner moved on, which would starve the serving arm. Only rewards that pass the reward rules every reader of
``rewards`` applies (rlstream/schemas/rewards.py: finite, inside ``streams.reward_range``) reach it: the gate leaves
the others out and counts them (``invalid``, ``gate/invalid_rewards``). Its arms' statistics are saved in Redis
(:meth:`OnlineRewards.state`, transport/serving.py's ``CanaryState``) and read back by a restarted gate
(:meth:`OnlineRewards.resumed`); trajectories answered before the restart whose feedback comes after it are not
counted (their versions are not kept).

**Feedback-to-serving latency** (:class:`FeedbackClock`). For each rewarded trajectory that was trained: the time
from its feedback's arrival (the ``created_at`` of its first RewardEvent; the trajectory's own ``created_at`` when
the reward came with the trajectory) to the moment a version trained on it serves on every alive replica (the
serving pointer's ``moved_at``: the pointer moves only once every alive replica acknowledged the version). A
trajectory trained into version k serves when the serving pointer first reaches a version >= k (versions train on
top of each other). Which trajectories version k trained on comes from its ``trained_on`` ranges of ``groups``.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime

from rlstream.gate.sequential import RewardStats
from rlstream.schemas.models import RewardEvent, TrajectoryEvent, TrajectorySource, TrajectoryGroup
from rlstream.transport.serving import ArmStats

#: Rewards kept while their trajectory is not read yet, and trajectory ids remembered, at most.
MAX_PENDING = 100_000


@dataclass
class OnlineRewards:
    """Reward statistics of the canary and the serving version from ``since`` on (see the module docstring)."""

    canary_version: int
    serving_version: int
    since: datetime
    canary: RewardStats = field(default_factory=RewardStats)
    serving: RewardStats = field(default_factory=RewardStats)
    invalid: int = 0  # rewards left out by the reward rules while the canary ran
    _version_of: dict[str, int] = field(default_factory=dict)
    _reward_of: dict[str, float] = field(default_factory=dict)
    _waiting: "OrderedDict[str, float]" = field(default_factory=OrderedDict)

    def _arm(self, version: int) -> RewardStats:
        return self.canary if version == self.canary_version else self.serving

    def _record(self, trajectory_id: str, reward: float) -> None:
        arm = self._arm(self._version_of[trajectory_id])
        if trajectory_id in self._reward_of:
            arm.remove(self._reward_of[trajectory_id])
        self._reward_of[trajectory_id] = reward
        arm.add(reward)

    def on_trajectory(self, event: TrajectoryEvent, policy: str) -> None:
        if event.policy != policy or event.policy_version not in (self.canary_version, self.serving_version):
            return
        if event.source == TrajectorySource.validation:  # held-out answers (the gate's own): not online traffic
            return
        if event.created_at < self.since or event.trajectory_id in self._version_of:
            return
        self._version_of[event.trajectory_id] = event.policy_version
        waiting = self._waiting.pop(event.trajectory_id, None)
        if event.reward is not None:
            self._record(event.trajectory_id, event.reward)
        if waiting is not None:
            self._record(event.trajectory_id, waiting)

    def on_reward(self, event: RewardEvent) -> None:
        if event.trajectory_id in self._version_of:
            self._record(event.trajectory_id, event.reward)
            return
        self._waiting[event.trajectory_id] = event.reward
        self._waiting.move_to_end(event.trajectory_id)
        while len(self._waiting) > MAX_PENDING:
            self._waiting.popitem(last=False)

    def figures(self) -> dict[str, float]:
        return {"canary_reward_mean": self.canary.mean, "canary_rewards": float(self.canary.count),
                "serving_reward_mean": self.serving.mean, "serving_rewards": float(self.serving.count),
                "invalid_rewards": float(self.invalid)}

    def state(self) -> tuple[ArmStats, ArmStats]:
        """(canary, serving) arm statistics, as saved in Redis."""
        return (ArmStats(self.canary.count, self.canary.mean, self.canary.m2),
                ArmStats(self.serving.count, self.serving.mean, self.serving.m2))

    @classmethod
    def resumed(cls, canary_version: int, serving_version: int, since: datetime, canary: ArmStats,
                serving: ArmStats, invalid: int = 0) -> "OnlineRewards":
        """The statistics a saved canary state holds, to go on from."""
        return cls(canary_version, serving_version, since, RewardStats(canary.count, canary.mean, canary.m2),
                   RewardStats(serving.count, serving.mean, serving.m2), invalid)


@dataclass(frozen=True)
class TrainedTrajectory:
    """A rewarded trajectory a version trained on: its id, and its own creation time when the reward came with it."""

    trajectory_id: str
    inline_reward_at: float | None


def trained_trajectories(group: TrajectoryGroup) -> list[TrainedTrajectory]:
    """The rewarded members of a trained group."""
    out = []
    for member in group.trajectories:
        if member.reward is None:
            continue
        inline = member.source != TrajectorySource.production  # production rewards come as feedback events
        out.append(TrainedTrajectory(member.trajectory_id, member.created_at.timestamp() if inline else None))
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted values, by linear interpolation."""
    if not sorted_values:
        return float("nan")
    pos = q * (len(sorted_values) - 1)
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


@dataclass
class FeedbackClock:
    """Feedback arrival times and the trajectories of versions not serving yet (see the module docstring)."""

    arrivals: "OrderedDict[str, float]" = field(default_factory=OrderedDict)
    pending: dict[int, list[TrainedTrajectory]] = field(default_factory=dict)
    samples: list[float] = field(default_factory=list)  # sorted
    unresolved: int = 0
    served_version: int = -1

    def on_reward(self, event: RewardEvent) -> None:
        """The first feedback of a trajectory sets its arrival (a correction does not)."""
        if event.trajectory_id not in self.arrivals:
            self.arrivals[event.trajectory_id] = event.created_at.timestamp()
            while len(self.arrivals) > MAX_PENDING * 10:
                self.arrivals.popitem(last=False)

    def on_version(self, version: int, trajectories: list[TrainedTrajectory]) -> None:
        """Version ``version`` trained on ``trajectories``; they wait until a version >= it serves."""
        if version > self.served_version:
            self.pending.setdefault(version, []).extend(trajectories)

    def on_serving(self, version: int, moved_at: float) -> list[float]:
        """Serving reached ``version`` at ``moved_at`` (every alive replica had it): the new latency samples."""
        new: list[float] = []
        if version <= self.served_version:
            return new
        self.served_version = version
        for trained in sorted(v for v in self.pending if v <= version):
            for item in self.pending.pop(trained):
                arrived = self.arrivals.get(item.trajectory_id, item.inline_reward_at)
                if arrived is None:
                    self.unresolved += 1
                    continue
                new.append(max(0.0, moved_at - arrived))
        for value in new:
            bisect.insort(self.samples, value)
        return new

    @property
    def waiting(self) -> int:
        """Trained trajectories whose version (or a later one) does not serve yet."""
        return sum(len(items) for items in self.pending.values())

    def quantiles(self) -> tuple[float, float]:
        """(p50, p90) of every sample so far (NaN before the first)."""
        return percentile(self.samples, 0.5), percentile(self.samples, 0.9)
