"""rlstream's Trainer (``rlstream_grpo``) driving in-memory components, the way a ported NAT component plugs in:
the validation schedule, the exact curriculum per epoch, epochs with nothing to train, and trajectory checks
that drop a bad trajectory without failing the submission."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from rlstream.finetune import (EpisodeItem, EpisodeItemRole, TrainerAdapter, TrainerAdapterConfig, TrainingJobRef,
                          TrainingJobStatus, TrainingStatusEnum, Trajectory, TrajectoryBuilder,
                          TrajectoryBuilderConfig, TrajectoryCollection, register_trainer_adapter,
                          register_trajectory_builder)
from rlstream.finetune.components import GRPOTrainerAdapter, GRPOTrainerAdapterConfig, episode_problem
from rlstream.finetune.outputs import TRAINING_METRICS, VALIDATION_HISTORY
from rlstream.finetune.registry import build_component
from rlstream.finetune.runtime import FinetuneContext
from rlstream.schemas.config import RlstreamConfig, load_config
from rlstream.schemas.models import Message, ToolCall, TrajectoryEvent, Turn
from rlstream.streams.curriculum import keep_count, percentile_schedule


def traj(reward: float, roles: tuple[str, ...] = ("user", "assistant"), group: str = "g") -> Trajectory:
    episode = [EpisodeItem(EpisodeItemRole(r), f"{r} text") for r in roles]
    return Trajectory(episode=episode, reward=reward, metadata={"group_id": group, "example_id": group})


# rewards per epoch: 4 groups of 2; epoch 2 has only identical rewards (nothing passes min_reward_diff)
PLAN = {0: [(0.0, 1.0), (0.2, 0.6), (0.1, 0.9), (0.5, 0.7)],
        1: [(0.0, 0.4), (0.3, 0.9), (0.2, 0.2), (0.6, 1.0)],
        2: [(0.5, 0.5), (0.1, 0.1), (0.0, 0.0), (0.9, 0.9)],
        3: [(0.0, 1.0), (0.2, 0.8), (0.4, 0.6), (0.1, 0.3)]}


class PlannedBuilderConfig(TrajectoryBuilderConfig, name="test_planned_builder"):
    pass


class PlannedBuilder(TrajectoryBuilder):
    def __init__(self, config: PlannedBuilderConfig) -> None:
        super().__init__(config)
        self.epochs: dict[str, int] = {}
        self.validated: list[int] = []

    async def start_run(self, run_id: str, meta: dict[str, Any] | None = None) -> None:
        self.epochs[run_id] = int((meta or {})["epoch"])

    async def finalize(self, run_id: str, meta: dict[str, Any] | None = None) -> TrajectoryCollection:
        epoch = self.epochs.pop(run_id)
        groups = [[traj(r, group=f"e{epoch}g{i}") for r in rewards] for i, rewards in enumerate(PLAN[epoch])]
        return TrajectoryCollection(groups, run_id)

    async def run_validation(self, epoch: int, meta: dict[str, Any] | None = None) -> list[float]:
        self.validated.append(epoch)
        return [0.25, 0.75]

    def log_progress(self, run_id: str, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        pass


@register_trajectory_builder(config_type=PlannedBuilderConfig)
async def planned_builder(config: PlannedBuilderConfig, builder: Any) -> Any:
    yield PlannedBuilder(config)


class RecordingAdapterConfig(TrainerAdapterConfig, name="test_recording_adapter"):
    pass


class RecordingAdapter(TrainerAdapter):
    def __init__(self, config: RecordingAdapterConfig) -> None:
        super().__init__(config)
        self.submitted: list[list[str]] = []

    async def is_healthy(self) -> bool:
        return True

    async def submit(self, trajectories: TrajectoryCollection) -> TrainingJobRef:
        self.submitted.append([trajectories.group_id(i) for i in range(len(trajectories.trajectories))])
        return TrainingJobRef(trajectories.run_id, "memory", {"n": len(self.submitted)})

    async def status(self, ref: TrainingJobRef) -> TrainingJobStatus:
        return TrainingJobStatus(ref.run_id, "memory", TrainingStatusEnum.COMPLETED, 100.0, "done", {"loss": 0.5})

    def log_progress(self, ref: TrainingJobRef, metrics: dict[str, Any], output_dir: str | None = None) -> None:
        pass


@register_trainer_adapter(config_type=RecordingAdapterConfig)
def recording_adapter(config: RecordingAdapterConfig, builder: Any) -> Any:
    return RecordingAdapter(config)


def loop_config(tmp_path: Path) -> RlstreamConfig:
    return load_config(None, [
        ("finetuning.output_dir", str(tmp_path / "out")), ("finetuning.num_epochs", "4"),
        ("finetuning.validation_interval", "2"), ("finetuning.validation_dataset", str(tmp_path / "val.jsonl")),
        ("finetuning.trajectory_builder", "test_planned_builder"),
        ("finetuning.trainer_adapter", "test_recording_adapter"),
        ("finetuning.curriculum_learning.enabled", "true"),
        ("finetuning.curriculum_learning.expansion_interval", "2"),
        ("finetuning.curriculum_learning.min_reward_diff", "0.1"),
    ])


async def test_epoch_loop_validation_schedule_and_exact_curriculum(tmp_path: Path) -> None:
    cfg = loop_config(tmp_path)
    ft = cfg.finetuning
    ctx = FinetuneContext(cfg, server_url="http://unused")
    async with contextlib.AsyncExitStack() as stack:
        builder = await build_component("trajectory_builder", ft, ctx, stack)
        adapter = await build_component("trainer_adapter", ft, ctx, stack)
        trainer = await build_component("trainer", ft, ctx, stack)
        await trainer.bind_components(builder, adapter)
        await trainer.initialize(ft)
        statuses = await trainer.run(ft.num_epochs)

    assert builder.validated == [0, 2, 4]  # epoch % 2 == 0, then after the last epoch
    assert [v["epoch"] for v in json.loads((tmp_path / "out" / VALIDATION_HISTORY).read_text())] == [0, 2, 4]
    lines = [json.loads(x) for x in (tmp_path / "out" / TRAINING_METRICS).read_text().splitlines()]
    # epoch 0: 0-(-1) = 1 < 2, stays 0.3; epoch 1: expands to 0.5; epoch 2: no varied group -> state untouched;
    # epoch 3: 3-1 = 2 -> 0.7
    assert [r["curriculum_percentile"] for r in lines] == [0.3, 0.5, 0.5, 0.7]
    assert percentile_schedule(ft.curriculum_learning, 2) == [0.3, 0.5]
    assert [r["filtered_groups"] for r in lines] == [keep_count(4, 0.3), keep_count(3, 0.5), 0, keep_count(4, 0.7)]
    # highest mean first: epoch 0 means 0.5, 0.4, 0.5, 0.6 -> e0g3 then (stable) e0g0
    assert adapter.submitted[0] == ["e0g3", "e0g0"]
    # epoch 1: e1g2 has no spread; means e1g0 0.2, e1g1 0.6, e1g3 0.8 -> keep 2 of 3
    assert adapter.submitted[1] == ["e1g3", "e1g1"]
    assert len(adapter.submitted) == 3 and len(statuses) == 3  # epoch 2 had nothing to train
    assert lines[2]["curriculum_state"]["last_expansion_epoch"] == 1
    assert (tmp_path / "out" / "reward_plot.png").exists()


def test_a_bad_trajectory_is_dropped_not_the_submission(tmp_path: Path) -> None:
    adapter = GRPOTrainerAdapter(GRPOTrainerAdapterConfig(), FinetuneContext(loop_config(tmp_path), "http://unused"))
    good = [traj(0.1, group="a"), traj(0.9, group="a")]
    bad = [traj(0.5, ("assistant", "user"), group="b"), traj(0.4, ("user", "assistant", "assistant"), group="b")]
    mixed = [traj(0.2, group="c"), traj(float("nan"), group="c")]
    groups = adapter._valid_groups(TrajectoryCollection([good, bad, mixed], "r"))
    assert [len(g) for g in groups] == [2, 1]  # group b lost every member; group c kept its good one
    assert [reason for _, reason in adapter.rejected] == [
        "episode starts with assistant, not user or system", "two consecutive assistant messages",
        "non-finite reward nan"]
    assert episode_problem(Trajectory([], 1.0)) == "empty episode"
    assert episode_problem(traj(0.0, ("system", "user", "assistant", "tool", "assistant"))) is None


def test_trajectory_view_of_an_event_keeps_tool_calls_and_logprobs() -> None:
    event = TrajectoryEvent(
        run_id="r", example_id="x", group_id="r:x:0", group_size=2, generation_index=1, policy="p", policy_version=3,
        messages=[Message(role="user", content="hi"),
                  Message(role="assistant", content=None, tool_calls=[ToolCall(id="c1", name="f", arguments="{}")]),
                  Message(role="tool", content="42", tool_call_id="c1"), Message(role="assistant", content="done")],
        turns=[Turn(message_index=1, completion_token_ids=[1, 2], completion_logprobs=[-0.1, -0.2]),
               Turn(message_index=3)],
        reward=0.75)
    t = Trajectory.from_event(event)
    assert [i.role.value for i in t.episode] == ["user", "assistant", "tool", "assistant"]
    assert t.episode[1].metadata["tool_calls"][0]["name"] == "f" and t.episode[1].logprobs == [-0.1, -0.2]
    assert t.episode[2].metadata["tool_call_id"] == "c1" and t.reward == 0.75
    assert t.metadata["group_id"] == "r:x:0" and t.metadata["policy_version"] == 3
    back = t.to_event(run_id="r", policy="p", group_id="r:x:0", example_id="x", group_size=2, generation_index=1)
    assert back == event
    detached = Trajectory(t.episode, 0.5, dict(t.metadata)).to_event(run_id="r", policy="p", group_id="g",
                                                                     example_id="x", group_size=2, generation_index=0)
    assert detached.messages[1].tool_calls[0].name == "f" and detached.messages[2].tool_call_id == "c1"
    assert [turn.message_index for turn in detached.turns] == [1, 3] and detached.reward == 0.5
