"""The files ``rlstream finetune`` writes in ``finetuning.output_dir`` (the NAT harness's names and keys).

* ``training_metrics.jsonl``: one line per epoch (:data:`EPOCH_KEYS`, plus ``curriculum_state`` when the
  curriculum is enabled);
* ``reward_history.json``: list of :data:`REWARD_KEYS` entries;
* ``validation_history.json``: list of :data:`VALIDATION_KEYS` entries;
* ``curriculum_state.json``: :data:`CURRICULUM_KEYS`;
* ``reward_plot.png``: training mean reward, filtered mean reward, validation reward per epoch, and the
  curriculum percentile on a second axis.

Every JSON file is rewritten atomically after each epoch, so a crashed run leaves the epochs it finished.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

TRAINING_METRICS = "training_metrics.jsonl"
REWARD_HISTORY = "reward_history.json"
VALIDATION_HISTORY = "validation_history.json"
CURRICULUM_STATE = "curriculum_state.json"
REWARD_PLOT = "reward_plot.png"

EPOCH_KEYS = ("epoch", "timestamp", "run_id", "avg_reward", "min_reward", "max_reward", "num_trajectories",
              "num_groups", "filtered_trajectories", "filtered_groups", "filtered_avg_reward", "filtered_min_reward",
              "filtered_max_reward", "curriculum_percentile")
REWARD_KEYS = ("epoch", "timestamp", "avg_reward", "min_reward", "max_reward", "num_trajectories")
VALIDATION_KEYS = ("epoch", "timestamp", "avg_reward", "min_reward", "max_reward", "num_examples")
CURRICULUM_KEYS = ("current_percentile", "last_expansion_epoch", "total_groups", "included_groups", "config")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def reward_stats(rewards: Sequence[float]) -> tuple[float, float, float]:
    """(mean, min, max); zeros when there is no reward."""
    if not rewards:
        return 0.0, 0.0, 0.0
    return sum(rewards) / len(rewards), min(rewards), max(rewards)


def validation_record(epoch: int, rewards: Sequence[float]) -> dict[str, Any]:
    """A validation_history.json entry."""
    avg, lo, hi = reward_stats(rewards)
    return {"epoch": epoch, "timestamp": now_iso(), "avg_reward": avg, "min_reward": lo, "max_reward": hi,
            "num_examples": len(rewards)}


def epoch_record(epoch: int, run_id: str, groups: Sequence[Sequence[float]], kept: Sequence[Sequence[float]],
                 percentile: float, curriculum_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """A training_metrics.jsonl line from the rewards of the epoch's groups and of the groups kept."""
    every = [r for g in groups for r in g]
    chosen = [r for g in kept for r in g]
    avg, lo, hi = reward_stats(every)
    f_avg, f_lo, f_hi = reward_stats(chosen)
    record: dict[str, Any] = {
        "epoch": epoch, "timestamp": now_iso(), "run_id": run_id, "avg_reward": avg, "min_reward": lo,
        "max_reward": hi, "num_trajectories": len(every), "num_groups": len(groups),
        "filtered_trajectories": len(chosen), "filtered_groups": len(kept), "filtered_avg_reward": f_avg,
        "filtered_min_reward": f_lo, "filtered_max_reward": f_hi, "curriculum_percentile": percentile,
    }
    if curriculum_state is not None:
        record["curriculum_state"] = curriculum_state
    return record


def reward_entry(record: dict[str, Any]) -> dict[str, Any]:
    """The reward_history.json entry of an epoch record."""
    return {k: record[k] for k in REWARD_KEYS}


def curriculum_document(percentile: float, last_expansion_epoch: int, total_groups: int,
                        included_groups: Sequence[str], config: dict[str, Any]) -> dict[str, Any]:
    """curriculum_state.json: the state after the latest epoch; ``total_groups`` and ``included_groups`` are
    that epoch's groups past the variance filter and the ids the curriculum kept."""
    return {"current_percentile": percentile, "last_expansion_epoch": last_expansion_epoch,
            "total_groups": total_groups, "included_groups": list(included_groups), "config": config}


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


@dataclass
class FinetuneOutputs:
    """Accumulates the run's records and keeps the files in ``output_dir`` current."""

    output_dir: Path
    epochs: list[dict[str, Any]] = field(default_factory=list)
    validations: list[dict[str, Any]] = field(default_factory=list)
    curriculum: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / TRAINING_METRICS).write_text("")
        write_json(self.output_dir / REWARD_HISTORY, [])
        write_json(self.output_dir / VALIDATION_HISTORY, [])

    def add_epoch(self, record: dict[str, Any]) -> None:
        self.epochs.append(record)
        with open(self.output_dir / TRAINING_METRICS, "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")
        write_json(self.output_dir / REWARD_HISTORY, [reward_entry(r) for r in self.epochs])

    def add_validation(self, record: dict[str, Any]) -> None:
        self.validations.append(record)
        write_json(self.output_dir / VALIDATION_HISTORY, self.validations)

    def set_curriculum(self, document: dict[str, Any]) -> None:
        self.curriculum = document
        write_json(self.output_dir / CURRICULUM_STATE, document)

    def plot(self, title: str = "") -> Path:
        return write_reward_plot(self.output_dir / REWARD_PLOT, self.epochs, self.validations, title)


Series = dict[str, tuple[list[Any], list[float]]]


def plot_series(epochs: Sequence[dict[str, Any]], validations: Sequence[dict[str, Any]]) -> Series:
    """The lines of reward_plot.png, by label: (epochs, values). The percentile goes on the second axis."""
    kept = [r for r in epochs if r["filtered_groups"]]
    series = {
        "training mean reward": ([r["epoch"] for r in epochs], [r["avg_reward"] for r in epochs]),
        "filtered mean reward (trained on)": ([r["epoch"] for r in kept], [r["filtered_avg_reward"] for r in kept]),
        "validation mean reward": ([r["epoch"] for r in validations], [r["avg_reward"] for r in validations]),
        PERCENTILE_LABEL: ([r["epoch"] for r in epochs], [r["curriculum_percentile"] for r in epochs]),
    }
    return {label: xy for label, xy in series.items() if xy[0]}


PERCENTILE_LABEL = "curriculum percentile"
_STYLES = {"training mean reward": "o-", "filtered mean reward (trained on)": "s--", "validation mean reward": "^-"}


def write_reward_plot(path: Path, epochs: Sequence[dict[str, Any]], validations: Sequence[dict[str, Any]],
                      title: str = "") -> Path:
    """Training mean reward, filtered mean reward and validation reward per epoch; curriculum percentile on a
    second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    second = ax.twinx()
    for label, (xs, ys) in plot_series(epochs, validations).items():
        if label == PERCENTILE_LABEL:
            second.plot(xs, ys, ":", color="grey", label=label)
        else:
            ax.plot(xs, ys, _STYLES[label], label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    second.set_ylabel(PERCENTILE_LABEL)
    second.set_ylim(0, 1.05)
    lines, labels = ax.get_legend_handles_labels()
    more_lines, more_labels = second.get_legend_handles_labels()
    ax.legend(lines + more_lines, labels + more_labels, loc="lower right", fontsize="small")
    ax.set_title(title or "rlstream finetune")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
