"""Admission control: keep the rollout from running too far ahead of the learner.

The learner turns ``groups_per_version`` groups into one new version. Groups started now are
trained roughly ``started // groups_per_version`` versions after the run began; if that is more
than ``max_policy_lag`` versions beyond what the learner has published since, their data would be
stale when trained, so the runner waits. It also waits while the served version (the inference
workers') is more than ``max_policy_lag`` behind the version the fleet should serve: the learner's latest, or, where a
promotion gate keeps a serving pointer, that pointer's version (a gate that rejects candidates leaves serving behind
the learner by decision; waiting for it to catch up would stop the rollout, hence the learner, for good).

The count assumes every group started trains. Groups that never do (filtered by the streams worker as zero-variance,
stale or outside the curriculum, skipped by the learner as stale, dead-lettered, or left incomplete by failed
generations) would keep the runner "ahead" for good while the learner waits for data: when the learner says it has
been waiting and none of the runner's groups is on its way, the runner counts from the learner's version again
(:meth:`AdmissionPolicy.resync`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionDecision:
    admit: bool
    reason: str = ""
    #: paused by the count of groups started beyond the learner's progress (the pause a resync can end)
    ahead_of_learner: bool = False


@dataclass
class AdmissionPolicy:
    """The pure rule (no I/O), so it can be reasoned about and tested on its own."""

    max_policy_lag: int
    groups_per_version: int
    base_version: int = 0

    def decide(self, groups_started: int, learner_version: int, served_version: int | None = None,
               serving_pointer: int | None = None) -> AdmissionDecision:
        """Admit a new group or say why not; ``serving_pointer``: the version a gate decided should serve, if any."""
        learner_progress = max(0, learner_version - self.base_version)
        versions_ahead = groups_started // self.groups_per_version - learner_progress
        if versions_ahead > self.max_policy_lag:
            return AdmissionDecision(False, f"{versions_ahead} versions ahead of the learner "
                                            f"(max_policy_lag {self.max_policy_lag})", ahead_of_learner=True)
        target, whose = (serving_pointer, "serving pointer") if serving_pointer is not None else (
            learner_version, "learner")
        if served_version is not None and target - served_version > self.max_policy_lag:
            return AdmissionDecision(False, f"served version {served_version} is more than {self.max_policy_lag} "
                                            f"behind the {whose}'s {target}")
        return AdmissionDecision(True)

    def resync(self, groups_started: int, learner_version: int) -> None:
        """Count from ``learner_version`` as if the ``groups_started`` so far had all trained (none is ahead)."""
        self.base_version = learner_version - groups_started // self.groups_per_version
