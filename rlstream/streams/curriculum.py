"""Curriculum learning over a window of candidate groups: the NAT harness's rule, as a plain function.

Offline (``rlstream finetune``) the window is one epoch's groups and ``epoch`` is the epoch number.
Online (the stream app) the window is the last W candidate groups and ``epoch`` is the policy version,
so the accepted percentile grows every ``expansion_interval`` policy versions. Both call
:func:`select_groups`; nothing here touches Kafka.

The rule (the NeMo Agent Toolkit finetuning harness's curriculum, step for step):

1. disabled: everything passes;
2. drop groups with ``max - min reward < min_reward_diff`` (strict);
3. nothing left: return nothing and leave the state untouched;
4. sort by mean reward, highest first (lowest first with ``sort_ascending``);
5. expand: ``epoch - last_expansion_epoch >= expansion_interval`` and percentile < 1 ->
   ``percentile = min(1, percentile + increment)``, ``last_expansion_epoch = epoch``;
6. keep the first ``max(1, ceil(n * percentile))``; with ``random_subsample`` sample those down to
   ``ceil(n * random_subsample)`` (n = groups left after step 2).

Products like ``10 * 0.3`` are rounded to 9 decimals before ``ceil`` so that 30 % of 10 is 3, not the 4
that binary floating point would give.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Sequence, TypeVar

from rlstream.schemas.config import CurriculumConfig

P = TypeVar("P")
_DECIMALS = 9


@dataclass(frozen=True)
class CurriculumState:
    """Where the curriculum stands: the accepted percentile and when it last grew."""

    percentile: float
    last_expansion_epoch: int = -1

    @classmethod
    def initial(cls, config: CurriculumConfig) -> "CurriculumState":
        return cls(percentile=config.initial_percentile, last_expansion_epoch=-1)

    def to_dict(self) -> dict[str, Any]:
        return {"current_percentile": self.percentile, "last_expansion_epoch": self.last_expansion_epoch}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CurriculumState":
        return cls(percentile=float(data["current_percentile"]), last_expansion_epoch=int(data["last_expansion_epoch"]))


@dataclass(frozen=True)
class Candidate(Generic[P]):
    """One candidate group: its id, its members' rewards and whatever the caller wants back (payload)."""

    group_id: str
    rewards: tuple[float, ...]
    payload: P | None = None

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0

    @property
    def spread(self) -> float:
        return max(self.rewards) - min(self.rewards) if self.rewards else 0.0


@dataclass(frozen=True)
class Selection(Generic[P]):
    """Outcome of one curriculum pass over a window."""

    selected: list[Candidate[P]]
    state: CurriculumState
    percentile: float
    #: rank (0 = first in the curriculum order) of every candidate that survived the variance filter
    ranks: dict[str, int] = field(default_factory=dict)
    dropped_low_variance: list[str] = field(default_factory=list)
    dropped_by_percentile: list[str] = field(default_factory=list)
    dropped_by_subsample: list[str] = field(default_factory=list)
    window_size: int = 0

    @property
    def selected_ids(self) -> set[str]:
        return {c.group_id for c in self.selected}


def keep_count(n: int, fraction: float) -> int:
    """``max(1, ceil(n * fraction))`` with the product rounded against float artefacts (n > 0)."""
    return max(1, math.ceil(round(n * fraction, _DECIMALS)))


def expand(state: CurriculumState, epoch: int, config: CurriculumConfig) -> CurriculumState:
    """Step 5: grow the percentile when ``expansion_interval`` epochs passed since the last growth."""
    if epoch - state.last_expansion_epoch >= config.expansion_interval and state.percentile < 1.0:
        grown = min(1.0, round(state.percentile + config.increment_percentile, _DECIMALS))
        return replace(state, percentile=grown, last_expansion_epoch=epoch)
    return state


def select_groups(
    candidates: Sequence[Candidate[P]],
    state: CurriculumState,
    epoch: int,
    config: CurriculumConfig,
    rng: random.Random | None = None,
) -> Selection[P]:
    """Apply the curriculum to one window of candidates; returns the kept groups and the new state.

    The input order breaks ties (stable sort). ``rng`` drives ``random_subsample`` (a fresh
    ``random.Random()`` when omitted).
    """
    if not config.enabled:
        return Selection(selected=list(candidates), state=state, percentile=1.0,
                         ranks={c.group_id: i for i, c in enumerate(candidates)}, window_size=len(candidates))
    varied = [c for c in candidates if not c.spread < config.min_reward_diff]
    low = [c.group_id for c in candidates if c.spread < config.min_reward_diff]
    if not varied:
        return Selection(selected=[], state=state, percentile=state.percentile, dropped_low_variance=low,
                         window_size=len(candidates))
    ordered = sorted(varied, key=lambda c: c.mean, reverse=not config.sort_ascending)
    new_state = expand(state, epoch, config)
    k = keep_count(len(ordered), new_state.percentile)
    kept, beyond = ordered[:k], ordered[k:]
    subsampled_out: list[str] = []
    if config.random_subsample is not None:
        m = keep_count(len(ordered), config.random_subsample)
        if m < len(kept):
            chosen = set((rng or random.Random()).sample(range(len(kept)), m))
            subsampled_out = [c.group_id for i, c in enumerate(kept) if i not in chosen]
            kept = [c for i, c in enumerate(kept) if i in chosen]
    return Selection(
        selected=kept,
        state=new_state,
        percentile=new_state.percentile,
        ranks={c.group_id: i for i, c in enumerate(ordered)},
        dropped_low_variance=low,
        dropped_by_percentile=[c.group_id for c in beyond],
        dropped_by_subsample=subsampled_out,
        window_size=len(candidates),
    )


def percentile_schedule(config: CurriculumConfig, epochs: int) -> list[float]:
    """The percentile in force at each epoch ``0..epochs-1`` when every epoch has candidates."""
    state, out = CurriculumState.initial(config), []
    for epoch in range(epochs):
        state = expand(state, epoch, config)
        out.append(state.percentile)
    return out


@dataclass
class OnlineCurriculum:
    """The online variant: a sliding window of the last ``window`` candidate groups.

    :meth:`admit` adds a group to the window and says whether the curriculum keeps it, with the
    policy version standing in for the epoch. Serialisable with :meth:`to_dict` (a table value).
    """

    config: CurriculumConfig
    window: int
    state: CurriculumState
    recent: list[tuple[str, tuple[float, ...]]] = field(default_factory=list)

    @classmethod
    def fresh(cls, config: CurriculumConfig, window: int) -> "OnlineCurriculum":
        return cls(config=config, window=window, state=CurriculumState.initial(config))

    def admit(self, group_id: str, rewards: Sequence[float], policy_version: int) -> tuple[bool, Selection[None]]:
        """Slide the window over this group and run :func:`select_groups` on it (seeded by group id)."""
        self.recent = (self.recent + [(group_id, tuple(rewards))])[-self.window:]
        candidates = [Candidate(gid, r) for gid, r in self.recent]
        selection = select_groups(candidates, self.state, policy_version, self.config, random.Random(group_id))
        self.state = selection.state
        return group_id in selection.selected_ids, selection

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state.to_dict(), "recent": [[g, list(r)] for g, r in self.recent]}

    @classmethod
    def from_dict(cls, config: CurriculumConfig, window: int, data: dict[str, Any] | None) -> "OnlineCurriculum":
        if not data:
            return cls.fresh(config, window)
        return cls(config=config, window=window, state=CurriculumState.from_dict(data["state"]),
                   recent=[(str(g), tuple(float(x) for x in r)) for g, r in data["recent"]])
