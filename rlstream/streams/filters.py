"""Filters on finished groups, in DESIGN.md's order: staleness, zero variance, curriculum.

Pure: the caller supplies the latest policy version (and the serving one, under a promotion gate) and a mapping that keeps the online
curriculum's state (a changelog-backed table in the app, a dict in tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, MutableMapping

from rlstream.schemas.config import StreamsConfig
from rlstream.schemas.models import CurriculumInfo, TrajectoryGroup
from rlstream.streams.curriculum import OnlineCurriculum
from rlstream.transport.serving import staleness_reference

STALE = "stale"
ZERO_VARIANCE = "zero_variance"
CURRICULUM = "curriculum"
FILTER_REASONS = (STALE, ZERO_VARIANCE, CURRICULUM)


@dataclass(frozen=True)
class Verdict:
    """``reason`` is None when the group passes; ``group`` carries the curriculum info when it does."""

    group: TrajectoryGroup
    reason: str | None
    detail: str = ""


def is_stale(group: TrajectoryGroup, latest_version: int | None, max_policy_lag: int) -> bool:
    """Older than ``latest - max_policy_lag`` (the group's oldest member decides)."""
    return latest_version is not None and group.min_policy_version < latest_version - max_policy_lag


def is_zero_variance(group: TrajectoryGroup, min_reward_diff: float) -> bool:
    return group.reward_max - group.reward_min < min_reward_diff


def curriculum_key(partition: int, policy: str) -> str:
    """One curriculum window per policy within a partition (policies never compete for one window)."""
    return f"curriculum:{partition}:{policy}"


def apply_filters(group: TrajectoryGroup, config: StreamsConfig, latest_version: int | None,
                  curriculum_store: MutableMapping[str, Any], partition: int,
                  member_rewards: list[float] | None = None, serving_version: int | None = None,
                  baseline_min_count: int = 1) -> Verdict:
    """Run the three filters; the first one that rejects names the reason. ``member_rewards`` (default: the rewards
    of ``group.trajectories``) are given when the group comes without its members (streams.assembly.Finished).
    ``serving_version``: the version a promotion gate lets serve, if any (staleness is then judged against it where
    it is behind the latest, :func:`rlstream.transport.serving.staleness_reference`). ``baseline_min_count``: the
    learner's ``learner.baseline_min_count``; a single response with fewer earlier rewards behind its baseline would
    train with advantage 0, so it is filtered here (counted) instead of being emitted."""
    reference = staleness_reference(latest_version, serving_version)
    if is_stale(group, reference, config.max_policy_lag):
        against = "latest" if reference == latest_version else "serving"
        return Verdict(group, STALE, f"min policy version {group.min_policy_version} < {against} {reference} "
                                     f"- max_policy_lag {config.max_policy_lag}")
    if group.baseline is not None:  # a single response: its signal is its distance from the keyed baseline
        if group.baseline.count == 0:
            return Verdict(group, ZERO_VARIANCE, f"no earlier reward for baseline key {group.baseline.key!r} yet "
                                                 "(this reward starts it)")
        if group.baseline.count < baseline_min_count:
            return Verdict(group, ZERO_VARIANCE, f"{group.baseline.count} earlier reward(s) for baseline key "
                                                 f"{group.baseline.key!r}, fewer than learner.baseline_min_count "
                                                 f"{baseline_min_count} (it would train with advantage 0)")
        if abs(group.reward_mean - group.baseline.mean) < config.min_reward_diff:
            return Verdict(group, ZERO_VARIANCE, f"reward {group.reward_mean:.4g} within {config.min_reward_diff} "
                                                 f"of its baseline {group.baseline.mean:.4g}")
    elif is_zero_variance(group, config.min_reward_diff):
        return Verdict(group, ZERO_VARIANCE, f"reward spread {group.reward_max - group.reward_min:.4g} < "
                                             f"{config.min_reward_diff}")
    if not config.curriculum.enabled:
        return Verdict(group, None)
    key = curriculum_key(partition, group.policy)
    online = OnlineCurriculum.from_dict(config.curriculum, config.curriculum_window, curriculum_store.get(key))
    epoch = latest_version if latest_version is not None else group.max_policy_version
    rewards = member_rewards if member_rewards is not None else [t.reward or 0.0 for t in group.trajectories]
    admitted, selection = online.admit(group.group_id, rewards, epoch)
    curriculum_store[key] = online.to_dict()
    rank = selection.ranks.get(group.group_id, -1)
    info = CurriculumInfo(window=epoch, rank=rank, percentile=selection.percentile,
                          window_size=selection.window_size)
    if not admitted:
        return Verdict(group, CURRICULUM, f"rank {rank} of {len(selection.ranks)} outside percentile "
                                          f"{selection.percentile}")
    return Verdict(group.model_copy(update={"curriculum": info}), None)
