"""No reward can freeze a (policy, task) key: rewards outside ``streams.reward_range`` or not finite are rejected
with their reason, the baseline's spread never overflows, and a stored baseline state that holds what an older
version let in is made usable again (negative controls: the two-pass variance overflows, the old state froze)."""
from __future__ import annotations

import math
import statistics
import uuid
from typing import Any

import pytest

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import StreamsConfig
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from rlstream.streams import validation as v
from rlstream.streams.assembly import AssemblyRules, GroupAssembler, SourceRef, group_stats
from rlstream.streams.baseline import (BASELINE_MARK, BaselineRules, BaselineState, baseline_key, mean_and_std,
                                       score, table_key)
from tests.support.factories import make_reward, make_trajectory

CODEC = AvroCodec()
RANGE = v.DEFAULT_REWARD_RANGE


def two_pass_sample_std(values: list[float]) -> float:
    """The textbook two-pass formula the baseline used: squares raw deviations."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1))


def test_the_default_range_is_the_config_default() -> None:
    assert (RANGE.low, RANGE.high) == StreamsConfig().reward_range


@pytest.mark.parametrize("reward, components, reason", [
    (1e200, {}, v.REWARD_OUT_OF_RANGE),
    (-1e200, {}, v.REWARD_OUT_OF_RANGE),
    (10.5, {}, v.REWARD_OUT_OF_RANGE),
    (math.nan, {}, v.NON_FINITE_REWARD),
    (-math.inf, {}, v.NON_FINITE_REWARD),
    (0.5, {"judge": 1e200}, v.REWARD_OUT_OF_RANGE),
    (0.5, {"judge": math.nan}, v.NON_FINITE_REWARD),
    (10.0, {"judge": -10.0}, None),  # the bounds are inside
])
def test_rewards_and_components_outside_the_range_are_rejected(reward: float, components: dict[str, float],
                                                               reason: str | None) -> None:
    t = make_trajectory(reward=None)
    event = make_reward(t, reward).model_copy(update={"components": components})
    invalid = v.validate_reward(event, RANGE)
    assert (invalid.reason if invalid else None) == reason
    inline = make_trajectory(reward=reward).model_copy(update={"reward_components": components})
    invalid = v.validate_trajectory(inline, reward_range=RANGE)
    assert (invalid.reason if invalid else None) == reason


def test_the_range_is_configurable() -> None:
    event = make_reward(make_trajectory(reward=None), 500.0)
    assert v.validate_reward(event, RANGE).reason == v.REWARD_OUT_OF_RANGE  # type: ignore[union-attr]
    assert v.validate_reward(event, v.RewardRange(-1e3, 1e3)) is None
    with pytest.raises(ValueError, match="reward_range"):
        StreamsConfig(reward_range=(1.0, -1.0))
    with pytest.raises(ValueError, match="reward_range"):
        StreamsConfig(reward_range=(-math.inf, 1.0))


def test_the_spread_never_overflows() -> None:
    huge = [0.5, 1e200]
    with pytest.raises(OverflowError):  # negative control: what froze a key
        two_pass_sample_std(huge)
    mean, std = mean_and_std(huge)
    assert mean == pytest.approx(5e199) and std == pytest.approx(statistics.stdev(huge))
    for values in ([1.7e308, -1.7e308, 1e308], [-1e200, 1e200], [3.0, 3.0, 3.0], [0.2, 0.8, 0.5]):
        m, s = mean_and_std(values)
        assert math.isfinite(m) and (math.isfinite(s) or max(map(abs, values)) > 1e307)
        if max(map(abs, values)) < 1e100:
            assert m == pytest.approx(statistics.fmean(values)) and s == pytest.approx(statistics.stdev(values))
    assert mean_and_std([]) == (0.0, 0.0) and mean_and_std([4.0]) == (4.0, 0.0)
    assert group_stats([1e200, -1e200])[1] == pytest.approx(1e200)  # population std, no OverflowError


def test_score_refuses_a_reward_outside_the_range_and_leaves_the_state_as_it_was() -> None:
    state, rules = BaselineState(0, rewards=[0.2, 0.8], count=2), BaselineRules("window", window=4)
    for bad in (1e200, -1e200, math.nan, 11.0):
        with pytest.raises(ValueError, match="not scored"):
            score(state, bad, "p|t", rules)
    assert state.rewards == [0.2, 0.8] and state.count == 2
    assert score(state, 0.5, "p|t", rules).mean == pytest.approx(0.5)


def single(task: str, example: str = "req") -> TrajectoryEvent:
    t = make_trajectory(run_id="r", example_id=example, group_size=1, reward=None, group_id=f"req-{uuid.uuid4().hex[:8]}")
    return t.model_copy(update={"metadata": {"task": task}})


def poisoned_key(groups: dict[str, Any], stored: dict[str, Any], task: str = "frozen") -> str:
    key = baseline_key("policy", task)
    groups[table_key(0, key)] = stored
    return key


@pytest.mark.parametrize("stored, mean, count", [
    # a window the old code stored once 1e200 had passed validation (every later reward of the key then raised)
    ({"kind": BASELINE_MARK, "p": 0, "rw": [0.2, 1e200, 0.6], "m": 0.0, "v": 0.0, "n": 3}, 0.4, 2),
    ({"kind": BASELINE_MARK, "p": 0, "rw": [0.2, "inf", -1e300], "m": 0.0, "v": 0.0, "n": 3}, 0.2, 1),
    ({"kind": BASELINE_MARK, "p": 0, "rw": "not a list of numbers", "n": "x"}, 0.0, 0),  # unreadable: afresh
])
def test_a_stored_baseline_that_froze_its_key_scores_the_next_reward(stored: dict[str, Any], mean: float,
                                                                     count: int) -> None:
    try:  # negative control: the old reading and spread of this state raise or give no usable number
        old = two_pass_sample_std([float(r) for r in stored["rw"]])
    except (OverflowError, ValueError, TypeError):
        old = math.nan
    assert not math.isfinite(old)
    groups: dict[str, Any] = {}
    key = poisoned_key(groups, stored)
    assembler = GroupAssembler(groups, {}, CODEC, AssemblyRules(group_timeout_s=5, min_group_size=2))
    t = single("frozen")
    assembler.on_trajectory(t, CODEC.encode(t), b"req", SourceRef("T", 0, 1), 0.0, now=0.0)
    out = assembler.on_reward(make_reward(t, 0.9), b"", b"req", SourceRef("R", 0, 1), 0.0, now=1.0)
    assert not out.rejects and len(out.finished) == 1
    baseline = out.finished[0].group.baseline
    assert baseline is not None and baseline.count == count and baseline.mean == pytest.approx(mean)
    healed = groups[table_key(0, key)]["rw"]
    assert all(RANGE.admits(r) for r in healed) and healed[-1] == 0.9


def test_a_non_finite_ema_starts_again() -> None:
    rules = BaselineRules("ema", ema_alpha=0.5)
    stored = {"kind": BASELINE_MARK, "p": 0, "rw": [], "m": 1e200, "v": math.inf, "n": 7}
    state = BaselineState.from_stored(stored, 0, rules)
    assert (state.ema_mean, state.ema_var, state.count) == (0.0, 0.0, 0)
    assert score(state, 0.4, "k", rules).count == 0 and state.ema_mean == 0.4


def test_a_reward_event_outside_the_range_is_refused_by_the_codec_path_too() -> None:
    """Encoded as a foreign producer would, the event still decodes; validation is what refuses it."""
    event = RewardEvent(trajectory_id="t", group_id="g", example_id="e", reward=1e200)
    decoded = v.decode_event(CODEC, CODEC.encode(event), RewardEvent)
    assert isinstance(decoded, RewardEvent)
    assert v.validate_reward(decoded, RANGE).reason == v.REWARD_OUT_OF_RANGE  # type: ignore[union-attr]
