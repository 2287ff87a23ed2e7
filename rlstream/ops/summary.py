"""The summary of an ``rlstream up`` run (``summary.json``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rlstream.ops.live import LiveFigures


def summarize(figures: LiveFigures, run_id: str, run_dir: Path, config_path: Path, plot: Path | None,
              topic_ends: dict[str, int] | None = None) -> dict[str, Any]:
    """The run's summary.json: where its files are and its figures at the end."""
    scores = figures.heldout
    first = scores[0].reward_mean if scores else None
    best_last = scores[-1].reward_mean if scores else None
    return {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "config": str(config_path),
        "plot": str(plot) if plot else None,
        "latest_version": figures.latest_version,
        "loaded": figures.loaded,
        "groups": figures.groups_seen,
        "baseline_groups": figures.baseline_groups,
        "users": figures.users,
        "dlq": figures.dlq_count,
        "filtered": figures.filtered,
        "heldout": [{"version": s.version, "model": s.model, "reward_mean": s.reward_mean, "samples": s.samples,
                     **({"components": s.components} if s.components else {})} for s in scores],
        "heldout_first": first,
        "heldout_last": best_last,
        "heldout_gain": (best_last - first) if scores else None,
        "heldout_components_first": scores[0].components if scores else None,
        "heldout_components_last": scores[-1].components if scores else None,
        "task_baselines": figures.task_baselines,
        "best_constant_answer": ({"answer": figures.constant_answer[0], "reward_mean": figures.constant_answer[1]}
                                 if figures.constant_answer is not None else None),
        "training_reward_by_version": {str(v): sum(r) / len(r) for v, r in sorted(figures.group_reward_by_version.items())},
        "promotion": figures.promotion.summary(),
        "engine_restarts": [event.summary() for event in figures.engine_restarts],
        "topic_end_offsets": topic_ends or {},
        "checkpoints": str(run_dir / "learner"),
        "logs": str(run_dir / "logs"),
    }
