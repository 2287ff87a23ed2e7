"""The promotion gate: evaluates candidates against the serving version, runs canaries, promotes, rejects and rolls
back (docs/gate.md). ``run_gate(cfg)`` is the service."""
from __future__ import annotations

from rlstream.gate.rules import DecisionRule, EvalFigures, Verdict, judge, next_anchor
from rlstream.gate.sequential import RewardStats, SequentialOutcome, SprtSettings, sprt

__all__ = ["DecisionRule", "EvalFigures", "RewardStats", "SequentialOutcome", "SprtSettings", "Verdict", "judge",
           "next_anchor", "sprt", "run_gate"]


def __getattr__(name: str) -> object:
    if name == "run_gate":  # the service pulls in Kafka clients: imported when asked for
        from rlstream.gate.service import run_gate

        return run_gate
    raise AttributeError(name)
