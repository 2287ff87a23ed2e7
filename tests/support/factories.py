"""Builders of realistic events for tests (trajectories come from the benchmarks' workload, bench/workload.py)."""
from __future__ import annotations

import uuid

from bench.workload import make_trajectory
from rlstream.schemas.models import RewardEvent, TrajectoryEvent

__all__ = ["make_reward", "make_trajectory", "new_uuid"]


def make_reward(trajectory: TrajectoryEvent, reward: float) -> RewardEvent:
    return RewardEvent(trajectory_id=trajectory.trajectory_id, group_id=trajectory.group_id,
                       example_id=trajectory.example_id, run_id=trajectory.run_id, reward=reward)


def new_uuid() -> str:
    return str(uuid.uuid4())
