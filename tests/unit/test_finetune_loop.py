"""The epoch engine's loop with its Kafka stages held in memory (the epoch, curriculum and output logic is the
engine's own): the validation schedule, the exact curriculum per epoch, epochs with nothing to train, and the
trajectory checks that drop a bad trajectory without failing the submission."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Sequence

from rlstream.finetune.engine import (CandidateGroup, EngineSettings, EpochEngine, Generation, OutcomeStatus,
                                      Rejection, TrainingOutcome, checked_groups, trajectory_problem)
from rlstream.finetune.outputs import TRAINING_METRICS, VALIDATION_HISTORY
from rlstream.finetune.runtime import CollectedGroup, FinetuneContext
from rlstream.schemas.config import RlstreamConfig, load_config
from rlstream.schemas.models import Message, TrajectoryEvent, TrajectoryGroup
from rlstream.streams.curriculum import keep_count, percentile_schedule
from tests.support.factories import make_trajectory

# rewards per epoch: 4 groups of 2; epoch 2 has only identical rewards (nothing passes min_reward_diff)
PLAN = {0: [(0.0, 1.0), (0.2, 0.6), (0.1, 0.9), (0.5, 0.7)],
        1: [(0.0, 0.4), (0.3, 0.9), (0.2, 0.2), (0.6, 1.0)],
        2: [(0.5, 0.5), (0.1, 0.1), (0.0, 0.0), (0.9, 0.9)],
        3: [(0.0, 1.0), (0.2, 0.8), (0.4, 0.6), (0.1, 0.3)]}


def event(reward: float, group: str, index: int = 0, size: int = 2) -> TrajectoryEvent:
    return make_trajectory(example_id=group, group_id=group, group_size=size, generation_index=index, reward=reward)


class PlannedGenerator:
    """Hands over PLAN's groups; counts the validation passes."""

    validates = True

    def __init__(self) -> None:
        self.validated: list[int] = []

    async def generate(self, epoch: int) -> list[CandidateGroup]:
        return [CandidateGroup(f"e{epoch}g{i}", [Generation(event(r, f"e{epoch}g{i}", j), r) for j, r in enumerate(rs)])
                for i, rs in enumerate(PLAN[epoch])]

    async def validate(self, epoch: int) -> list[float]:
        self.validated.append(epoch)
        return [0.25, 0.75]


class InMemoryEngine(EpochEngine):
    """The engine with its Kafka stages in memory: every checked group is "assembled" at once; training records
    what it was given."""

    def __init__(self, context: FinetuneContext, cfg: RlstreamConfig) -> None:
        super().__init__(context, cfg.finetuning.curriculum_learning, EngineSettings())
        self.submitted: list[list[str]] = []

    async def publish_and_collect(self, candidates: Sequence[CandidateGroup],
                                  rejected: list[Rejection]) -> tuple[list[CollectedGroup], list[str]]:
        groups, _ = checked_groups(candidates, 2, rejected)
        collected = []
        for offset, events in enumerate(groups):
            rewards = [float(e.reward or 0.0) for e in events]
            group = TrajectoryGroup(group_id=events[0].group_id, run_id="r", example_id=events[0].example_id,
                                    policy="policy", min_policy_version=0, max_policy_version=0,
                                    expected_size=len(events), trajectories=events,
                                    reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards),
                                    reward_min=min(rewards), reward_max=max(rewards))
            collected.append(CollectedGroup(group, 0, offset))
        return collected, []

    async def train_and_serve(self, groups: Sequence[CollectedGroup], progress: object = None) -> TrainingOutcome:
        self.submitted.append([c.group.group_id for c in groups])
        return TrainingOutcome(OutcomeStatus.COMPLETED, "done", version=len(self.submitted), figures={"loss": 0.5},
                               groups_trained=len(groups))


def loop_config(tmp_path: Path) -> RlstreamConfig:
    return load_config(None, [
        ("finetuning.output_dir", str(tmp_path / "out")), ("finetuning.num_epochs", "4"),
        ("finetuning.validation_interval", "2"),
        ("finetuning.curriculum_learning.enabled", "true"),
        ("finetuning.curriculum_learning.expansion_interval", "2"),
        ("finetuning.curriculum_learning.min_reward_diff", "0.1"),
    ])


async def test_epoch_loop_validation_schedule_and_exact_curriculum(tmp_path: Path) -> None:
    cfg = loop_config(tmp_path)
    ft = cfg.finetuning
    engine = InMemoryEngine(FinetuneContext(cfg, server_url="http://unused"), cfg)
    generator = PlannedGenerator()
    outcomes = await engine.run(generator, ft.num_epochs, ft.validation_interval)

    assert generator.validated == [0, 2, 4]  # epoch % 2 == 0, then after the last epoch
    assert [v["epoch"] for v in json.loads((tmp_path / "out" / VALIDATION_HISTORY).read_text())] == [0, 2, 4]
    lines = [json.loads(x) for x in (tmp_path / "out" / TRAINING_METRICS).read_text().splitlines()]
    # epoch 0: 0-(-1) = 1 < 2, stays 0.3; epoch 1: expands to 0.5; epoch 2: no varied group -> state untouched;
    # epoch 3: 3-1 = 2 -> 0.7
    assert [r["curriculum_percentile"] for r in lines] == [0.3, 0.5, 0.5, 0.7]
    assert percentile_schedule(ft.curriculum_learning, 2) == [0.3, 0.5]
    assert [r["filtered_groups"] for r in lines] == [keep_count(4, 0.3), keep_count(3, 0.5), 0, keep_count(4, 0.7)]
    # highest mean first: epoch 0 means 0.5, 0.4, 0.5, 0.6 -> e0g3 then (stable) e0g0
    assert engine.submitted[0] == ["e0g3", "e0g0"]
    # epoch 1: e1g2 has no spread; means e1g0 0.2, e1g1 0.6, e1g3 0.8 -> keep 2 of 3
    assert engine.submitted[1] == ["e1g3", "e1g1"]
    assert len(engine.submitted) == 3 and len(outcomes) == 3  # epoch 2 had nothing to train
    assert lines[2]["curriculum_state"]["last_expansion_epoch"] == 1
    assert lines[0]["num_groups"] == 4 and lines[0]["num_trajectories"] == 8
    assert (tmp_path / "out" / "reward_plot.png").exists()
    assert [job["version"] for job in engine.summary()["jobs"]] == [1, 2, 3]  # type: ignore[index]


def test_a_bad_trajectory_is_dropped_not_the_submission() -> None:
    good = CandidateGroup("a", [Generation(event(0.1, "a", 0), 0.1), Generation(event(0.9, "a", 1), 0.9)])
    starts_with_assistant = event(0.5, "b", 0).model_copy(update={"messages": [
        Message(role="assistant", content="hi"), Message(role="user", content="q")]})
    two_assistants = event(0.4, "b", 1)
    two_assistants = two_assistants.model_copy(update={"messages": [
        *two_assistants.messages, Message(role="assistant", content="again")]})
    bad = CandidateGroup("b", [Generation(starts_with_assistant, 0.5), Generation(two_assistants, 0.4)])
    mixed = CandidateGroup("c", [Generation(event(0.2, "c", 0, size=3), 0.2),
                                 Generation(event(float("nan"), "c", 1, size=3), float("nan")),
                                 Generation(None, float("nan"), b"{}", "ValidationError: reward missing")])
    rejected: list[Rejection] = []
    groups, dropped = checked_groups([good, bad, mixed], 1, rejected)
    assert [len(g) for g in groups] == [2, 1]  # group b lost every member; group c kept its good one
    assert [g[0].group_size for g in groups] == [2, 1]  # a lost nothing (keeps its size); c is renumbered
    assert [r.reason for r in rejected] == [
        "episode starts with assistant, not user or system", "two consecutive assistant messages",
        "non-finite reward nan", "ValidationError: reward missing"]
    assert [group_id for group_id, _, _ in dropped] == ["b", "b", "c", "c"]
    # below streams.min_group_size, the survivors of a group go too (each with the reason)
    rejected = []
    groups, _ = checked_groups([good, mixed], 2, rejected)
    assert [g[0].group_id for g in groups] == ["a"]
    assert rejected[-1] == Rejection("c", "group has 1 trainable generations, fewer than streams.min_group_size 2")


def test_trajectory_problem_follows_the_episode_rules() -> None:
    assert trajectory_problem(event(0.0, "g").model_copy(update={"messages": []})) == "empty episode"
    assert trajectory_problem(make_trajectory(with_tool_call=True, turns=2)) is None  # system, user, tool calls
    no_turn = event(0.0, "g").model_copy(update={"turns": []})
    assert trajectory_problem(no_turn) == "no trainable turn"
    wrong = event(0.0, "g")
    wrong = wrong.model_copy(update={"turns": [wrong.turns[0].model_copy(update={"message_index": 1})]})
    assert trajectory_problem(wrong) == "turn points at message 1, which is not an assistant message"
