"""``rlstream finetune``: one epoch engine over rlstream's Kafka pipeline, under ``rlstream finetune`` (rlstream's
config) and the NeMo Agent Toolkit plugin (:mod:`rlstream.nat`).

Public API (what :mod:`rlstream.nat` builds on): :class:`EpochEngine` with :class:`EngineSettings`, the
:class:`EpochGenerator` protocol and the :class:`CandidateGroup` / :class:`Generation` it hands over,
:class:`TrainingOutcome`, and the run's services (:class:`FinetuneContext`, :func:`prepare`).
"""
from rlstream.finetune.engine import (CandidateGroup, EngineSettings, EpochEngine, EpochGenerator, Generation,
                                      OutcomeStatus, Rejection, TrainingOutcome, checked_groups, trajectory_problem)
from rlstream.finetune.runtime import (FinetuneContext, FinetuneError, Infrastructure, fresh_run_id, prepare,
                                       server_root, wait_endpoint)

__all__ = [
    "CandidateGroup", "EngineSettings", "EpochEngine", "EpochGenerator", "FinetuneContext", "FinetuneError",
    "Generation", "Infrastructure", "OutcomeStatus", "Rejection", "TrainingOutcome", "fresh_run_id", "prepare",
    "checked_groups", "trajectory_problem", "server_root", "wait_endpoint",
]
