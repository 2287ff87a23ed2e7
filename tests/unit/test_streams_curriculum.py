"""The curriculum function: NAT's rule on hand-made epochs, and its online variant."""
from __future__ import annotations

import random

import pytest

from rlstream.schemas.config import CurriculumConfig
from rlstream.streams.curriculum import Candidate, CurriculumState, OnlineCurriculum, keep_count, percentile_schedule, select_groups


def cfg(**kw: object) -> CurriculumConfig:
    return CurriculumConfig(enabled=True, **kw)  # type: ignore[arg-type]


def epoch_groups(epoch: int, n: int = 10) -> list[Candidate[None]]:
    """n groups with distinct means 0.0 .. 0.9 (shuffled) and a spread of 0.5."""
    means = [i / 10 for i in range(n)]
    random.Random(epoch).shuffle(means)
    return [Candidate(f"e{epoch}-m{m:.1f}", (m - 0.25, m + 0.25)) for m in means]


def test_percentile_schedule_is_nat_default() -> None:
    sched = percentile_schedule(cfg(), 25)
    expected = [0.3] * 4 + [0.5] * 5 + [0.7] * 5 + [0.9] * 5 + [1.0] * 6
    assert sched == pytest.approx(expected)


def test_hand_made_epochs_keep_the_best_share_each_epoch() -> None:
    config, state = cfg(), CurriculumState.initial(cfg())
    kept_counts, percentiles = [], []
    for epoch in range(21):
        groups = epoch_groups(epoch)
        sel = select_groups(groups, state, epoch, config)
        state = sel.state
        kept_counts.append(len(sel.selected))
        percentiles.append(sel.percentile)
        # highest means first: the kept ones are exactly the top-k by mean, in descending order
        means = [c.mean for c in sel.selected]
        assert means == sorted(means, reverse=True)
        outside = [c.mean for c in groups if c.group_id not in sel.selected_ids]
        if outside:
            assert min(means) > max(outside)
    assert kept_counts == [3] * 4 + [5] * 5 + [7] * 5 + [9] * 5 + [10] * 2
    assert state == CurriculumState(percentile=1.0, last_expansion_epoch=19)


def test_min_reward_diff_is_strict() -> None:
    groups = [Candidate("exact", (0.0, 0.1)), Candidate("below", (0.0, 0.0999)), Candidate("wide", (0.0, 1.0))]
    sel = select_groups(groups, CurriculumState(percentile=1.0), 0, cfg(min_reward_diff=0.1))
    assert sel.selected_ids == {"exact", "wide"}
    assert sel.dropped_low_variance == ["below"]


def test_empty_after_filter_leaves_state_untouched() -> None:
    config = cfg()
    state = CurriculumState.initial(config)
    flat = [Candidate(f"f{i}", (0.5, 0.5)) for i in range(4)]
    sel = select_groups(flat, state, 4, config)  # epoch 4 would expand, but nothing survives the filter
    assert sel.selected == [] and sel.state == state
    sel = select_groups(epoch_groups(5), sel.state, 5, config)
    assert sel.state == CurriculumState(percentile=0.5, last_expansion_epoch=5)
    # the next expansion is counted from epoch 5, not 4
    assert select_groups(epoch_groups(9), sel.state, 9, config).percentile == pytest.approx(0.5)
    assert select_groups(epoch_groups(10), sel.state, 10, config).percentile == pytest.approx(0.7)


def test_sort_ascending_keeps_the_hardest_first() -> None:
    sel = select_groups(epoch_groups(0), CurriculumState.initial(cfg()), 0, cfg(sort_ascending=True))
    assert [round(c.mean, 1) for c in sel.selected] == [0.0, 0.1, 0.2]


def test_keep_count_rounding_and_floor_of_one() -> None:
    assert keep_count(10, 0.3) == 3  # 10 * 0.3 is 3.0000000000000004 in floating point
    assert keep_count(1, 0.3) == 1
    assert keep_count(3, 0.3) == 1
    assert keep_count(7, 0.5) == 4
    assert keep_count(10, 0.8999999999999999) == 9


def test_random_subsample_samples_down_from_the_kept() -> None:
    state = CurriculumState(percentile=1.0, last_expansion_epoch=0)
    groups = epoch_groups(0)
    sel = select_groups(groups, state, 1, cfg(random_subsample=0.4), rng=random.Random(7))
    assert len(sel.selected) == 4
    assert len(sel.dropped_by_subsample) == 6
    again = select_groups(groups, state, 1, cfg(random_subsample=0.4), rng=random.Random(7))
    assert again.selected_ids == sel.selected_ids
    # with a small percentile the subsample does not add groups back
    sel = select_groups(groups, CurriculumState(percentile=0.3), 0, cfg(random_subsample=0.5), rng=random.Random(1))
    assert len(sel.selected) == 3


def test_disabled_passes_everything() -> None:
    groups = [Candidate("flat", (1.0, 1.0)), Candidate("a", (0.0, 1.0))]
    sel = select_groups(groups, CurriculumState(percentile=0.3), 0, CurriculumConfig(enabled=False))
    assert sel.selected_ids == {"flat", "a"}


def test_online_window_and_growth_by_policy_version() -> None:
    config = cfg(expansion_interval=2, initial_percentile=0.5, increment_percentile=0.5)
    online = OnlineCurriculum.fresh(config, window=4)
    # version 0: percentile 0.5 over the window; a better group than all before is admitted
    admitted = [online.admit(f"g{i}", (0.0, r), 0)[0] for i, r in enumerate([0.2, 0.4, 0.6, 0.8])]
    assert admitted == [True, True, True, True]  # each new one is the best so far
    ok, sel = online.admit("low", (0.0, 0.3), 0)
    assert not ok and sel.window_size == 4 and [g for g, _ in online.recent] == ["g1", "g2", "g3", "low"]
    assert online.state.percentile == pytest.approx(0.5)
    ok, sel = online.admit("low2", (0.0, 0.25), 1)  # 1 - (-1) >= 2: grows to 1.0, everything passes
    assert ok and sel.percentile == pytest.approx(1.0)
    restored = OnlineCurriculum.from_dict(config, 4, online.to_dict())
    assert restored.state == online.state and restored.recent == online.recent
