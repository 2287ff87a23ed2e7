"""Parsing of replay positions and the replay filter."""
from __future__ import annotations

import pytest

from rlstream.ops.replay import ReplayError, ReplayFilter, parse_position, rewrite
from rlstream.schemas.models import TrajectorySource
from tests.support.factories import make_trajectory


def test_plain_offset_applies_to_all_partitions():
    assert parse_position("120").offset == 120


def test_partition_pairs():
    assert parse_position("0:12, 3:7").per_partition == {0: 12, 3: 7}
    with pytest.raises(ReplayError, match="named twice"):
        parse_position("1:2,1:3")


def test_iso_times_default_to_utc():
    zulu = parse_position("2026-05-01T12:00:00Z").timestamp_ms
    assert zulu == parse_position("2026-05-01T12:00:00").timestamp_ms == parse_position("2026-05-01T14:00:00+02:00").timestamp_ms
    assert zulu == 1777636800000


@pytest.mark.parametrize("bad", ["", "-3", "x:1", "yesterday", "1:2:3"])
def test_bad_positions_say_why(bad):
    with pytest.raises(ReplayError):
        parse_position(bad)


def test_filter():
    ev = make_trajectory(example_id="e1", policy_version=3)
    assert ReplayFilter().accepts(ev)
    assert ReplayFilter(sources=frozenset({"rollout"}), min_policy_version=3, max_policy_version=3).accepts(ev)
    assert not ReplayFilter(max_policy_version=2).accepts(ev)
    assert not ReplayFilter(example_ids=frozenset({"e2"})).accepts(ev)
    assert not ReplayFilter(run_ids=frozenset({"other"})).accepts(ev)
    with pytest.raises(ReplayError, match="unknown source"):
        ReplayFilter(sources=frozenset({"nope"}))


def test_rewrite_keeps_original_untouched():
    ev = make_trajectory(run_id="live", example_id="e1")
    copy = rewrite(ev, "new", "t.trajectories", 2, 17)
    assert ev.run_id == "live" and ev.source == TrajectorySource.rollout and "replay_of_offset" not in ev.metadata
    assert copy.run_id == "new" and copy.group_id == "new:live:e1" and copy.source == TrajectorySource.replay
    assert copy.metadata["replay_of_offset"] == "t.trajectories:2:17"
    assert rewrite(ev, "new", "t", 0, 0).trajectory_id == copy.trajectory_id  # deterministic


def test_a_replayed_held_out_answer_stays_validation_and_is_never_trained():
    answer = make_trajectory(run_id="live", example_id="heldout-1").model_copy(
        update={"source": TrajectorySource.validation})
    copy = rewrite(answer, "new", "t", 0, 0)
    assert copy.source == TrajectorySource.validation and copy.metadata["replay_of_source"] == "validation"
    # control: a rollout trajectory of the same example becomes a replay (trainable) copy
    assert rewrite(answer.model_copy(update={"source": TrajectorySource.rollout}), "new", "t", 0, 1).source == \
        TrajectorySource.replay
