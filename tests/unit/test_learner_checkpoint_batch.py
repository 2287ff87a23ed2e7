"""Checkpoints restore exactly and a corrupt newest one falls back to the previous; batching from messages
(chat template) and the target/trainable loss mask."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from rlstream.learner.batch import BatchError, samples_from_trajectory, tokens_from_messages, turn_is_target
from rlstream.learner.checkpoint import CheckpointStore, LearnerState
from rlstream.learner.policy import load_policy
from rlstream.learner.step import GRPOTrainerStep
from rlstream.schemas.config import LearnerConfig, LoraConfig
from rlstream.schemas.models import Message, TrajectoryEvent, Turn
from tests.support.learner_helpers import random_samples, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_checkpoint_roundtrip_and_corrupt_fallback(model_dir: Path, tmp_path: Path, lora: bool) -> None:
    # one optimizer step per learner step, so both checkpoints fall inside the warmup (the learning rate differs)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=lora), learning_rate=1e-2, warmup_steps=3,
                        device="cpu", num_iterations=1)
    policy = load_policy(cfg)
    trainer = GRPOTrainerStep(policy, cfg)
    store = CheckpointStore(tmp_path / "ck", keep=3)
    trainer.step(random_samples(seed=1))
    snapshot = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    torch.manual_seed(42)
    random.seed(42)
    store.save(LearnerState(step=1, offsets={0: 3}), policy.model, trainer.optimizer, trainer.scheduler)
    expected_draw = (torch.rand(3), random.random())
    trainer.step(random_samples(seed=2))
    store.save(LearnerState(step=2, offsets={0: 5, 1: 2}), policy.model, trainer.optimizer, trainer.scheduler)
    after2 = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}

    # a fresh learner resumes at the newest checkpoint with identical weights, optimizer and schedule
    fresh = load_policy(cfg)
    fresh_trainer = GRPOTrainerStep(fresh, cfg)
    state = store.load_latest(fresh.model, fresh_trainer.optimizer, fresh_trainer.scheduler)
    assert state is not None and state.step == 2 and state.offsets == {0: 5, 1: 2}
    for n, p in fresh.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, after2[n]), n
    assert fresh_trainer.scheduler.last_epoch == trainer.scheduler.last_epoch == 2
    assert fresh_trainer.optimizer.state_dict()["state"][0]["step"] == trainer.optimizer.state_dict()["state"][0]["step"]

    # corrupt the newest: the previous checkpoint (step 1) is used, RNG state included
    weights = store.path_for(2) / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)
    other = load_policy(cfg)
    other_trainer = GRPOTrainerStep(other, cfg)
    state = store.load_latest(other.model, other_trainer.optimizer, other_trainer.scheduler)
    assert state is not None and state.step == 1
    for n, p in other.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, snapshot[n]), n
    assert torch.equal(torch.rand(3), expected_draw[0]) and random.random() == expected_draw[1]

    # nothing valid at all -> None (fresh start)
    (store.path_for(1) / "manifest.json").unlink()
    assert store.load_latest(other.model, other_trainer.optimizer, other_trainer.scheduler) is None


def test_tokens_from_messages_uses_the_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [Message(role="user", content="Repeat the letter a."), Message(role="assistant", content="aaaa"),
            Message(role="user", content="again"), Message(role="assistant", content="aa")]
    prompt, completion = tokens_from_messages(tok, msgs, 3)
    assert tok.decode(prompt).endswith("again<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(completion) == "aa<|im_end|>"
    assert completion[-1] == tok.eos_token_id
    with pytest.raises(BatchError):
        tokens_from_messages(tok, msgs, 2)  # a user message
    with pytest.raises(BatchError):
        tokens_from_messages(None, msgs, 1)


def test_loss_mask_only_on_trainable_turns_of_the_target(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert turn_is_target(Turn(function="search"), ["<workflow>"], None)
    assert not turn_is_target(Turn(function="search", trainable=False), ["<workflow>"], None)
    assert turn_is_target(Turn(function="search"), ["search"], None)
    assert not turn_is_target(Turn(function="plan"), ["search"], None)
    assert not turn_is_target(Turn(model="other", function="search"), ["search"], "policy")

    msgs = [Message(role="user", content="q"), Message(role="assistant", content="plan it"),
            Message(role="user", content="go"), Message(role="assistant", content="searched")]
    traj = TrajectoryEvent(run_id="r", example_id="e", group_id="g", group_size=2, generation_index=0, policy="p",
                           policy_version=3, messages=msgs, reward=0.5,
                           turns=[Turn(message_index=1, function="plan"),
                                  Turn(message_index=3, function="search", prompt_token_ids=[5, 6],
                                       completion_token_ids=[7, 8, 9], completion_logprobs=[-1.0, -2.0, -3.0])])
    samples = samples_from_trajectory(traj, 0, tok, ["search"], None)
    assert len(samples) == 1 and samples[0].completion_ids == [7, 8, 9]
    assert samples[0].behaviour_logprobs == [-1.0, -2.0, -3.0] and samples[0].policy_version == 3
    both = samples_from_trajectory(traj, 0, tok, ["<workflow>"], None)
    assert len(both) == 2 and both[0].behaviour_logprobs is None  # templated turn trains on-policy
    assert tok.decode(both[0].completion_ids) == "plan it<|im_end|>"
    bad = traj.model_copy(update={"turns": [Turn(message_index=3, prompt_token_ids=[1], completion_token_ids=[2, 3],
                                                 completion_logprobs=[-1.0])]})
    with pytest.raises(BatchError):
        samples_from_trajectory(bad, 0, tok, ["<workflow>"], None)
