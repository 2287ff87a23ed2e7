"""Trajectory-level GRPO: group statistics over trajectories (not turns), every turn of a trajectory shares its
advantage, and the ``trajectory_mean`` loss aggregation weighs trajectories, not turns."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlstream.learner.batch import Sample, samples_from_groups
from rlstream.learner.grpo import aggregate_loss, turn_advantages
from rlstream.learner.policy import load_policy
from rlstream.learner.step import GRPOTrainerStep, assign_advantages, micro_batch_bounds, trajectories_of
from rlstream.schemas.config import LearnerConfig, LoraConfig
from rlstream.schemas.models import Message, TrajectoryEvent, TrajectoryGroup, Turn
from tests.support.learner_helpers import tiny_model

EPS = 1e-4


def _trajectory(tid: str, reward: float, turns: int, index: int) -> TrajectoryEvent:
    """An agent run of ``turns`` LLM calls (token ids recorded), all trainable."""
    messages = [Message(role="user", content="q")]
    recorded = []
    for k in range(turns):
        messages += [Message(role="assistant", content=f"a{k}"), Message(role="user", content=f"tool {k}")]
        recorded.append(Turn(message_index=2 * k + 1, function="<workflow>", prompt_token_ids=[5, 6, 7 + k],
                             completion_token_ids=[20 + k, 30 + k, 40 + k][: 1 + (k % 3)]))
    return TrajectoryEvent(trajectory_id=tid, run_id="r", example_id="e", group_id="g", group_size=2,
                           generation_index=index, policy="p", policy_version=0, messages=messages[:-1],
                           turns=recorded, reward=reward, target="<workflow>")


def _group(gid: str, trajectories: list[TrajectoryEvent]) -> TrajectoryGroup:
    rewards = [float(t.reward) for t in trajectories]  # type: ignore[arg-type]
    return TrajectoryGroup(group_id=gid, run_id="r", example_id=gid, policy="p", min_policy_version=0,
                           max_policy_version=0, expected_size=len(trajectories), trajectories=trajectories,
                           reward_mean=sum(rewards) / len(rewards), reward_std=0.0, reward_min=min(rewards),
                           reward_max=max(rewards))


def test_advantages_of_a_mixed_length_group_by_hand() -> None:
    # group 0: trajectory A has five turns (reward 1), trajectory B one turn (reward 0)
    # group 1: three single-turn trajectories, rewards 0, 1, 2
    g0 = _group("g0", [_trajectory("A", 1.0, 5, 0), _trajectory("B", 0.0, 1, 1)])
    g1 = _group("g1", [_trajectory(f"C{i}", float(i), 1, i) for i in range(3)])
    samples = samples_from_groups([g0, g1], None, ["<workflow>"], None)
    assert [s.trajectory for s in samples] == ["A"] * 5 + ["B", "C0", "C1", "C2"]

    assign_advantages(samples, "group")
    # trajectory statistics: group 0 has two entries (mean 0.5, std sqrt(0.5)), not six turns (mean 5/6)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert [s.advantage for s in samples[:6]] == pytest.approx([a] * 5 + [-a], rel=1e-6)
    assert [s.advantage for s in samples[6:]] == pytest.approx([-1 / (1 + EPS), 0.0, 1 / (1 + EPS)], rel=1e-6)

    assign_advantages(samples, "none")
    assert [s.advantage for s in samples] == pytest.approx([0.5] * 5 + [-0.5, -1.0, 0.0, 1.0])

    assign_advantages(samples, "batch")  # the std of the five trajectory rewards 1, 0, 0, 1, 2 (not of nine turns)
    std = math.sqrt(sum((r - 0.8) ** 2 for r in [1, 0, 0, 1, 2]) / 4)
    assert [s.advantage for s in samples] == pytest.approx(
        [v / (std + EPS) for v in [0.5] * 5 + [-0.5, -1.0, 0.0, 1.0]], rel=1e-6)

    trajs = trajectories_of(samples)
    assert trajs.count == 5 and trajs.group_index.tolist() == [0, 0, 1, 1, 1]
    assert trajs.tokens.tolist() == [1 + 2 + 3 + 1 + 2, 1, 1, 1, 1]
    assert trajs.of_sample.tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4]


def test_samples_without_trajectory_ids_stay_one_trajectory_each() -> None:
    from tests.support.learner_helpers import random_samples

    samples = random_samples(groups=2, per_group=3, seed=4)
    trajs = trajectories_of(samples)
    assert trajs.count == 6 and trajs.of_sample.tolist() == list(range(6))
    assert turn_advantages(torch.tensor([1.0, -1.0]), torch.tensor([0, 0, 1])).tolist() == [1.0, 1.0, -1.0]


def test_trajectory_mean_weighs_trajectories_by_hand() -> None:
    # rows 0-2: three turns of trajectory A (4 loss tokens in all); row 3: trajectory B (1 token)
    per_token = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 0.0], [7.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]])
    traj_tokens = torch.tensor([4.0, 4.0, 4.0, 1.0])
    full = aggregate_loss(per_token, mask, "trajectory_mean", trajectory_tokens=traj_tokens)
    assert full.item() == pytest.approx(((1 + 2 + 3 + 5) / 4 + 7 / 1) / 2)
    # turn-weighted for contrast: A's three turns count three times
    assert aggregate_loss(per_token, mask, "sequence_mean").item() == pytest.approx((1.5 + 3 + 5 + 7) / 4)
    # micro-batches with the step totals add up to the full batch
    halves = sum(aggregate_loss(per_token[i:i + 2], mask[i:i + 2], "trajectory_mean",
                                trajectory_tokens=traj_tokens[i:i + 2], total_trajectories=2.0) for i in (0, 2))
    assert float(halves) == pytest.approx(full.item())
    # without trajectory information every row is a trajectory: the sequence mean
    assert aggregate_loss(per_token, mask, "trajectory_mean").item() == pytest.approx((1.5 + 3 + 5 + 7) / 4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("traj"))


def test_micro_batch_bounds_keep_rows_and_token_budget() -> None:
    def sample(n: int) -> Sample:
        return Sample(prompt_ids=[1] * n, completion_ids=[2] * n, behaviour_logprobs=None, reward=0.0, group=0,
                      policy_version=0)

    lengths = [4, 4, 4, 30, 4, 4]  # prompt + completion = 8, 8, 8, 60, 8, 8 tokens
    samples = [sample(n) for n in lengths]
    assert micro_batch_bounds(samples, 4) == [(0, 4), (4, 6)]
    bounds = micro_batch_bounds(samples, 8, max_tokens=24)
    assert bounds == [(0, 3), (3, 4), (4, 6)]  # the 60-token turn goes alone
    for start, end in bounds:
        longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples[start:end])
        assert (end - start) * longest <= 24 or end - start == 1
    assert micro_batch_bounds([], 4, 10) == []


#: the same step cut four ways: one turn per micro-batch, all at once, by a token budget, and all at once with
#: gradient checkpointing; the loss and the gradients must not change
SPLITS = [{"micro_batch_size": 1}, {"micro_batch_size": 16}, {"micro_batch_size": 16, "micro_batch_tokens": 40},
          {"micro_batch_size": 16, "gradient_checkpointing": True}]


def test_trajectory_mean_gradients_do_not_depend_on_micro_batching(model_dir: Path) -> None:
    groups = [_group("g0", [_trajectory("A", 1.0, 4, 0), _trajectory("B", 0.0, 1, 1)]),
              _group("g1", [_trajectory("C", 0.2, 2, 0), _trajectory("D", 0.9, 3, 1)])]
    grads = []
    for split in SPLITS:
        torch.manual_seed(0)
        cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=True), loss_aggregation="trajectory_mean",
                            device="cpu", **split)  # type: ignore[arg-type]
        policy = load_policy(cfg)
        step = GRPOTrainerStep(policy, cfg)
        samples = samples_from_groups(groups, None, ["<workflow>"], None)
        assign_advantages(samples, "group")
        prepared = step.prepare(samples)
        if "micro_batch_tokens" in split:  # the budget really cut the step, and held
            assert 1 < len(prepared.micro_batches) < len(samples)
            assert all(mb.batch.input_ids.numel() <= 40 or mb.batch.input_ids.size(0) == 1
                       for mb in prepared.micro_batches)
        assert bool(getattr(policy.model, "is_gradient_checkpointing", False)) == split.get(
            "gradient_checkpointing", False)
        figures = step.accumulate(prepared)
        grads.append(({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None},
                      figures["loss"]))
    (first, loss), rest = grads[0], grads[1:]
    assert first and sum(g.abs().sum() for g in first.values()) > 0
    for other, other_loss in rest:
        assert other_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
        for name, g in first.items():
            torch.testing.assert_close(other[name], g, rtol=1e-4, atol=1e-7, msg=name)
