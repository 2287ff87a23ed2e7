"""NAT's curriculum across the epochs of one finetuning run: its state, the latest selection, and what
``curriculum_state.json`` / ``training_metrics.jsonl`` say about it (shared by rlstream's and the NAT trainer)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from rlstream.finetune.outputs import curriculum_document
from rlstream.schemas.config import CurriculumConfig
from rlstream.streams.curriculum import Candidate, CurriculumState, Selection, select_groups

#: the curriculum_state keys repeated in every training_metrics.jsonl line when the curriculum is enabled
SUMMARY_KEYS = ("current_percentile", "last_expansion_epoch", "total_groups", "included_groups")


@dataclass
class EpochCurriculum:
    """Applies :func:`rlstream.streams.curriculum.select_groups` epoch after epoch."""

    config: CurriculumConfig
    seed: int = 0
    state: CurriculumState = field(init=False)
    selection: Selection[int] | None = None

    def __post_init__(self) -> None:
        self.state = CurriculumState.initial(self.config)
        self._rng = random.Random(self.seed)

    def select(self, group_ids: Sequence[str], rewards: Sequence[Sequence[float]], epoch: int) -> list[int]:
        """Indices of the groups this epoch keeps, in curriculum order (a group without rewards is not a
        candidate)."""
        candidates = [Candidate(gid, tuple(r), i) for i, (gid, r) in enumerate(zip(group_ids, rewards)) if r]
        self.selection = select_groups(candidates, self.state, epoch, self.config, self._rng)
        self.state = self.selection.state
        return [c.payload for c in self.selection.selected if c.payload is not None]

    @property
    def percentile(self) -> float:
        """The share of groups the latest epoch kept (1.0 before the first one)."""
        return self.selection.percentile if self.selection is not None else 1.0

    def document(self) -> dict[str, Any]:
        """curriculum_state.json."""
        sel = self.selection
        return curriculum_document(
            self.state.percentile if self.config.enabled else 1.0, self.state.last_expansion_epoch,
            len(sel.ranks) if sel is not None else 0, sorted(c.group_id for c in sel.selected) if sel else [],
            self.config.model_dump(mode="json"))

    def summary(self) -> dict[str, Any] | None:
        """The ``curriculum_state`` of a training_metrics.jsonl line (None when the curriculum is off)."""
        if not self.config.enabled:
            return None
        doc = self.document()
        return {k: doc[k] for k in SUMMARY_KEYS}
