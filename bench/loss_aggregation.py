"""Loss aggregation on multi-turn episodes: ``learner.loss_aggregation`` token_mean against trajectory_mean (and
sequence_mean) at equal samples, over several seeds; held-out curves compared (area under the curve).

    .venv/bin/python bench/loss_aggregation.py [--steps 40] [--num-seeds 3] [--aggregations token_mean trajectory_mean]

The model and the reward are ``bench/staleness.py``'s (the tiny Qwen2 with the copy skill, ``toy_strict_reward``, the
main job's learning rate, 8 prompts x 8 samples per step), made multi-turn: an episode of an even-numbered prompt is
one model call, of an odd-numbered one three (after each answer the user repeats the instruction, so the next
call's prompt is the conversation so far). The episode's reward is the mean strict reward of its answers; the turns
of one episode share its advantage (``Sample.trajectory``). Every group holds episodes of one length, so under
``token_mean`` a 3-call group weighs about three times a 1-call group, under ``trajectory_mean`` each episode weighs
the same. The held-out figure is the mean episode reward on the main job's 24 held-out prompts (same rule for the
number of calls; fixed sampling seeds), every ``--eval-every`` steps. One seed fixes the training prompts and every
sampling seed, shared by the aggregations (common random numbers).

The last line is JSON: per aggregation and seed the curve and its area, and per seed the area of each aggregation
over ``token_mean``'s.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rlstream.learner.batch import Sample  # noqa: E402
from rlstream.learner.policy import Policy  # noqa: E402
from rlstream.learner.step import GRPOTrainerStep  # noqa: E402
from rlstream.ops.toy import (COPY_PRETRAIN_STEPS, build_tiny_model, sample_completions, toy_dataset,  # noqa: E402
                              toy_strict_reward)
from rlstream.ops.up_config import HELDOUT_SEED, TOY_DEFAULTS  # noqa: E402
from rlstream.schemas.config import LearnerConfig, LoraConfig  # noqa: E402
from staleness import RunResult  # noqa: E402

AGGREGATIONS = ("token_mean", "trajectory_mean", "sequence_mean", "constant")
_TRAIN_PROMPT_SEED = 20_000
_EVAL_SEED = 321


def calls_of(index: int) -> int:
    """Model calls of the episode of prompt ``index``: 1 for an even index, 3 for an odd one."""
    return 3 if index % 2 else 1


def episodes(model: Any, tokenizer: Any, examples: list[dict[str, Any]], first_index: int, n: int, seed: int,
             max_tokens: int) -> list[list[list[tuple[list[int], list[int], list[float], float]]]]:
    """Per example, ``n`` episodes; an episode is its calls as (prompt ids, completion ids, behaviour logprobs,
    strict reward of the answer)."""
    out = []
    for e, example in enumerate(examples):
        calls = calls_of(first_index + e)
        (prompt, completions, texts), = sample_completions(model, tokenizer, [example], n, seed=seed * 7919 + e,
                                                           max_new_tokens=max_tokens)
        group = []
        for m, ((completion, logprobs), text) in enumerate(zip(completions, texts)):
            episode = [(prompt, completion, logprobs, toy_strict_reward(example, text))]
            messages = list(example["messages"])
            for turn in range(1, calls):
                messages = messages + [{"role": "assistant", "content": text},
                                       {"role": "user", "content": example["prompt"]}]
                (prompt_t, [(completion, logprobs)], [text]), = sample_completions(
                    model, tokenizer, [{"messages": messages}], 1, seed=seed * 7919 + e * 101 + m * 11 + turn,
                    max_new_tokens=max_tokens)
                episode.append((prompt_t, completion, logprobs, toy_strict_reward(example, text)))
            group.append(episode)
        out.append(group)
    return out


def held_out(model: Any, tokenizer: Any, held: list[dict[str, Any]], samples: int, max_tokens: int) -> float:
    """Mean episode reward on ``held`` (``samples`` episodes per prompt, fixed seeds)."""
    groups = episodes(model.eval(), tokenizer, held, 0, samples, _EVAL_SEED, max_tokens)
    rewards = [sum(r for *_, r in ep) / len(ep) for group in groups for ep in group]
    return sum(rewards) / len(rewards)


def train(model_dir: Path, aggregation: str, seed: int, args: argparse.Namespace) -> RunResult:
    """One run's held-out curve under ``aggregation``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), learning_rate=args.lr,
                        num_iterations=args.num_iterations,
                        micro_batch_size=4 * args.prompts * args.group_size, total_steps=args.steps, device="cpu",
                        scale_rewards=TOY_DEFAULTS["learner"]["scale_rewards"], loss_aggregation=aggregation)
    policy = Policy(model=model, tokenizer=tokenizer, device=torch.device("cpu"), dtype=torch.float32, lora=False,
                    base_model=str(model_dir))
    trainer = GRPOTrainerStep(policy, cfg)
    train_set = toy_dataset(args.steps * args.prompts, seed=_TRAIN_PROMPT_SEED + seed)
    held = toy_dataset(args.heldout, seed=HELDOUT_SEED)
    curve = [(0, held_out(model, tokenizer, held, args.eval_samples, args.max_tokens))]
    for step in range(args.steps):
        first = step * args.prompts
        batch = train_set[first:first + args.prompts]
        groups = episodes(model.eval(), tokenizer, batch, first, args.group_size, seed * 1_000_003 + step,
                          args.max_tokens)
        samples = [Sample(prompt_ids=prompt, completion_ids=completion, behaviour_logprobs=logprobs,
                          reward=sum(r for *_, r in ep) / len(ep), group=g, policy_version=step,
                          trajectory=f"{g}-{m}")
                   for g, group in enumerate(groups) for m, ep in enumerate(group)
                   for prompt, completion, logprobs, _ in ep]
        model.train()
        trainer.step(samples)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, held_out(model, tokenizer, held, args.eval_samples, args.max_tokens)))
            print(f"seed {seed} {aggregation}: step {step + 1}, held-out episode reward {curve[-1][1]:.3f}",
                  flush=True)
    return RunResult(curve)


def main() -> None:
    learner, rollout = TOY_DEFAULTS["learner"], TOY_DEFAULTS["rollout"]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=learner["groups_per_step"], help="prompts (groups) per step")
    parser.add_argument("--group-size", type=int, default=rollout["group_size"])
    parser.add_argument("--max-tokens", type=int, default=rollout["max_tokens"])
    parser.add_argument("--lr", type=float, default=learner["learning_rate"])
    parser.add_argument("--num-iterations", type=int, default=1,
                        help="learner.num_iterations (optimizer steps per batch); the recorded runs had 1")
    parser.add_argument("--aggregations", nargs="+", choices=AGGREGATIONS, default=["token_mean", "trajectory_mean"])
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=4, help="episodes per held-out prompt")
    parser.add_argument("--heldout", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlstream-staleness-tiny")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = build_tiny_model(args.model_dir, pretrain_steps=COPY_PRETRAIN_STEPS)
    started = time.monotonic()
    seeds = list(range(args.seed, args.seed + args.num_seeds))
    runs = {agg: {seed: train(model_dir, agg, seed, args) for seed in seeds} for agg in args.aggregations}
    base = args.aggregations[0]
    print(json.dumps({
        "seeds": seeds, "aggregations": args.aggregations, "steps": args.steps, "lr": args.lr,
        "num_iterations": args.num_iterations,
        "samples_per_step": args.prompts * args.group_size,
        "auc": {agg: [round(runs[agg][s].auc, 4) for s in seeds] for agg in args.aggregations},
        "final": {agg: [round(runs[agg][s].final, 4) for s in seeds] for agg in args.aggregations},
        f"auc_over_{base}": {agg: [round(runs[agg][s].auc / runs[base][s].auc, 4) for s in seeds]
                             for agg in args.aggregations[1:]},
        "curves": {agg: [[(step, round(r, 4)) for step, r in runs[agg][s].curve] for s in seeds]
                   for agg in args.aggregations},
        "seconds": round(time.monotonic() - started)}))


if __name__ == "__main__":
    main()
