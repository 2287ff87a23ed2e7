"""What no step can use is refused before the step (out-of-vocabulary ids, non-finite logprobs or rewards);
non-finite weights are never written as a version; lineage offsets are exact; old checkpoints still load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlstream.learner.batch import BatchError, samples_from_trajectory
from rlstream.learner.checkpoint import LearnerState
from rlstream.learner.policy import load_policy
from rlstream.learner.publish import NonFiniteWeightsError, exact_ranges, write_version
from rlstream.schemas.config import LearnerConfig, LoraConfig
from rlstream.schemas.models import Message, TrajectoryEvent, Turn
from tests.support.learner_helpers import tiny_model


def _trajectory(prompt: list[int], completion: list[int], logprobs: list[float] | None = None,
                reward: float = 1.0) -> TrajectoryEvent:
    return TrajectoryEvent(run_id="r", example_id="e", group_id="g", group_size=1, generation_index=0, policy="p",
                           policy_version=0, reward=reward,
                           messages=[Message(role="user", content="q"), Message(role="assistant", content="a")],
                           turns=[Turn(message_index=1, prompt_token_ids=prompt, completion_token_ids=completion,
                                       completion_logprobs=logprobs)])


def test_token_ids_outside_the_vocabulary_and_non_finite_values_are_refused() -> None:
    ok = samples_from_trajectory(_trajectory([1, 2], [3, 99]), 0, None, ["<workflow>"], None, vocab_size=100)
    assert ok[0].completion_ids == [3, 99] and ok[0].trajectory is not None
    with pytest.raises(BatchError, match="token id 100 is outside the model's vocabulary"):
        samples_from_trajectory(_trajectory([1, 2], [3, 100]), 0, None, ["<workflow>"], None, vocab_size=100)
    with pytest.raises(BatchError, match="token id -1"):
        samples_from_trajectory(_trajectory([-1, 2], [3]), 0, None, ["<workflow>"], None)  # even without a size
    with pytest.raises(BatchError, match="non-finite behaviour logprobs"):
        samples_from_trajectory(_trajectory([1], [3, 4], [-1.0, float("nan")]), 0, None, ["<workflow>"], None)
    with pytest.raises(BatchError, match="non-finite reward"):
        samples_from_trajectory(_trajectory([1], [3], reward=float("inf")), 0, None, ["<workflow>"], None)


def test_non_finite_weights_are_never_written(tmp_path: Path) -> None:
    cfg = LearnerConfig(model=str(tiny_model(tmp_path)), lora=LoraConfig(enabled=True), device="cpu")
    policy = load_policy(cfg)
    assert policy.vocab_size is not None and policy.vocab_size > 100
    assert policy.nonfinite_parameters() == []
    name, param = next((n, p) for n, p in policy.model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        param[0].fill_(float("nan"))
    assert policy.nonfinite_parameters() == [name]
    with pytest.raises(NonFiniteWeightsError, match="NaN or inf"):
        write_version(policy, tmp_path / "versions", "p", 1)
    assert not (tmp_path / "versions").exists() or not any((tmp_path / "versions").iterdir())


def test_exact_ranges_hold_exactly_the_trained_offsets() -> None:
    ranges = exact_ranges("g", {1: [7, 3, 4, 5, 9], 0: [2], 3: []})
    assert [(r.partition, r.first, r.last) for r in ranges] == [(0, 2, 2), (1, 3, 5), (1, 7, 7), (1, 9, 9)]
    assert all(r.topic == "g" for r in ranges)


def test_learner_state_lineage_and_checkpoints_of_before_exact_lineage() -> None:
    state = LearnerState()
    for partition, offset in [(0, 4), (1, 2), (0, 6)]:
        state.record_trained(partition, offset)
    assert (state.pending_groups, state.groups_trained) == (3, 3)
    state.start_publication()
    assert state.publishing_offsets == {0: [4, 6], 1: [2]} and state.publishing_groups == 3
    assert state.pending_offsets == {} and state.pending_groups == 0
    assert LearnerState.from_json(json.loads(json.dumps(state.to_json()))) == state
    old = {"step": 4, "version": 2, "offsets": {"0": 9}, "pending_ranges": {"0": [5, 7]}, "pending_groups": 3,
           "publishing_ranges": {}, "publishing_groups": 0, "groups_trained": 8}
    restored = LearnerState.from_json(old)
    assert restored.pending_offsets == {0: [5, 6, 7]} and restored.offsets == {0: 9} and restored.groups_trained == 8
