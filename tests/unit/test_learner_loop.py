"""The train-and-publish loop's safety rules, shared by the learner service and the finetune engine: the lease is
confirmed right before every checkpoint and every version (nothing is written without it), and weights that are not
finite are never checkpointed nor published. The policy, trainer and store are stand-ins: only the loop's decisions
are under test (the real announcement is tested in tests/integration/test_learner_publish.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlstream.learner.checkpoint import LearnerState
from rlstream.learner.loop import (REFUSED_LEASE, REFUSED_NONFINITE, PublicationTarget, Saved, TrainPublishLoop)
from rlstream.learner.publish import Announcer
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import Lease


class StandInPolicy:
    lora = True
    base_model = "base"
    model = object()

    def __init__(self, nonfinite: list[str] | None = None) -> None:
        self.nonfinite = nonfinite or []

    def nonfinite_parameters(self) -> list[str]:
        return self.nonfinite


class StandInTrainer:
    optimizer = scheduler = None


class RecordingStore:
    def __init__(self) -> None:
        self.saved_versions: list[int] = []

    def save(self, state: LearnerState, model: Any, optimizer: Any, scheduler: Any) -> None:
        self.saved_versions.append(state.version)


class Guard:
    """Holds the lease or not; counts confirmations."""

    def __init__(self, held: bool) -> None:
        self.held = held
        self.confirmations = 0
        self.lost_with: BaseException | None = None

    @property
    def lease(self) -> Lease:
        return Lease(holder="me", token=1)

    async def confirm(self) -> bool:
        self.confirmations += 1
        return self.held

    def lost(self, exc: BaseException) -> None:
        self.lost_with = exc


def loop(tmp_path: Path, guard: Guard, policy: StandInPolicy | None = None) -> tuple[TrainPublishLoop, RecordingStore]:
    store = RecordingStore()
    state = LearnerState(step=4, version=2)
    state.record_trained(0, 17)
    target = PublicationTarget("policy", "run", TopicNames(prefix="rlstream."), tmp_path / "versions", 30.0)
    return TrainPublishLoop(policy=policy or StandInPolicy(), trainer=StandInTrainer(), state=state,  # type: ignore[arg-type]
                            target=target, announcer=Announcer(object(), "rlstream-learner-policy"),
                            control=object(), codec=AvroCodec(), guard=guard, store=store), store  # type: ignore[arg-type]


async def test_no_checkpoint_and_no_version_without_the_lease(tmp_path: Path) -> None:
    guard = Guard(held=False)
    train_loop, store = loop(tmp_path, guard)
    saved = await train_loop.save(checkpoint=True, publish=True, figures={})
    assert saved == Saved(refused=REFUSED_LEASE) and guard.confirmations == 1
    assert store.saved_versions == [] and not (tmp_path / "versions").exists()
    assert train_loop.state.version == 2 and train_loop.state.pending_groups == 1  # the lineage waits for a version
    # negative control: with the lease held, the due checkpoint is written (after its confirmation)
    held = Guard(held=True)
    train_loop, store = loop(tmp_path, held)
    saved = await train_loop.save(checkpoint=True, publish=False, figures={})
    assert saved.checkpointed and saved.refused is None and store.saved_versions == [2] and held.confirmations == 1


async def test_nothing_is_written_from_weights_that_are_not_finite(tmp_path: Path) -> None:
    guard = Guard(held=True)
    train_loop, store = loop(tmp_path, guard, StandInPolicy(nonfinite=["lora_A"]))
    saved = await train_loop.save(checkpoint=False, publish=True, figures={})
    assert saved.refused == REFUSED_NONFINITE and store.saved_versions == [] and train_loop.state.version == 2


async def test_nothing_due_writes_nothing_and_asks_nothing(tmp_path: Path) -> None:
    guard = Guard(held=True)
    train_loop, store = loop(tmp_path, guard)
    assert await train_loop.save(checkpoint=False, publish=False, figures={}) == Saved()
    assert guard.confirmations == 0 and store.saved_versions == []


async def test_an_announcer_built_without_a_transactional_id_is_refused() -> None:
    from rlstream.transport.trusted_versions import announce_record

    with pytest.raises(ValueError, match="only by a transactional producer"):
        await announce_record(object(), object(), Lease(holder="me", token=1), topic="t",  # type: ignore[arg-type]
                              policy="p", version=1, value=b"x", transactional=False)
