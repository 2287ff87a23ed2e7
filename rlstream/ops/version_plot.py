"""The reward-per-version plot of an ``rlstream up`` run (``reward_per_version.png``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rlstream.ops.live import LiveFigures


def write_plot(figures: LiveFigures, out: Path, run_id: str) -> Path:
    """Held-out and training reward per policy version, the gate's promotions and rollbacks, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if figures.heldout:
        ax.plot([s.version for s in figures.heldout], [s.reward_mean for s in figures.heldout], "o-",
                label="held-out reward (vLLM, loaded version)")
    train = sorted(figures.group_reward_by_version.items())
    if train:
        ax.plot([v for v, _ in train], [sum(r) / len(r) for _, r in train], "s--", alpha=0.7,
                label="training reward (groups by policy version)")
    if figures.constant_answer is not None:
        answer, reward = figures.constant_answer
        ax.axhline(reward, color="grey", linestyle=":", label=f"best constant answer {answer!r} (format only)")
    _plot_components(ax, figures)
    marks = {"promote": ("tab:green", "promoted"), "finish_canary": ("tab:green", "promoted"),
             "force_promote": ("tab:green", "promoted"), "rollback": ("tab:red", "rolled back")}
    labelled: set[str] = set()
    for kind, version in figures.promotion.marks:
        if kind in marks:
            color, label = marks[kind]
            ax.axvline(version, color=color, alpha=0.35, linewidth=1,
                       label=None if label in labelled else f"{label} (gate)")
            labelled.add(label)
    ax.set_xlabel("policy version")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"rlstream up — {run_id}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_components(ax: Any, figures: LiveFigures) -> None:
    """The held-out reward components per version (task success, tool-call parse rate; answer length on a second
    axis) and what the task's no-skill answers earn, where the task reports them."""
    styles = {"success": ("tab:green", "held-out task success"),
              "tool_call_parsed": ("tab:purple", "held-out tool-call parse rate")}
    for name, (color, label) in styles.items():
        points = [(s.version, s.components[name]) for s in figures.heldout if name in s.components]
        if points:
            ax.plot([v for v, _ in points], [c for _, c in points], "^-", color=color, alpha=0.8, label=label)
    for (name, value), style in zip(figures.task_baselines.items(), (":", "-.", "--")):
        ax.axhline(value, color="grey", linestyle=style, alpha=0.8, label=f"{name} (held-out)")
    unit = next((u for u in ("words", "tokens") if any(f"answer_{u}" in s.components for s in figures.heldout)), None)
    words = [(s.version, s.components[f"answer_{unit}"]) for s in figures.heldout if f"answer_{unit}" in s.components]
    if words:
        twin = ax.twinx()
        twin.plot([v for v, _ in words], [w for _, w in words], "x:", color="tab:brown", alpha=0.6)
        twin.set_ylabel(f"held-out answer length ({unit}, x)", color="tab:brown")
        twin.set_ylim(0, max(w for _, w in words) * 1.2 + 1)
