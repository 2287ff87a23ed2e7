"""Pure parts of rollout: admission rule, manifest checks, dataset loading, reward shapes, constrained calls."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.rollout.admission import AdmissionPolicy
from rlstream.rollout.capture import constrained
from rlstream.rollout.loading import DatasetError, UserCodeError, load_callable, load_examples
from rlstream.inference.manifest import ManifestError, digest_files, local_dir, verify
from rlstream.rollout.runner import score
from rlstream.schemas.models import FileDigest, PolicyVersion, WeightsKind


def test_admission_allows_max_policy_lag_versions_ahead_then_pauses() -> None:
    policy = AdmissionPolicy(max_policy_lag=2, groups_per_version=4, base_version=5)
    admitted = [n for n in range(20) if policy.decide(n, learner_version=5).admit]
    assert admitted == list(range(12))  # 3 versions' worth of groups (current + 2 ahead)
    assert policy.decide(12, learner_version=6).admit and not policy.decide(16, learner_version=6).admit
    stale = policy.decide(0, learner_version=9, served_version=6)
    assert not stale.admit and "behind" in stale.reason
    assert policy.decide(0, learner_version=8, served_version=6).admit


def version_of(directory: Path, **changes: object) -> PolicyVersion:
    return PolicyVersion(policy="p", version=1, base_model="b", kind=WeightsKind.lora, uri=str(directory),
                         files=digest_files(directory), learner_step=1).model_copy(update=changes)


def test_manifest_accepts_matching_files_and_refuses_tampering(tmp_path: Path) -> None:
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weights")
    (tmp_path / "adapter_config.json").write_text("{}")
    good = version_of(tmp_path)
    assert verify(good) == tmp_path
    assert verify(good.model_copy(update={"uri": f"file://{tmp_path}"})) == tmp_path
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weightz")
    with pytest.raises(ManifestError, match="sha256"):
        verify(good)
    with pytest.raises(ManifestError, match="missing"):
        verify(good.model_copy(update={"files": [FileDigest(path="gone.safetensors", sha256="0" * 64)]}))
    with pytest.raises(ManifestError, match="leaves"):
        verify(good.model_copy(update={"files": [FileDigest(path="../x.json", sha256="0" * 64)]}))
    with pytest.raises(ManifestError, match="empty"):
        verify(good.model_copy(update={"files": []}))
    with pytest.raises(ManifestError, match="scheme"):
        local_dir("s3://bucket/v1")


def test_datasets_load_from_json_and_jsonl_with_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps([{"id": 7, "prompt": "x"}, {"prompt": "y"}]))
    assert [e["id"] for e in load_examples(tmp_path / "a.json")] == ["7", "1"]
    (tmp_path / "b.jsonl").write_text('{"key": "k1", "prompt": "x"}\n\n{"key": "k2"}\n')
    assert [e["id"] for e in load_examples(tmp_path / "b.jsonl", id_field="key")] == ["k1", "k2"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{oops\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        load_examples(tmp_path / "bad.jsonl")
    (tmp_path / "dup.jsonl").write_text('{"id": 1}\n{"id": 1}\n')
    with pytest.raises(DatasetError, match="duplicate"):
        load_examples(tmp_path / "dup.jsonl")
    with pytest.raises(DatasetError, match="cannot read"):
        load_examples(tmp_path / "none.jsonl")


def test_user_code_references() -> None:
    assert load_callable("rlstream.rollout.runner:score")(0.5) == (0.5, {})
    with pytest.raises(UserCodeError, match="module:function"):
        load_callable("rlstream.ops.toy.toy_reward")
    with pytest.raises(UserCodeError, match="no attribute"):
        load_callable("rlstream.ops.toy:nope")
    with pytest.raises(UserCodeError, match="cannot import"):
        load_callable("no_such_module_xyz:f")


def test_reward_shapes() -> None:
    assert score(0.5) == (0.5, {})
    assert score((1, {"a": 2})) == (1.0, {"a": 2.0})
    assert score({"reward": 0.25, "len": 3}) == (0.25, {"reward": 0.25, "len": 3.0})
    assert score({"a": 1, "b": 2}) == (3.0, {"a": 1.0, "b": 2.0})


def test_constrained_requests_are_recognised() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert constrained({"tools": tools, "tool_choice": "required"})
    assert constrained({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert constrained({"response_format": {"type": "json_object"}})
    assert constrained({"extra_body": {"structured_outputs": {"regex": "a+"}}})
    assert not constrained({"tools": tools, "tool_choice": "auto"})
    assert not constrained({"response_format": {"type": "text"}})


def test_under_a_gate_admission_waits_for_the_serving_pointer_not_the_learner() -> None:
    policy = AdmissionPolicy(max_policy_lag=2, groups_per_version=8)
    # the gate rejected v14-v16: serving stays at 13 and the fleet serves it; the rollout must go on
    assert policy.decide(0, learner_version=16, served_version=13, serving_pointer=13).admit
    # control: judged against the learner's latest, the same fleet stops the rollout (and so the learner) for good
    assert not policy.decide(0, learner_version=16, served_version=13).admit
    # the fleet still loading what the gate promoted: wait
    waiting = policy.decide(0, learner_version=16, served_version=10, serving_pointer=13)
    assert not waiting.admit and "serving pointer" in waiting.reason


def test_a_resync_ends_a_pause_held_by_groups_that_never_trained_and_the_count_still_bounds() -> None:
    policy = AdmissionPolicy(max_policy_lag=2, groups_per_version=8)
    # 128 groups started, the learner at version 13: 3 versions' worth were filtered or skipped and never trained
    paused = policy.decide(128, learner_version=13)
    assert not paused.admit and paused.ahead_of_learner
    # control: without a resync the learner's version never moves (it has no data), so the pause never ends
    assert not policy.decide(128, learner_version=13).admit
    policy.resync(128, learner_version=13)
    assert policy.decide(128, learner_version=13).admit
    # from there the count bounds as before: 3 versions' worth of groups, then a pause until the learner moves
    assert [n for n in range(128, 160) if policy.decide(n, learner_version=13).admit] == list(range(128, 152))
    assert policy.decide(152, learner_version=14).admit
    # a pause for the fleet (not for the count) is not one a resync can end
    assert not policy.decide(0, learner_version=16, served_version=10, serving_pointer=13).ahead_of_learner
