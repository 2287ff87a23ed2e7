"""Gate decisions benchmark: error rates of the promotion gate's real decision code, by simulation.

    .venv/bin/python bench/gate_decisions.py [--trials 1000] [--ratchet-runs 300] [--canary-trials 400] [--seed 0]

Offline decisions run ``rlstream.gate.rules.judge`` and ``next_anchor`` (the paired non-inferiority tests of
``rlstream.gate.statistics``) at the gate's defaults (``GateConfig``: margin, alpha, power, the sample size that power
asks for at ``gate.difference_std``, cut to the 24 held-out prompts ``rlstream up`` uses x at most ``gate.samples``).
Canaries run ``rlstream.gate.sequential.sprt`` with the ``gate.canary_*`` defaults, checked after every canary
reward; rewards reach the canary at ``gate.canary_share`` (0.1 when that is 0) of the traffic.

Reward distributions. The recorded runs (bench/results/2026-11-25-promotion-gate.md, 2026-11-25-tool-agent.md) hold
held-out means, not per-sample distributions, so the distributions are derived from those means:

* ``toy``: the toy task's held-out means were 0.26-0.56; its reward is a share in [0, 1], modelled as
  Bernoulli(0.5): the largest variance a reward in [0, 1] can have (a worse version: Bernoulli(0.5 - d)).
* ``tool_agent``: the verifier's credits (parsed call 0.2, right call 0.3, right answer 0.5) at version 13's figures
  (reward 0.803, task success 0.719, tool-call parse rate 1.000): reward 1.0 with probability 0.719, 0.5 with 0.093,
  0.2 with 0.188 (mean 0.803); a worse version moves probability from 1.0 to 0.2 (d / 0.8 of it).

Pairing: each (example, sample) has one seed; each version follows the seed's uniform draw with probability
sqrt(0.5) (through its own quantile function), else draws its own, so two versions answer it alike with probability
0.5 (paired reward differences of the toy task: std 0.5). Guards (answers and tool calls that parse,
refusals, length) are equal for both versions.

Scenarios, each decided by the real code: ``false_promotion`` (candidate worse by the margin: share promoted),
``false_rejection`` (candidate as good: share rejected), ``ratchet_drop`` (ten candidates in a row, each half a
margin worse than the serving version of its decision; the serving and anchor figures measured fresh for each; the
mean true loss of serving after the ten), ``canary_false_rollback`` (equal canary: share rolled back),
``canary_power`` (canary worse by the margin: share rolled back). ``baseline`` is the rule the gate had before, in
the same run: promote when the candidate's mean is at least the serving version's minus 0.05, on 24 prompts x 2
samples, the serving figure measured once and kept. The top-level figures are the worse of the two tasks. The
output is one JSON line.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlstream.gate.rules import DecisionRule, EvalFigures, SampleResult, judge, next_anchor  # noqa: E402
from rlstream.gate.sequential import RewardStats, SequentialOutcome, SprtSettings, sprt  # noqa: E402
from rlstream.gate.service import evaluation_plan  # noqa: E402
from rlstream.gate.statistics import sample_size  # noqa: E402
from rlstream.schemas.config import GateConfig  # noqa: E402

#: The held-out prompts ``rlstream up`` gives the gate.
HELDOUT_PROMPTS = 24
#: Probability that two versions answer one seeded (example, sample) alike; each version follows the seed's own draw
#: with probability sqrt(SAME_PATH).
SAME_PATH = 0.5
FOLLOWS_SEED = math.sqrt(SAME_PATH)
#: The rule before the statistical tests: point comparison on 24 x 2 samples, tolerance 0.05.
OLD_TOLERANCE, OLD_SAMPLES = 0.05, 24 * 2


@dataclass(frozen=True)
class Discrete:
    """A discrete reward distribution (values ascending, probabilities summing to 1)."""

    values: tuple[float, ...]
    probs: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(v * p for v, p in zip(self.values, self.probs))

    def quantile(self, u: float) -> float:
        cumulative, total = [], 0.0
        for p in self.probs:
            total += p
            cumulative.append(total)
        return self.values[min(bisect.bisect_right(cumulative, u), len(self.values) - 1)]


def toy(loss: float) -> Discrete:
    p = 0.5 - loss
    return Discrete((0.0, 1.0), (1 - p, p))


def tool_agent(loss: float) -> Discrete:
    moved = loss / 0.8
    return Discrete((0.2, 0.5, 1.0), (0.188 + moved, 0.093, 0.719 - moved))


TASKS: dict[str, Callable[[float], Discrete]] = {"toy": toy, "tool_agent": tool_agent}


def measure(version: int, dist: Discrete, seeds: list[float], rng: random.Random) -> EvalFigures:
    """One version's figures on the seeded samples ``seeds`` (one shared uniform per sample)."""
    results = []
    for i, u in enumerate(seeds):
        draw = u if rng.random() < FOLLOWS_SEED else rng.random()
        results.append(SampleResult(key=f"e{i}", reward=dist.quantile(draw), parses=True, refusal=False, length=8,
                                    tool_calls=1, tool_calls_parsed=1))
    n = len(results)
    return EvalFigures(version=version, reward_mean=sum(r.reward for r in results) / n, answer_parse_rate=1.0,
                       tool_call_parse_rate=1.0, refusal_rate=0.0, answer_length=8.0, samples=n, tool_calls=n,
                       results=tuple(results))


def new_decision(candidate: Discrete, serving: Discrete, anchor: Discrete | None, n: int, rule: DecisionRule,
                 rng: random.Random) -> tuple[bool, bool]:
    """(promoted, the candidate becomes the anchor) by the gate's judge, all versions measured now."""
    seeds = [rng.random() for _ in range(n)]
    c, s = measure(2, candidate, seeds, rng), measure(1, serving, seeds, rng)
    a = measure(0, anchor, seeds, rng) if anchor is not None else None
    verdict = judge(c, s, rule, a)
    anchor_version = 0 if anchor is not None else 1
    return verdict.promote, next_anchor(verdict, 2, anchor_version) == 2


def old_promotes(candidate_mean: float, serving_mean: float) -> bool:
    return candidate_mean >= serving_mean - OLD_TOLERANCE


def sample_mean(dist: Discrete, n: int, rng: random.Random) -> float:
    return sum(dist.quantile(rng.random()) for _ in range(n)) / n


def offline(task: Callable[[float], Discrete], n: int, rule: DecisionRule, trials: int, runs: int,
            rng: random.Random) -> tuple[dict[str, float], dict[str, float]]:
    """The new rule's and the old rule's offline figures for one task."""
    m = rule.margin
    new_fp = sum(new_decision(task(m), task(0.0), None, n, rule, rng)[0] for _ in range(trials)) / trials
    new_fr = sum(not new_decision(task(0.0), task(0.0), None, n, rule, rng)[0] for _ in range(trials)) / trials
    old_fp = sum(old_promotes(sample_mean(task(m), OLD_SAMPLES, rng), sample_mean(task(0.0), OLD_SAMPLES, rng))
                 for _ in range(trials)) / trials
    old_fr = sum(not old_promotes(sample_mean(task(0.0), OLD_SAMPLES, rng), sample_mean(task(0.0), OLD_SAMPLES, rng))
                 for _ in range(trials)) / trials
    new_drops, old_drops = [], []
    for _ in range(runs):
        serving, anchor = 0.0, 0.0  # true losses against the start
        for _ in range(10):
            candidate = serving + m / 2
            promoted, becomes_anchor = new_decision(task(candidate), task(serving),
                                                    task(anchor) if anchor != serving else None, n, rule, rng)
            if promoted:
                if becomes_anchor:
                    anchor = candidate
                serving = candidate
        new_drops.append(serving)
        serving = 0.0
        cached = sample_mean(task(serving), OLD_SAMPLES, rng)  # measured once, kept
        for _ in range(10):
            candidate = serving + m / 2
            figure = sample_mean(task(candidate), OLD_SAMPLES, rng)
            if old_promotes(figure, cached):
                serving, cached = candidate, figure
        old_drops.append(serving)
    return ({"false_promotion": new_fp, "false_rejection": new_fr, "ratchet_drop": sum(new_drops) / runs},
            {"false_promotion": old_fp, "false_rejection": old_fr, "ratchet_drop": sum(old_drops) / runs})


def canary(task: Callable[[float], Discrete], loss: float, settings: SprtSettings, share: float, trials: int,
           rng: random.Random) -> float:
    """Share of canaries (``loss`` worse than serving) the sequential test rolls back."""
    rollbacks = 0
    canary_dist, serving_dist = task(loss), task(0.0)
    for _ in range(trials):
        c, s = RewardStats(), RewardStats()
        while True:
            if rng.random() < share:
                c.add(canary_dist.quantile(rng.random()))
                state = sprt(c, s, settings)
                if state.outcome != SequentialOutcome.wait:
                    rollbacks += state.outcome == SequentialOutcome.rollback
                    break
            else:
                s.add(serving_dist.quantile(rng.random()))
    return rollbacks / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=1000, help="offline decisions per scenario and task")
    parser.add_argument("--ratchet-runs", type=int, default=300, help="chains of ten candidates per task")
    parser.add_argument("--canary-trials", type=int, default=1000, help="canaries per scenario and task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    g = GateConfig()
    rule = DecisionRule(margin=g.margin, alpha=g.alpha, parse_margin=g.parse_margin,
                        tool_call_margin=g.tool_call_margin, refusal_margin=g.refusal_margin,
                        success_margin=g.success_margin, length_tolerance=g.length_tolerance,
                        min_reward=g.min_reward)
    needed = sample_size(g.difference_std, g.margin, g.alpha, g.power)
    plan = evaluation_plan(needed, HELDOUT_PROMPTS, g.samples)
    n = plan.pairs
    settings = SprtSettings(alpha=g.canary_alpha, beta=g.canary_beta, delta=g.canary_min_effect,
                            min_samples=g.canary_min_samples, max_samples=g.canary_max_samples)
    share = g.canary_share or 0.1
    rng = random.Random(args.seed)
    started = time.monotonic()
    tasks: dict[str, dict[str, float]] = {}
    baseline: dict[str, dict[str, float]] = {}
    for name, task in TASKS.items():
        new, old = offline(task, n, rule, args.trials, args.ratchet_runs, rng)
        new["canary_false_rollback"] = canary(task, 0.0, settings, share, args.canary_trials, rng)
        new["canary_power"] = canary(task, g.margin, settings, share, args.canary_trials, rng)
        tasks[name], baseline[name] = new, old

    def worst(figures: dict[str, dict[str, float]], key: str, high_is_bad: bool = True) -> float:
        values = [f[key] for f in figures.values()]
        return round(max(values) if high_is_bad else min(values), 4)

    out = {
        "false_promotion": worst(tasks, "false_promotion"), "false_rejection": worst(tasks, "false_rejection"),
        "ratchet_drop": worst(tasks, "ratchet_drop"), "canary_false_rollback": worst(tasks, "canary_false_rollback"),
        "canary_power": worst(tasks, "canary_power", high_is_bad=False), "eval_samples": n, "margin": g.margin,
        "alpha": g.alpha, "power": g.power, "difference_std": g.difference_std, "needed_samples": needed,
        "plan": {"examples": plan.examples, "samples": plan.samples},
        "canary": {"alpha": settings.alpha, "beta": settings.beta, "delta": settings.delta, "share": share,
                   "min_samples": settings.min_samples, "max_samples": settings.max_samples},
        "tasks": {k: {m: round(v, 4) for m, v in f.items()} for k, f in tasks.items()},
        "baseline": {"rule": f"candidate mean >= serving mean - {OLD_TOLERANCE}, {OLD_SAMPLES} samples, serving "
                             "figure kept", "eval_samples": OLD_SAMPLES,
                     "false_promotion": worst(baseline, "false_promotion"),
                     "false_rejection": worst(baseline, "false_rejection"),
                     "ratchet_drop": worst(baseline, "ratchet_drop"),
                     "tasks": {k: {m: round(v, 4) for m, v in f.items()} for k, f in baseline.items()}},
        "trials": {"offline": args.trials, "ratchet_runs": args.ratchet_runs, "canary": args.canary_trials,
                   "seed": args.seed},
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
