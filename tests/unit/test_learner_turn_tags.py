"""Each turn's recorded policy version and sampling temperature reach its training sample: the version that
decides staleness and the temperature its logprobs are computed at."""
from __future__ import annotations

import pytest

from rlstream.learner.batch import BatchError, behaviour_version, collate, samples_from_groups, samples_from_trajectory
from tests.support.learner_helpers import random_group


def test_turn_version_and_temperature_reach_the_samples() -> None:
    group = random_group("p", "r", 0)
    for t in group.trajectories:
        t.policy_version = 5
    group = group.model_copy(update={"min_policy_version": 5, "max_policy_version": 5})
    group.trajectories[0].turns[0].policy_version = 4
    group.trajectories[0].turns[0].temperature = 0.7
    group.trajectories[1].turns[0].temperature = 0.0  # greedy: no sampling distribution, trained at 1.0
    samples = samples_from_groups([group], None, ["<workflow>"], None)
    assert [s.policy_version for s in samples] == [4, 5, 5, 5]  # untagged turns: their trajectory's version
    assert [s.temperature for s in samples] == [0.7, 1.0, 1.0, 1.0]
    assert collate(samples, 0).temperatures.tolist() == pytest.approx([0.7, 1.0, 1.0, 1.0])
    assert behaviour_version(group, samples) == 4  # the oldest turn decides, not the trajectories' 5
    assert behaviour_version(group, []) == 5  # nothing to train: the group's oldest member


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf")])
def test_a_bad_recorded_temperature_is_a_batch_error(bad: float) -> None:
    trajectory = random_group("p", "r", 0).trajectories[0]
    trajectory.turns[0].temperature = bad
    with pytest.raises(BatchError, match="temperature"):
        samples_from_trajectory(trajectory, 0, None, ["<workflow>"], None)
