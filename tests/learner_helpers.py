"""Helpers shared by the learner tests: the tiny model and synthetic samples/groups."""
from __future__ import annotations

import random
from pathlib import Path

from learner.batch import Sample
from ops.toy import build_tiny_model

_CACHE: dict[str, Path] = {}


def tiny_model(root: Path) -> Path:
    """The tiny Qwen2 under ``root`` (built once per process and directory)."""
    key = str(root)
    if key not in _CACHE:
        _CACHE[key] = build_tiny_model(root / "tiny-qwen2", seed=0)
    return _CACHE[key]


def random_samples(groups: int = 2, per_group: int = 4, seed: int = 0, vocab: int = 1000,
                   with_behaviour: bool = True) -> list[Sample]:
    """Samples with varied prompt/completion lengths, distinct rewards per group and behaviour logprobs."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for _ in range(per_group):
            p = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 7))]
            c = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
            lp = [-rng.uniform(6.0, 7.8) for _ in c] if with_behaviour else None
            out.append(Sample(p, c, lp, reward=rng.random(), group=g, policy_version=0))
    return out
