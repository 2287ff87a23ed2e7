"""Our GRPO loss and gradients equal TRL GRPOTrainer's on the same model and batch (TRL: test-only), at the first
optimizer step of a batch and, with ``num_iterations`` 2, at the second (against the batch-start policy), and at a
sampling temperature other than 1 (each turn's logprobs at the temperature it was sampled at, as TRL divides the
logits by its temperature)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rlstream.learner.batch import collate
from rlstream.learner.policy import completion_logprobs, load_policy
from rlstream.learner.step import GRPOTrainerStep, assign_advantages
from rlstream.schemas.config import LearnerConfig, LoraConfig
from tests.support.learner_helpers import random_samples, tiny_model

AGGREGATIONS = [("token_mean", "bnpo"), ("sequence_mean", "grpo"), ("constant", "dr_grpo")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("trl"))


def _trl_trainer(model, tokenizer, out: Path, loss_type: str, beta: float, max_len: int, scale: str,
                 num_iterations: int = 1, temperature: float = 1.0):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
                      num_iterations=num_iterations,
                      scale_rewards=scale, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=max_len, temperature=temperature, report_to=[], use_cpu=True,
                      logging_steps=1, save_strategy="no", bf16=False, fp16=False,
                      use_bias_correction_kl=False)  # our k3 term is the plain estimator
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * 8), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


@pytest.mark.parametrize("ours,theirs", AGGREGATIONS)
def test_loss_and_gradients_equal_trl(model_dir: Path, tmp_path: Path, ours: str, theirs: str) -> None:
    torch.manual_seed(0)
    beta, cap = 0.05, 1.5
    samples = random_samples(groups=2, per_group=4, seed=3)
    max_len = max(len(s.completion_ids) for s in samples)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), beta=beta, importance_cap=cap,
                        loss_aggregation=ours, loss_constant=max_len, micro_batch_size=3, scale_rewards="group",
                        device="cpu")
    policy = load_policy(cfg)
    with torch.no_grad():  # move the policy away from its reference so that the KL term has a gradient
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    trl_model = copy.deepcopy(policy.model)

    # ours: three micro-batches (3+3+2 samples) with gradient accumulation
    step = GRPOTrainerStep(policy, cfg)
    assign_advantages(samples, cfg.scale_rewards)
    figures = step.accumulate(samples)
    our_grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}

    # TRL: one batch, the same tensors; advantages, reference logprobs and IS ratios as TRL builds them
    batch = collate(samples, policy.pad_id)
    p_len = batch.input_ids.size(1) - batch.completion_len
    rewards = torch.tensor([s.reward for s in samples]).view(-1, 4)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    with torch.no_grad():
        ref = completion_logprobs(policy.reference, batch)
        old = completion_logprobs(trl_model, batch)
    trainer = _trl_trainer(trl_model, policy.tokenizer, tmp_path, theirs, beta, max_len, "group")
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True  # apply its IS-correction term
    inputs = {
        "prompt_ids": batch.input_ids[:, :p_len], "prompt_mask": batch.attention_mask[:, :p_len],
        "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask,
        "advantages": adv, "old_per_token_logps": None, "ref_per_token_logps": ref,
        "importance_sampling_ratio": torch.clamp(torch.exp(old - batch.behaviour_logprobs), max=cap),
    }
    trl_model.train()
    trl_loss = trainer._compute_loss(trl_model, inputs)
    trl_loss.backward()

    assert figures["loss"] == pytest.approx(trl_loss.item(), rel=1e-4, abs=1e-6)
    assert abs(trl_loss.item()) > 1e-3
    assert figures["kl"] > 0
    for name, param in trl_model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(our_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert sum(g.abs().sum() for g in our_grads.values()) > 0


@pytest.mark.parametrize("ours,theirs", AGGREGATIONS)
def test_second_iteration_equals_trl_against_the_batch_start_policy(model_dir: Path, tmp_path: Path, ours: str,
                                                                    theirs: str) -> None:
    """num_iterations 2: after one optimizer step, the loss, gradients and clip fraction of the second step on the
    same batch equal TRL's with ``old_per_token_logps`` = the batch-start policy's logprobs."""
    torch.manual_seed(0)
    beta, cap = 0.05, 1.5
    samples = random_samples(groups=2, per_group=4, seed=3)
    max_len = max(len(s.completion_ids) for s in samples)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), beta=beta, importance_cap=cap,
                        loss_aggregation=ours, loss_constant=max_len, micro_batch_size=3, scale_rewards="group",
                        device="cpu", num_iterations=2, learning_rate=2e-2)
    policy = load_policy(cfg)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    batch = collate(samples, policy.pad_id)
    with torch.no_grad():
        batch_start = completion_logprobs(policy.model, batch)

    step = GRPOTrainerStep(policy, cfg)
    assign_advantages(samples, cfg.scale_rewards)
    prepared = step.prepare(samples)
    first, applied = step.optimizer_step(prepared, 0)
    assert applied and first["clip_fraction"] == 0.0  # ratio 1 at the first step: the clip cannot act
    trl_model = copy.deepcopy(policy.model)  # the moved policy (its gradients were dropped after the step)
    figures = step.accumulate(prepared)  # the second step's forward/backward
    our_grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    for k, mb in enumerate(prepared.micro_batches):  # the old logprobs stayed the batch-start policy's
        rows = list(range(k * cfg.micro_batch_size, k * cfg.micro_batch_size + len(mb.batch.samples)))
        torch.testing.assert_close(mb.old_logprobs * mb.batch.completion_mask,
                                   batch_start[rows, : mb.batch.completion_len] * mb.batch.completion_mask)

    p_len = batch.input_ids.size(1) - batch.completion_len
    rewards = torch.tensor([s.reward for s in samples]).view(-1, 4)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    with torch.no_grad():
        ref = completion_logprobs(policy.reference, batch)
    trainer = _trl_trainer(trl_model, policy.tokenizer, tmp_path, theirs, beta, max_len, "group", num_iterations=2)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    inputs = {
        "prompt_ids": batch.input_ids[:, :p_len], "prompt_mask": batch.attention_mask[:, :p_len],
        "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask,
        "advantages": adv, "old_per_token_logps": batch_start, "ref_per_token_logps": ref,
        "importance_sampling_ratio": torch.clamp(torch.exp(batch_start - batch.behaviour_logprobs), max=cap),
    }
    trl_model.train()
    trl_loss = trainer._compute_loss(trl_model, inputs)
    trl_loss.backward()

    assert figures["loss"] == pytest.approx(trl_loss.item(), rel=1e-4, abs=1e-6)
    assert figures["clip_fraction"] > 0  # the policy moved: the clip acts
    assert figures["clip_fraction"] == pytest.approx(trainer._metrics["train"]["clip_ratio/region_mean"][-1],
                                                     rel=1e-5)
    for name, param in trl_model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(our_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


@torch.no_grad()
def _plain_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """The completion logprobs as a full-vocabulary ``log_softmax(logits / temperature)`` (what TRL computes)."""
    t = batch.completion_len
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   use_cache=False).logits[:, -t - 1:-1, :].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)


def _temperature_case(model_dir: Path, tmp_path: Path, sampled_at: float, trained_at: float) -> tuple[float, float]:
    """Our loss with every turn tagged ``trained_at`` against TRL's loss at ``sampled_at`` (its reference and IS
    logprobs from a plain full-vocabulary log-softmax at that temperature); asserts the gradients equal when the
    two temperatures agree."""
    torch.manual_seed(0)
    beta, cap = 0.05, 1.5
    samples = random_samples(groups=2, per_group=4, seed=3)
    for s in samples:
        s.temperature = trained_at
    max_len = max(len(s.completion_ids) for s in samples)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), beta=beta, importance_cap=cap,
                        loss_aggregation="token_mean", micro_batch_size=3, scale_rewards="group", device="cpu")
    policy = load_policy(cfg)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    trl_model = copy.deepcopy(policy.model)
    step = GRPOTrainerStep(policy, cfg)
    assign_advantages(samples, cfg.scale_rewards)
    figures = step.accumulate(samples)
    our_grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}

    batch = collate(samples, policy.pad_id)
    p_len = batch.input_ids.size(1) - batch.completion_len
    rewards = torch.tensor([s.reward for s in samples]).view(-1, 4)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    trainer = _trl_trainer(trl_model, policy.tokenizer, tmp_path, "bnpo", beta, max_len, "group",
                           temperature=sampled_at)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    ref = _plain_logprobs(policy.reference, batch, sampled_at)
    old = _plain_logprobs(trl_model, batch, sampled_at)
    inputs = {
        "prompt_ids": batch.input_ids[:, :p_len], "prompt_mask": batch.attention_mask[:, :p_len],
        "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask,
        "advantages": adv, "old_per_token_logps": None, "ref_per_token_logps": ref,
        "importance_sampling_ratio": torch.clamp(torch.exp(old - batch.behaviour_logprobs), max=cap),
    }
    trl_model.train()
    trl_loss = trainer._compute_loss(trl_model, inputs)
    trl_loss.backward()
    if sampled_at == trained_at:
        for name, param in trl_model.named_parameters():
            torch.testing.assert_close(our_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    return figures["loss"], trl_loss.item()


def test_loss_and_gradients_equal_trl_at_temperature_0_7(model_dir: Path, tmp_path: Path) -> None:
    ours, theirs = _temperature_case(model_dir, tmp_path, sampled_at=0.7, trained_at=0.7)
    assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-6) and abs(theirs) > 1e-3


def test_logprobs_at_the_wrong_temperature_break_the_match(model_dir: Path, tmp_path: Path) -> None:
    """Negative control: turns sampled at 0.7 but trained at 1.0 (the temperature not recorded) do not match."""
    ours, theirs = _temperature_case(model_dir, tmp_path, sampled_at=0.7, trained_at=1.0)
    assert ours != pytest.approx(theirs, rel=1e-2, abs=1e-4)
