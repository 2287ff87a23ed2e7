"""Staleness benchmark: the toy task of ``rlstream up`` trained on-policy and with rollouts from a policy ``--lag``
versions old, at equal samples, over several seeds; whole held-out curves compared (area under the curve), a plot.

    .venv/bin/python bench/staleness.py [--steps 40] [--lag 4] [--seed 0 --num-seeds 3] [--plot docs/staleness.png]

The model and the task are the main job's: the tiny Qwen2 given the generic copy skill (``build_tiny_model`` with
``COPY_PRETRAIN_STEPS``), rewarded by ``toy_strict_reward`` (only the prompt's own letter scores; the best constant
answer earns about 1/8), at the main job's learning rate, group size, groups per step, completion length and reward
scaling (``rlstream.ops.up_config.TOY_DEFAULTS``). Each step samples ``--prompts`` training prompts x ``--group-size``
completions (transformers ``generate``, temperature 1, behaviour logprobs recorded) and makes one learner step
(rlstream's ``GRPOTrainerStep``). On-policy, the behaviour policy is the current one; stale, it is the policy of
``lag`` steps before (a rollout fleet ``max_policy_lag`` versions behind). ``--correction`` picks how stale rollouts
are trained (see ``CORRECTIONS``). The held-out reward is the mean strict reward of ``--eval-samples`` samples on the
main job's 24 held-out prompts (fixed sampling seed), every ``--eval-every`` steps.

A seed picks the training prompts and every step's sampling; the on-policy and the stale run of one seed share both
(common random numbers), so their difference is the staleness alone. The last line is JSON: ``lag``, ``seeds``,
per seed ``auc_ratio`` (area under the held-out curve, stale over on-policy), ``gain_ratio`` (the same areas measured
above the shared step-0 level: how much of the on-policy run's gain the stale run keeps; the area ratio is lenient,
since both runs share the start, about 45 % of the on-policy area), ``final_ratio`` and ``on_policy_final``,
``constant_answer`` (the best constant answer's held-out reward), and the correction used. Goal at lag 4, every seed:
``auc_ratio`` >= 0.95 and ``gain_ratio`` >= 0.90.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlstream.learner.batch import Sample  # noqa: E402
from rlstream.learner.policy import Policy  # noqa: E402
from rlstream.learner.step import GRPOTrainerStep  # noqa: E402
from rlstream.ops.toy import (COPY_PRETRAIN_STEPS, best_constant_answer, build_tiny_model,  # noqa: E402
                              sample_completions, toy_dataset, toy_strict_reward)
from rlstream.ops.up_config import HELDOUT_SEED, TOY_DEFAULTS  # noqa: E402
from rlstream.schemas.config import LearnerConfig, LoraConfig  # noqa: E402

#: How stale rollouts are trained. ``tis``: the learner's loss as configured (clipped surrogate against the
#: batch-start policy times the truncated importance weight batch-start / behaviour, ``--importance-cap``).
#: ``mask``: the same with masked importance sampling (``LossConfig.importance_correction="mask"``: tokens whose
#: ratio is outside [``--mask-low``, ``--importance-cap``] get no loss). ``none``: behaviour logprobs withheld, the
#: stale rollouts trained as if on-policy (the control that shows what a correction is worth). ``cispo``: the
#: learner's ``importance_correction="cispo"`` (MiniMax-M1's clipped, detached IS weight; no PPO clip).
#: ``sequence``: the learner's ``importance_correction="sequence"`` (GSPO's geometric-mean ratio, one per turn).
CORRECTIONS = ("tis", "mask", "cispo", "sequence", "none")
_TRAIN_PROMPT_SEED = 10_000  # training prompts of seed s: toy_dataset(..., seed=_TRAIN_PROMPT_SEED + s)
_SAMPLING_SEED_STRIDE = 1_000_003  # sampling seed of step t under seed s: s * stride + t
_EVAL_SAMPLING_SEED = 123


@dataclass(frozen=True)
class RunResult:
    """One training run's held-out curve: (learner step, mean strict reward) pairs, step 0 first."""

    curve: list[tuple[int, float]]

    @property
    def final(self) -> float:
        return self.curve[-1][1]

    @property
    def auc(self) -> float:
        """Area under the curve (trapezoids), divided by the steps spanned: the curve's mean height."""
        area = sum((s1 - s0) * (r0 + r1) / 2 for (s0, r0), (s1, r1) in zip(self.curve, self.curve[1:]))
        return area / max(1, self.curve[-1][0] - self.curve[0][0])


def held_out_strict_reward(model: Any, tokenizer: Any, held: list[dict[str, Any]], samples: int,
                           max_new_tokens: int) -> float:
    """Mean strict toy reward of ``samples`` sampled completions (fixed seed) of each held-out prompt."""
    rewards = [toy_strict_reward(example, text)
               for example, (_, _, texts) in zip(held, sample_completions(
                   model, tokenizer, held, samples, seed=_EVAL_SAMPLING_SEED, max_new_tokens=max_new_tokens))
               for text in texts]
    return sum(rewards) / len(rewards)


def train(model_dir: Path, lag: int, seed: int, args: argparse.Namespace) -> RunResult:
    """Held-out reward per evaluated step of one run whose rollouts come from the policy ``lag`` steps old."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LearnerConfig(model=str(model_dir), lora=LoraConfig(enabled=False), learning_rate=args.lr,
                        micro_batch_size=args.prompts * args.group_size, total_steps=args.steps, device="cpu",
                        scale_rewards=TOY_DEFAULTS["learner"]["scale_rewards"], importance_cap=args.importance_cap,
                        num_iterations=args.num_iterations)
    policy = Policy(model=model, tokenizer=tokenizer, device=torch.device("cpu"), dtype=torch.float32, lora=False,
                    base_model=str(model_dir))
    trainer = GRPOTrainerStep(policy, cfg)
    if args.correction == "mask":
        trainer.loss_cfg = dataclasses.replace(trainer.loss_cfg, importance_correction="mask",
                                               importance_mask_low=args.mask_low)
    elif args.correction in ("cispo", "sequence"):
        trainer.loss_cfg = dataclasses.replace(trainer.loss_cfg, importance_correction=args.correction)
    train_set = toy_dataset(args.steps * args.prompts, seed=_TRAIN_PROMPT_SEED + seed)
    held = toy_dataset(args.heldout, seed=HELDOUT_SEED)
    versions: deque[Any] = deque([copy.deepcopy(model).eval()], maxlen=lag + 1)  # the last lag+1 policies

    def evaluate() -> float:
        return held_out_strict_reward(model.eval(), tokenizer, held, args.eval_samples, args.max_tokens)

    curve = [(0, evaluate())]
    for step in range(args.steps):
        behaviour = versions[0]  # lag steps old once there are that many (the oldest kept before)
        behaviour_version = step - (len(versions) - 1)
        batch = train_set[step * args.prompts:(step + 1) * args.prompts]
        sampled = sample_completions(behaviour, tokenizer, batch, args.group_size,
                                     seed=seed * _SAMPLING_SEED_STRIDE + step, max_new_tokens=args.max_tokens)
        withhold = lag > 0 and args.correction == "none"
        samples = [Sample(prompt_ids=prompt, completion_ids=completion,
                          behaviour_logprobs=None if withhold else logprobs,
                          reward=toy_strict_reward(example, text), group=i, policy_version=behaviour_version)
                   for i, (example, (prompt, completions, texts)) in enumerate(zip(batch, sampled))
                   for (completion, logprobs), text in zip(completions, texts)]
        model.train()
        trainer.step(samples)
        versions.append(copy.deepcopy(model).eval())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, evaluate()))
            print(f"seed {seed} lag {lag}: step {step + 1}, held-out reward {curve[-1][1]:.3f}", flush=True)
    return RunResult(curve)


def gain_ratio(on_policy: RunResult, stale: RunResult) -> float | None:
    """The stale run's area above the shared start over the on-policy run's (None when on-policy gained nothing)."""
    start = on_policy.curve[0][1]
    gained = on_policy.auc - start
    return round((stale.auc - start) / gained, 4) if gained > 0 else None


def cached_train(model_dir: Path, lag: int, seed: int, args: argparse.Namespace) -> RunResult:
    """:func:`train`, read from ``--cache-dir`` when a run of the same settings left its curve there (an on-policy
    run does not depend on ``--correction``, ``--importance-cap`` or ``--mask-low``: its importance weights are 1)."""
    names = ["steps", "prompts", "group_size", "max_tokens", "lr", "eval_every", "eval_samples", "heldout"]
    if args.num_iterations != 1:  # (runs cached before the flag existed had 1)
        names.append("num_iterations")
    if lag > 0:
        names += ["correction", "importance_cap"] + (["mask_low"] if args.correction == "mask" else [])
    settings = {name: getattr(args, name) for name in names}
    key = hashlib.sha256(json.dumps([settings, seed, str(model_dir)], sort_keys=True).encode()).hexdigest()[:16]
    path = args.cache_dir / f"{'on-policy' if lag == 0 else f'lag{lag}'}-{key}.json" if args.cache_dir else None
    if path is not None and path.exists():
        return RunResult([(int(step), float(reward)) for step, reward in json.loads(path.read_text())])
    result = train(model_dir, lag, seed, args)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.curve))
    return result


def plot(runs: dict[int, tuple[RunResult, RunResult]], lag: int, constant: float, title: str, path: Path) -> None:
    """Per seed, the on-policy and the stale curve (thin), their means over seeds (thick), the constant answer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for index, (label, colour) in enumerate((("on-policy", "tab:blue"), (f"lag {lag}", "tab:orange"))):
        curves = [pair[index].curve for pair in runs.values()]
        for curve in curves:
            ax.plot([s for s, _ in curve], [r for _, r in curve], color=colour, alpha=0.3, linewidth=1)
        steps = [s for s, _ in curves[0]]
        mean = [sum(c[i][1] for c in curves) / len(curves) for i in range(len(steps))]
        ax.plot(steps, mean, color=colour, marker="o", linewidth=2, label=f"{label} (mean of {len(curves)} seeds)")
    ax.axhline(constant, color="grey", linestyle="--", linewidth=1, label=f"best constant answer {constant:.2f}")
    ax.set_xlabel("learner step (equal samples)")
    ax.set_ylabel("held-out strict reward")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    learner, rollout = TOY_DEFAULTS["learner"], TOY_DEFAULTS["rollout"]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lag", type=int, default=4, help="versions between the behaviour and the trained policy")
    parser.add_argument("--prompts", type=int, default=learner["groups_per_step"], help="prompts (groups) per step")
    parser.add_argument("--group-size", type=int, default=rollout["group_size"])
    parser.add_argument("--max-tokens", type=int, default=rollout["max_tokens"])
    parser.add_argument("--lr", type=float, default=learner["learning_rate"])
    parser.add_argument("--correction", choices=CORRECTIONS, default="tis", help="how stale rollouts are trained")
    parser.add_argument("--importance-cap", type=float, default=LearnerConfig.model_fields["importance_cap"].default,
                        help="learner.importance_cap: truncation of the importance weight batch-start / behaviour")
    parser.add_argument("--mask-low", type=float, default=0.5, help="--correction mask: the smallest ratio kept")
    parser.add_argument("--num-iterations", type=int, default=LearnerConfig.model_fields["num_iterations"].default,
                        help="learner.num_iterations: optimizer steps per batch, on-policy and stale alike (from the "
                        "second one the PPO clip acts against the batch-start policy: AReaL's decoupled objective); "
                        "default the learner's (3); runs recorded without the flag before 2026-11-28 had 1")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt")
    parser.add_argument("--heldout", type=int, default=24, help="held-out prompts (the main job's set)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (training prompts and sampling)")
    parser.add_argument("--num-seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlstream-staleness-tiny",
                        help="where the copy-pretrained tiny model is built (reused when already there)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="keep each run's curve here and reuse it in later runs of the same settings")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = build_tiny_model(args.model_dir, pretrain_steps=COPY_PRETRAIN_STEPS)
    _, constant = best_constant_answer(toy_dataset(args.heldout, seed=HELDOUT_SEED), toy_strict_reward)
    started = time.monotonic()
    seeds = list(range(args.seed, args.seed + args.num_seeds))
    runs = {seed: (cached_train(model_dir, 0, seed, args), cached_train(model_dir, args.lag, seed, args))
            for seed in seeds}
    for seed, (on, stale) in runs.items():
        print(f"\nseed {seed}\n{'step':>6}{'on-policy':>12}{f'lag {args.lag}':>10}")
        for (step, on_reward), (_, stale_reward) in zip(on.curve, stale.curve):
            print(f"{step:>6}{on_reward:>12.3f}{stale_reward:>10.3f}")
    if args.plot:
        title = (f"toy task (strict reward), lr {args.lr:g}, {args.prompts}x{args.group_size} samples/step, "
                 f"correction {args.correction}")
        plot(runs, args.lag, constant, title, args.plot)
        print(f"plot: {args.plot}")
    print(json.dumps({
        "lag": args.lag, "seeds": seeds, "correction": args.correction, "importance_cap": args.importance_cap,
        "mask_low": args.mask_low if args.correction == "mask" else None, "lr": args.lr, "steps": args.steps,
        "num_iterations": args.num_iterations,
        "samples_per_step": args.prompts * args.group_size,
        "auc_ratio": [round(stale.auc / on.auc, 4) if on.auc else None for on, stale in runs.values()],
        "gain_ratio": [gain_ratio(on, stale) for on, stale in runs.values()],
        "final_ratio": [round(stale.final / on.final, 4) if on.final else None for on, stale in runs.values()],
        "on_policy_final": [round(on.final, 4) for on, _ in runs.values()],
        "stale_final": [round(stale.final, 4) for _, stale in runs.values()],
        "on_policy_auc": [round(on.auc, 4) for on, _ in runs.values()],
        "stale_auc": [round(stale.auc, 4) for _, stale in runs.values()],
        "on_policy_curves": [[(step, round(r, 4)) for step, r in on.curve] for on, _ in runs.values()],
        "stale_curves": [[(step, round(r, 4)) for step, r in stale.curve] for _, stale in runs.values()],
        "start": round(next(iter(runs.values()))[0].curve[0][1], 4),
        "constant_answer": round(constant, 4), "seconds": round(time.monotonic() - started)}))


if __name__ == "__main__":
    main()
