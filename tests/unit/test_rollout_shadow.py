"""Which production trajectories shadow sampling completes into groups, and its stable ids."""
from __future__ import annotations

from rlstream.rollout.shadow import ShadowSettings, shadow_id, why_not
from rlstream.schemas.models import Message, TrajectoryEvent, TrajectorySource, Turn


def event(**change: object) -> TrajectoryEvent:
    base = TrajectoryEvent(run_id="r", example_id="toy", group_id="g", group_size=1, generation_index=0, policy="p",
                           policy_version=0, source=TrajectorySource.production,
                           messages=[Message(role="user", content="q"), Message(role="assistant", content="a")],
                           turns=[Turn(message_index=1)], metadata={"task": "toy"})
    return base.model_copy(update=change)


def test_only_single_production_answers_of_the_task_are_shadowed() -> None:
    settings = ShadowSettings(group_size=4, task="toy")
    assert why_not(event(), settings) is None
    assert why_not(event(), ShadowSettings(task=None)) is None
    assert why_not(event(source=TrajectorySource.rollout), settings) == "not_production"
    assert why_not(event(source=TrajectorySource.shadow), settings) == "not_production"  # never its own output
    assert why_not(event(group_size=4), settings) == "already_a_group"
    assert why_not(event(metadata={"task": "other"}), settings) == "other_task"
    assert why_not(event(messages=[Message(role="user", content="q")]), settings) == "not_a_single_answer"
    two_turns = event(turns=[Turn(message_index=1), Turn(message_index=3)])
    assert why_not(two_turns, settings) == "not_a_single_answer"


def test_shadow_ids_are_stable_and_distinct() -> None:
    assert shadow_id("t1", 0) == shadow_id("t1", 0)  # a restarted run publishes the same ids (duplicates dropped)
    assert len({shadow_id("t1", i) for i in range(4)} | {shadow_id("t2", 0)}) == 5
