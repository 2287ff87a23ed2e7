"""Staleness benchmark: the toy task trained on-policy and with rollouts from a policy ``--lag`` versions old, at
equal samples, in one run; held-out reward per step side by side, their ratio, and a plot.

    .venv/bin/python bench/staleness.py [--steps 40] [--lag 4] [--plot docs/staleness.png]

Each step samples ``--prompts`` toy prompts x ``--group-size`` completions (transformers ``generate``, temperature 1,
behaviour logprobs recorded) and makes one learner step (rlstream's ``GRPOTrainerStep``: trajectory-level advantages,
clipped surrogate against the batch-start policy times the importance weight batch-start / behaviour, truncated at
``learner.importance_cap``). On-policy, the behaviour policy is the current one; stale, it is the policy of ``lag``
steps before (as a rollout fleet ``max_policy_lag`` versions behind would produce). The held-out reward is the mean
toy reward of 4 samples on 24 prompts never trained on, every ``--eval-every`` steps.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlstream.learner.batch import Sample  # noqa: E402
from rlstream.learner.policy import Policy  # noqa: E402
from rlstream.learner.step import GRPOTrainerStep  # noqa: E402
from rlstream.ops.toy import (build_tiny_model, held_out_toy_reward, sample_completions, toy_dataset,  # noqa: E402
                              toy_reward)
from rlstream.schemas.config import LearnerConfig, LoraConfig  # noqa: E402

def train(model_dir: Path, lag: int, args: argparse.Namespace) -> list[tuple[int, float]]:
    """Held-out reward per evaluated step of one run whose rollouts come from the policy ``lag`` steps old."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), learning_rate=args.lr,
                        micro_batch_size=args.prompts * args.group_size, total_steps=args.steps, device="cpu")
    policy = Policy(model=model, tokenizer=tokenizer, device=torch.device("cpu"), dtype=torch.float32, lora=False,
                    base_model=str(model_dir))
    trainer = GRPOTrainerStep(policy, cfg)
    train_set, held = toy_dataset(args.steps * args.prompts, seed=1), toy_dataset(24, seed=999)
    versions: deque[Any] = deque([copy.deepcopy(model).eval()], maxlen=lag + 1)  # the last lag+1 policies
    curve = [(0, held_out_toy_reward(model.eval(), tokenizer, held))]
    for step in range(args.steps):
        behaviour = versions[0]  # lag steps old once there are that many (the oldest kept before)
        behaviour_version = step - (len(versions) - 1)
        batch = train_set[step * args.prompts:(step + 1) * args.prompts]
        samples = [Sample(prompt, completion, logprobs, reward=toy_reward(example, text), group=i,
                          policy_version=behaviour_version)
                   for i, (example, (prompt, completions, texts)) in
                   enumerate(zip(batch, sample_completions(behaviour, tokenizer, batch, args.group_size, seed=step)))
                   for (completion, logprobs), text in zip(completions, texts)]
        model.train()
        trainer.step(samples)
        versions.append(copy.deepcopy(model).eval())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, held_out_toy_reward(model.eval(), tokenizer, held)))
            print(f"lag {lag}: step {step + 1}, held-out reward {curve[-1][1]:.3f}", flush=True)
    return curve


def plot(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, curve in curves.items():
        ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o", label=label)
    ax.set_xlabel("learner step (equal samples)")
    ax.set_ylabel("held-out reward")
    ax.set_title("toy task: on-policy vs stale rollouts")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lag", type=int, default=4, help="versions between the behaviour and the trained policy")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (groups) per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=None, help="write the two curves to this PNG")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="rlstream-staleness-")) / "tiny")
    started = time.monotonic()
    curves = {"on-policy": train(model_dir, 0, args), f"lag {args.lag}": train(model_dir, args.lag, args)}
    on_final, stale_final = curves["on-policy"][-1][1], curves[f"lag {args.lag}"][-1][1]
    print(f"\n{'step':>6}{'on-policy':>12}{f'lag {args.lag}':>10}")
    for (step, on), (_, stale) in zip(*curves.values()):
        print(f"{step:>6}{on:>12.3f}{stale:>10.3f}")
    print(json.dumps({"steps": args.steps, "lag": args.lag, "samples_per_step": args.prompts * args.group_size,
                      "on_policy_final": round(on_final, 4), "stale_final": round(stale_final, 4),
                      "stale_over_on_policy": round(stale_final / on_final, 4) if on_final else None,
                      "start": round(curves["on-policy"][0][1], 4), "seconds": round(time.monotonic() - started)}))
    if args.plot:
        plot(curves, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
