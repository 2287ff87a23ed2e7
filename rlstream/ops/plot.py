"""``rlstream plot --run RUN``: reward, validation and curriculum curves from the ``metrics`` topic.

Reads the names of :mod:`rlstream.transport.metric_names` (``reward_mean``, ``reward_mean_filtered``,
``validation/reward_mean``, ``curriculum/percentile``) for one run. The x axis is the event's
``step`` (policy version online, epoch in finetune); several events at one step are averaged,
one line per (metric, source). An event without a step is placed after the last step seen.
The curriculum percentile is drawn on a second y axis.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.transport import metric_names as mn
from rlstream.transport.log import get_logger
from rlstream.transport.topic_reader import TopicReader, open_reader, read_to_end
from rlstream.schemas.codec import codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import MetricEvent
from rlstream.schemas.topics import TopicNames

log = get_logger(__name__)


class NoMetricsError(RuntimeError):
    """The metrics topic holds none of the plotted figures for that run."""


@dataclass
class Series:
    """Mean value per step of one (metric name, source)."""

    name: str
    source: str
    points: dict[int, list[float]] = field(default_factory=dict)

    def add(self, step: int, value: float) -> None:
        self.points.setdefault(step, []).append(value)

    def xy(self) -> tuple[list[int], list[float]]:
        steps = sorted(self.points)
        return steps, [sum(self.points[s]) / len(self.points[s]) for s in steps]


@dataclass
class RunMetrics:
    run_id: str
    series: dict[tuple[str, str], Series] = field(default_factory=dict)
    step_kind: str | None = None
    decisions: list[tuple[str, int]] = field(default_factory=list)  # the promotion gate's (decision, version)

    def of(self, name: str) -> list[Series]:
        return [s for (n, _), s in sorted(self.series.items()) if n == name]

    @property
    def empty(self) -> bool:
        return not self.series


async def load_run_metrics(cfg: RlstreamConfig, run_id: str) -> RunMetrics:
    """The plotted metric series of ``run_id``, read from the beginning of the metrics topic."""
    codec = codec_for(cfg)
    topic = TopicNames.from_config(cfg.topics).metrics
    events: list[MetricEvent] = []
    reader = await open_reader(cfg.kafka)
    try:
        metrics = TopicReader(reader, codec, MetricEvent)  # read-only: an undecodable record is skipped
        async for item in metrics.stream(read_to_end(reader, topic)):
            event = item.event
            if event.run_id == run_id and (event.name in mn.PLOTTED or event.name == mn.GATE_DECISIONS):
                events.append(event)
    finally:
        await reader.stop()
    return metrics_from_events(run_id, events)


def metrics_from_events(run_id: str, events: list[MetricEvent]) -> RunMetrics:
    """Group events into per-step series (events without a step go after the last step of their series)."""
    out = RunMetrics(run_id)
    kinds = defaultdict(int)
    for event in sorted(events, key=lambda e: e.ts):
        if event.name == mn.GATE_DECISIONS:
            if event.step is not None:
                out.decisions.append((event.tags.get("decision", ""), event.step))
            continue
        series = out.series.setdefault((event.name, event.source), Series(event.name, event.source))
        step = event.step
        if step is None:
            step = (max(series.points) + 1) if series.points else 0
        series.add(step, event.value)
        if mn.STEP_TAG in event.tags:
            kinds[event.tags[mn.STEP_TAG]] += 1
    out.step_kind = max(kinds, key=kinds.get) if kinds else None
    return out


def draw(metrics: RunMetrics, out: Path) -> Path:
    """Write the PNG: rewards and validation on the left axis, curriculum percentile on the right."""
    if metrics.empty:
        raise NoMetricsError(
            f"no {', '.join(mn.PLOTTED)} events for run {metrics.run_id!r} on the metrics topic")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    styles = {mn.REWARD_MEAN: dict(marker="o"), mn.REWARD_MEAN_FILTERED: dict(marker=".", linestyle="--"),
              mn.VALIDATION_REWARD_MEAN: dict(marker="s", linestyle=":")}
    for name in (mn.REWARD_MEAN, mn.REWARD_MEAN_FILTERED, mn.VALIDATION_REWARD_MEAN):
        for series in metrics.of(name):
            xs, ys = series.xy()
            ax.plot(xs, ys, label=f"{name} ({series.source})", **styles[name])
    marks = {"promote": ("tab:green", "promoted"), "finish_canary": ("tab:green", "promoted"),
             "force_promote": ("tab:green", "promoted"), "rollback": ("tab:red", "rolled back")}
    labelled: set[str] = set()
    for decision, version in metrics.decisions:  # the promotion gate's moves, on the version axis
        if decision in marks:
            color, label = marks[decision]
            ax.axvline(version, color=color, alpha=0.35, linewidth=1, label=None if label in labelled else label)
            labelled.add(label)
    ax.set_xlabel({"epoch": "epoch", "version": "policy version"}.get(metrics.step_kind or "", "step"))
    ax.set_ylabel("reward")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    curriculum = metrics.of(mn.CURRICULUM_PERCENTILE)
    if curriculum:
        ax2 = ax.twinx()
        for series in curriculum:
            xs, ys = series.xy()
            ax2.step(xs, ys, where="post", color="tab:gray", alpha=0.7, label=f"{mn.CURRICULUM_PERCENTILE} ({series.source})")
        ax2.set_ylabel("curriculum percentile")
        ax2.set_ylim(0, 1.05)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="best", fontsize="small")
    ax.set_title(f"rlstream run {metrics.run_id}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    log.info("plot written", path=str(out), series=len(metrics.series))
    return out


async def plot_run(cfg: RlstreamConfig, run_id: str, out: Path | None = None) -> tuple[Path, RunMetrics]:
    """Read the run's metrics and draw them to ``out`` (default ``reward_plot_<run>.png``)."""
    metrics = await load_run_metrics(cfg, run_id)
    path = draw(metrics, out or Path(f"reward_plot_{run_id}.png"))
    return path, metrics
