"""Single responses scored against a keyed baseline: hand-computed leave-one-out windows and EMA, the assembler
emitting each rewarded single once with its baseline, the filter, the learner's advantage, and old group
records still decoding."""
from __future__ import annotations

import json
import math
import random
import uuid

import pytest

from rlstream.learner.batch import Sample
from rlstream.learner.grpo import baseline_advantage
from rlstream.learner.step import assign_advantages
from rlstream.schemas.codec import HISTORY_DIR, AvroCodec
from rlstream.schemas.config import StreamsConfig
from rlstream.schemas.models import GroupBaseline, TrajectoryGroup
from rlstream.streams.assembly import AssemblyRules, GroupAssembler, SourceRef
from rlstream.streams.baseline import BaselineRules, BaselineState, is_baseline, mean_and_std, score
from rlstream.streams.filters import ZERO_VARIANCE, apply_filters
from tests.support.factories import make_reward, make_trajectory

CODEC = AvroCodec()
REWARDS = [0.2, 0.8, 0.5, 0.9, 0.1]


def test_window_baseline_is_leave_one_out_and_bounded() -> None:
    state, rules = BaselineState(0), BaselineRules("window", window=3)
    seen = [score(state, r, "p|t", rules) for r in REWARDS]
    assert [b.count for b in seen] == [0, 1, 2, 3, 3]
    assert seen[1].mean == pytest.approx(0.2) and seen[1].std == 0.0
    assert seen[2].mean == pytest.approx(0.5) and seen[2].std == pytest.approx(math.sqrt(0.18))  # [0.2, 0.8]
    assert seen[3].mean == pytest.approx(0.5) and seen[3].std == pytest.approx(0.3)  # [0.2, 0.8, 0.5]
    assert seen[4].mean == pytest.approx((0.8 + 0.5 + 0.9) / 3)  # the window of 3 dropped 0.2
    assert state.rewards == pytest.approx([0.5, 0.9, 0.1])


def test_ema_baseline() -> None:
    state, rules = BaselineState(0), BaselineRules("ema", ema_alpha=0.5)
    first, second, third = (score(state, r, "k", rules) for r in (1.0, 0.0, 1.0))
    assert first.count == 0 and second.mean == 1.0 and second.std == 0.0 and second.count == 1
    # after 0.0: mean 1 + 0.5 * (0 - 1) = 0.5, var (1 - 0.5) * (0 + 0.5 * 1) = 0.25
    assert third.mean == pytest.approx(0.5) and third.std == pytest.approx(0.5) and third.method == "ema"


def single(task: str, reward: float | None, example: str = "req") -> object:
    """One production response: its own group (group_size 1), the task in its metadata."""
    t = make_trajectory(run_id="r", example_id=example, group_size=1, generation_index=0, reward=reward,
                        group_id=f"req-{uuid.uuid4().hex[:8]}")
    return t.model_copy(update={"metadata": {"task": task}})


def test_the_assembler_emits_each_rewarded_single_once_with_its_baseline() -> None:
    groups: dict = {}
    members: dict = {}
    assembler = GroupAssembler(groups, members, CODEC, AssemblyRules(group_timeout_s=5, min_group_size=2,
                                                                     single_timeout_s=3600))
    singles = [single("letters", None) for _ in REWARDS]
    for i, t in enumerate(singles):
        assembler.on_trajectory(t, CODEC.encode(t), b"req", SourceRef("T", 0, i), 0.0, now=0.0)
    # a tick past the group timeout does not expire singles: they wait reward_window_s for feedback
    assert not assembler.on_tick(0, now=60.0).rejects
    emitted = []
    for i, (t, r) in enumerate(zip(singles, REWARDS)):
        out = assembler.on_reward(make_reward(t, r), b"", b"req", SourceRef("R", 0, i), 0.0, now=61.0)
        emitted += [f.group for f in out.finished]
    other = single("other", 0.3)
    emitted += [f.group for f in assembler.on_trajectory(other, CODEC.encode(other), b"req", SourceRef("T", 0, 9),
                                                          0.0, now=62.0).finished]
    assert [len(g.trajectories) for g in emitted] == [1] * 6
    assert [g.baseline.count for g in emitted] == [0, 1, 2, 3, 4, 0]  # "other" is a key of its own
    assert emitted[4].baseline.mean == pytest.approx(0.6) and emitted[4].baseline.key.endswith("|letters")
    assert sum(1 for d in groups.values() if is_baseline(d)) == 2
    # a repeated reward is a duplicate, not a second group
    again = assembler.on_reward(make_reward(singles[0], 1.0), b"", b"req", SourceRef("R", 0, 99), 0.0, now=63.0)
    assert not again.finished and again.counts["duplicate_reward"] == 1


def test_filter_and_learner_use_the_baseline() -> None:
    config = StreamsConfig(min_reward_diff=0.05)
    base = CODEC.decode(CODEC.encode(make_trajectory(run_id="r", example_id="e", group_size=1, reward=0.9)),
                        type(make_trajectory(run_id="r", example_id="e", group_size=1)))
    group = TrajectoryGroup(group_id="g", run_id="r", example_id="e", policy="p", min_policy_version=0,
                            max_policy_version=0, expected_size=1, trajectories=[base], reward_mean=0.9,
                            reward_std=0.0, reward_min=0.9, reward_max=0.9,
                            baseline=GroupBaseline(key="p|t", method="window", mean=0.5, std=0.2, count=4))
    assert apply_filters(group, config, 0, {}, 0).reason is None  # one member, yet a signal
    first = group.model_copy(update={"baseline": group.baseline.model_copy(update={"count": 0})})
    assert apply_filters(first, config, 0, {}, 0).reason == ZERO_VARIANCE
    # one earlier reward: the learner (baseline_min_count 2) would give advantage 0, so it is not emitted
    second = group.model_copy(update={"baseline": group.baseline.model_copy(update={"count": 1})})
    assert apply_filters(second, config, 0, {}, 0, baseline_min_count=2).reason == ZERO_VARIANCE
    assert apply_filters(second, config, 0, {}, 0, baseline_min_count=1).reason is None  # control: it would train
    # scaled by the std of the window with the reward in it: (3 * 0.2^2 + 4/5 * 0.4^2) / 4 = 0.062
    with_reward = 0.4 / (math.sqrt(0.062) + 1e-4)
    assert baseline_advantage(0.9, 0.5, 0.2, 4) == pytest.approx(with_reward)
    assert baseline_advantage(0.9, 0.5, 0.2, 4, scale="none") == pytest.approx(0.4)
    assert baseline_advantage(0.9, 0.5, 0.2, 1) == 0.0  # below min_count
    samples = [Sample([1], [2], None, 0.9, 0, 0, baseline=group.baseline), Sample([1], [2], None, 0.3, 1, 0)]
    assign_advantages(samples, "group")
    assert samples[0].advantage == pytest.approx(with_reward) and samples[1].advantage == 0.0


def test_group_records_written_before_baselines_still_decode() -> None:
    old_schema = json.loads((HISTORY_DIR / "rlstream.v1.TrajectoryGroup.1.json").read_text())
    assert all(f["name"] != "baseline" for f in old_schema["fields"])
    record = CODEC.decode_record(CODEC.encode(make_group_like()), "rlstream.v1.TrajectoryGroup")
    record.pop("baseline")
    old_bytes = CODEC.encode_record(record, old_schema)
    decoded = CODEC.decode(old_bytes, TrajectoryGroup)
    assert decoded.baseline is None and decoded.group_id == "g-old"


def make_group_like() -> TrajectoryGroup:
    t = make_trajectory(run_id="r", example_id="e", group_size=1, reward=0.5)
    return TrajectoryGroup(group_id="g-old", run_id="r", example_id="e", policy="p", min_policy_version=0,
                           max_policy_version=0, expected_size=1, trajectories=[t], reward_mean=0.5, reward_std=0.0,
                           reward_min=0.5, reward_max=0.5)


# --- the advantage of a single against its keyed baseline (learner/grpo.py baseline_advantage) ------------------
def old_rule(reward: float, mean: float, std: float) -> float:
    """Dividing by the baseline's own std: what an equal-reward window turns into (r - mean) / 1e-4."""
    return (reward - mean) / (std + 1e-4)


def test_an_equal_reward_window_gives_a_bounded_advantage() -> None:
    # two thumbs-up, then a thumbs-down: window [1, 1] (mean 1, std 0, n 2), r = 0; the std of [1, 1, 0] is
    # sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    assert old_rule(0.0, 1.0, 0.0) == pytest.approx(-10_000)  # the unbounded rule it replaces
    assert baseline_advantage(0.0, 1.0, 0.0, 2) == pytest.approx(-1 / (math.sqrt(1 / 3) + 1e-4))  # -sqrt(3)
    assert baseline_advantage(1.0, 1.0, 0.0, 2) == 0.0  # agrees with the window: no signal
    # 64 equal rewards, then one differing by any amount: -sqrt(65) (the bound sqrt(n + 1)) up to eps, at any scale
    for gap in (1.0, 20.0, 1e6):
        assert baseline_advantage(0.5 - gap, 0.5, 0.0, 64) == pytest.approx(-math.sqrt(65), rel=1e-3)
    assert -math.sqrt(65) < baseline_advantage(0.499, 0.5, 0.0, 64) < 0  # a gap near eps: eps weighs in


def test_a_window_of_one() -> None:
    # window [1], r = 0: the std of [1, 0] is sqrt(1/2); min_count 2 (the default) gives 0 before two rewards
    assert baseline_advantage(0.0, 1.0, 0.0, 1, min_count=1) == pytest.approx(-1 / (math.sqrt(0.5) + 1e-4))
    assert baseline_advantage(0.0, 1.0, 0.0, 1) == 0.0
    assert baseline_advantage(0.0, 1.0, 0.0, 0, min_count=0) == 0.0  # nothing behind it: nothing to compare with
    assert baseline_advantage(math.nan, 1.0, 0.0, 5) == 0.0 and baseline_advantage(0.0, 1.0, math.inf, 5) == 0.0


def test_the_advantage_never_exceeds_sqrt_n_plus_one() -> None:
    rng = random.Random(7)
    for _ in range(1000):
        n = rng.randint(1, 70)
        scale = 10.0 ** rng.uniform(-6, 6)
        window = [rng.choice([0.0, 1.0, rng.gauss(0, 1)]) * scale for _ in range(n)]
        mean, std = mean_and_std(window)
        reward = rng.gauss(mean, scale * rng.choice([0.0, 1.0, 100.0]))
        a = baseline_advantage(reward, mean, std, n, min_count=1)
        assert math.isfinite(a) and abs(a) <= math.sqrt(n + 1) + 1e-9
        if std > 0:  # far from the degenerate case it stays close to the plain z-score's sign and size
            assert a * (reward - mean) >= 0


def test_a_single_after_equal_feedback_trains_with_a_bounded_advantage() -> None:
    """Through the assembler and the learner's advantage assignment: rewards 1, 1, then 0 for one key."""
    groups: dict = {}
    assembler = GroupAssembler(groups, {}, CODEC, AssemblyRules(group_timeout_s=5, min_group_size=2))
    emitted = []
    for i, r in enumerate([1.0, 1.0, 0.0]):
        t = single("thumbs", r)
        emitted += [f.group for f in assembler.on_trajectory(t, CODEC.encode(t), b"req", SourceRef("T", 0, i), 0.0,
                                                              now=0.0).finished]
    last = emitted[-1]
    assert (last.baseline.mean, last.baseline.std, last.baseline.count) == (1.0, 0.0, 2)
    samples = [Sample([1], [2], None, 0.0, 0, 0, baseline=last.baseline)]
    assign_advantages(samples, "group")
    assert samples[0].advantage == pytest.approx(-math.sqrt(3), rel=1e-3)


def test_the_ema_baseline_reports_its_equivalent_window() -> None:
    state, rules = BaselineState(0), BaselineRules("ema", ema_alpha=0.1)
    counts = [score(state, 0.5, "k", rules).count for _ in range(40)]
    assert counts[:20] == list(range(20)) and set(counts[19:]) == {19}  # 2 / 0.1 - 1
    assert state.count == 40
