"""The live view of ``rlstream up``: its figures (:class:`LiveFigures`), fed from the groups, metrics, dlq and
promotions topics and from Redis by :class:`Watcher`, and rendered as a table by :func:`render`."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from rlstream.ops.evaluation import VersionScore, score_from_gate
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.log import get_logger
from rlstream.transport.signals import sleep_or_stop

log = get_logger(__name__)
#: reward components shown per version when the task's reward function reports them: (name, label, format)
HELDOUT_COMPONENT_ROWS: tuple[tuple[str, str, str], ...] = (
    ("success", "task success", ".2f"), ("tool_call_parsed", "tool-call parse rate", ".2f"),
    ("answer_words", "answer length (words)", ".1f"), ("answer_tokens", "answer length (tokens)", ".1f"))


#: decisions that move the serving pointer to their version
PROMOTING_DECISIONS = ("promote", "finish_canary", "force_promote")


@dataclass
class PromotionFigures:
    """The promotion gate's decisions (``promotions``), the serving pointer and the feedback-to-serving figures."""

    gate: bool = False
    serving: int | None = None
    canary: int | None = None
    canary_share: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)  # decision -> how many
    last: tuple[str, int, str] | None = None  # (decision, version, reason)
    marks: list[tuple[str, int]] = field(default_factory=list)  # (decision, version) of every decision
    feedback_to_serving_p50_s: float | None = None
    feedback_to_serving_p90_s: float | None = None
    feedback_waiting: int | None = None  # trained trajectories whose version does not serve yet
    served_calls: dict[int, int] = field(default_factory=dict)  # version -> production calls it answered (``calls``)

    def versions(self, *kinds: str) -> list[int]:
        """The versions that got a decision of one of ``kinds``, in order, each once."""
        return sorted({version for kind, version in self.marks if kind in kinds})

    def summary(self) -> dict[str, Any]:
        """The ``promotion`` section of summary.json."""
        c = self.counts
        return {"gate": self.gate, "serving_version": self.serving,
                "promoted": c.get("promote", 0) + c.get("finish_canary", 0) + c.get("force_promote", 0),
                "rejected": c.get("reject", 0), "rolled_back": c.get("rollback", 0), "canaries": c.get("canary", 0),
                "last_decision": ({"decision": self.last[0], "version": self.last[1], "reason": self.last[2]}
                                  if self.last else None),
                "feedback_to_serving_s": {"p50": self.feedback_to_serving_p50_s,
                                          "p90": self.feedback_to_serving_p90_s},
                "trained_not_serving": self.feedback_waiting,
                "promoted_versions": (promoted := self.versions(*PROMOTING_DECISIONS)),
                "canary_versions": (canaried := self.versions("canary")),
                "served_versions": {str(v): n for v, n in sorted(self.served_calls.items())},
                # versions that answered production calls without having passed the gate (must stay empty)
                "served_unvetted": [v for v in sorted(self.served_calls) if v != 0 and v not in promoted
                                    and v not in canaried] if self.gate else []}


@dataclass
class LiveFigures:
    """What the live view shows, refreshed from Kafka and Redis."""

    started: float = field(default_factory=time.monotonic)
    latest_version: int = -1
    latest_published_at: float | None = None
    loaded: dict[str, str] = field(default_factory=dict)
    groups_seen: int = 0
    group_reward_by_version: dict[int, list[float]] = field(default_factory=dict)
    newest_group_version: int | None = None
    filtered: dict[str, float] = field(default_factory=dict)
    dlq_count: int = 0
    lags: dict[str, int] = field(default_factory=dict)
    heldout: list[VersionScore] = field(default_factory=list)
    heldout_from_gate: bool = False  # the held-out scores are the promotion gate's (rlstream up evaluates nothing)
    group_times: list[float] = field(default_factory=list)
    baseline_groups: int = 0  # single responses scored against a keyed baseline (production traffic)
    users: dict[str, str] = field(default_factory=dict)  # the simulated users' figures (production traffic)
    constant_answer: tuple[str, float] | None = None  # the toy task's best instruction-blind answer and its reward
    task_baselines: dict[str, float] = field(default_factory=dict)  # what a task's no-skill answers earn (tool task)
    promotion: PromotionFigures = field(default_factory=lambda: PromotionFigures())
    engine_restarts: list[Any] = field(default_factory=list)  # EngineRestart of every vLLM server restart
    engines_down: dict[str, tuple[str, float]] = field(default_factory=dict)  # server -> (why, since): restarting

    def add_heldout(self, score: VersionScore) -> bool:
        """Record a version's held-out score unless it has one already (the first measurement stands: the gate
        re-measures the serving version at every decision); the list stays in version order."""
        if any(s.version == score.version for s in self.heldout):
            return False
        self.heldout.append(score)
        self.heldout.sort(key=lambda s: s.version)
        return True

    def groups_per_s(self, window_s: float = 30.0) -> float:
        now = time.monotonic()
        recent = [t for t in self.group_times if now - t <= window_s]
        return len(recent) / min(window_s, max(1e-9, now - self.started))

    def policy_lag(self) -> int | None:
        if self.newest_group_version is None or self.latest_version < 0:
            return None
        return self.latest_version - self.newest_group_version


def engine_restarts_text(figures: LiveFigures) -> str:
    """The live view's line on vLLM restarts: how many, the last one, and any server being restarted now."""
    now = time.monotonic()
    parts = [f"{len(figures.engine_restarts)}"]
    if figures.engine_restarts:
        last = figures.engine_restarts[-1]
        back = f"back after {last.down_s:.0f}s" if last.down_s is not None else f"not back: {last.error}"
        parts.append(f"(last: {last.name}, {last.reason}, {back})")
    for name, (reason, since) in sorted(figures.engines_down.items()):
        parts.append(f"— {name} DOWN {now - since:.0f}s, restarting ({reason})")
    return " ".join(parts)


def render(figures: LiveFigures, run_id: str, duration_s: float | None) -> Any:
    """The live view as a rich table."""
    from rich.table import Table

    elapsed = time.monotonic() - figures.started
    title = f"rlstream up — run {run_id} — {elapsed:.0f}s" + (f" / {duration_s:.0f}s" if duration_s else "")
    table = Table(title=title, show_header=True)
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    age = f"{time.time() - figures.latest_published_at:.0f}s ago" if figures.latest_published_at else "-"
    table.add_row("policy version (published)", f"{figures.latest_version if figures.latest_version >= 0 else '-'} ({age})")
    table.add_row("loaded in vLLM", ", ".join(f"{w}: v{v}" for w, v in figures.loaded.items()) or "-")
    table.add_row("vLLM engine restarts", engine_restarts_text(figures))
    p = figures.promotion
    if p.gate:
        candidate = figures.latest_version if figures.latest_version >= 0 else "-"
        table.add_row("serving / candidate", f"v{p.serving if p.serving is not None else '-'} / v{candidate}"
                      + (f"  (canary v{p.canary} on {p.canary_share:.0%} of new sessions)" if p.canary else ""))
        last = f"{p.last[0]} v{p.last[1]}: {p.last[2]}" if p.last else "-"
        table.add_row("last gate decision", last)
        table.add_row("gate decisions", ", ".join(f"{k} {v}" for k, v in sorted(p.counts.items())) or "-")
        table.add_row("production calls per version", "  ".join(
            f"v{v}: {n}" for v, n in sorted(p.served_calls.items())) or "-")
        p50, p90 = p.feedback_to_serving_p50_s, p.feedback_to_serving_p90_s
        table.add_row("feedback to serving", "-" if p50 is None else
                      f"p50 {p50:.1f}s" + (f", p90 {p90:.1f}s" if p90 is not None else "")
                      + (f"; {p.feedback_waiting} trained, not serving yet" if p.feedback_waiting else ""))
    heldout = "  ".join(f"v{s.version}: {s.reward_mean:.2f}" for s in figures.heldout[-8:])
    table.add_row("held-out reward per version", heldout or "-")
    for name, label, form in HELDOUT_COMPONENT_ROWS:
        if any(name in s.components for s in figures.heldout):
            table.add_row(f"held-out {label} per version", "  ".join(
                f"v{s.version}: {s.components[name]:{form}}" for s in figures.heldout[-8:] if name in s.components))
    if figures.task_baselines:
        table.add_row("without the tool (held-out)", ", ".join(f"{k} {v:.2f}" for k, v in figures.task_baselines.items()))
    if figures.constant_answer is not None:
        answer, reward = figures.constant_answer
        table.add_row("best constant answer (format only)", f"{answer!r} for every prompt earns {reward:.2f}")
    train = "  ".join(f"v{v}: {sum(r) / len(r):.2f}" for v, r in sorted(figures.group_reward_by_version.items())[-8:])
    table.add_row("training reward per version", train or "-")
    table.add_row("groups", f"{figures.groups_seen} ({figures.groups_per_s():.2f}/s)"
                  + (f", {figures.baseline_groups} single responses vs. baseline" if figures.baseline_groups else ""))
    if figures.users:
        u = figures.users
        table.add_row("users (production traffic)", f"requests {u.get('users_requests', '0')}, streamed "
                      f"{u.get('users_streamed', '0')}, langchain {u.get('users_langchain', '0')}, feedback sent "
                      f"{u.get('users_feedback_sent', '0')}")
    table.add_row("groups filtered", ", ".join(f"{k}: {v:.0f}" for k, v in sorted(figures.filtered.items())) or "0")
    table.add_row("dlq", str(figures.dlq_count))
    lag = figures.policy_lag()
    table.add_row("policy lag (versions)", "-" if lag is None else str(lag))
    table.add_row("consumer lag", ", ".join(f"{k}: {v}" for k, v in sorted(figures.lags.items())) or "-")
    return table


class Watcher:
    """Feeds :class:`LiveFigures` from the groups, metrics and dlq topics and from Redis."""

    def __init__(self, cfg: RlstreamConfig, control: ControlPlane, figures: LiveFigures) -> None:
        self.cfg, self.control, self.figures = cfg, control, figures
        self._filtered_totals: dict[tuple[str, str], float] = {}  # (worker, reason) -> that worker's running total

    async def follow_topics(self, stop: asyncio.Event) -> None:
        from rlstream.transport.kafka import make_consumer
        from rlstream.transport.topic_reader import SourceRecord, TopicReader, fetch_batch
        from rlstream.schemas.codec import codec_for
        from rlstream.schemas.models import CallEvent, DeadLetter, MetricEvent, PromotionDecision, TrajectoryGroup

        def undecodable(source: SourceRecord, reason: BaseException | str) -> None:
            log.warning("undecodable record in live view", topic=source.topic, error=str(reason))

        names = TopicNames.from_config(self.cfg.topics)
        codec = codec_for(self.cfg, max_bytes=self.cfg.kafka.max_message_bytes * 4)
        consumer = make_consumer(self.cfg.kafka, names.groups, names.metrics, names.dlq, names.promotions, names.calls,
                                 group_id=None, isolation_level="read_committed")
        # one consumer, one typed reader per topic; the live view only looks, so nothing is dead-lettered
        groups = TopicReader(consumer, codec, TrajectoryGroup, on_reject=undecodable)
        metrics = TopicReader(consumer, codec, MetricEvent, on_reject=undecodable)
        letters = TopicReader(consumer, codec, DeadLetter, on_reject=undecodable)
        decisions = TopicReader(consumer, codec, PromotionDecision, on_reject=undecodable)
        calls = TopicReader(consumer, codec, CallEvent, on_reject=undecodable)
        await consumer.start()
        try:
            while not stop.is_set():
                for record in await fetch_batch(consumer, timeout_ms=500, max_records=500):
                    if record.topic == names.groups:
                        if group := await groups.decode(record):
                            self._on_group(group.event)
                    elif record.topic == names.metrics:
                        if metric := await metrics.decode(record):
                            self._on_metric(metric.event)
                    elif record.topic == names.promotions:
                        if decision := await decisions.decode(record):
                            self._on_decision(decision.event)
                    elif record.topic == names.calls:
                        if call := await calls.decode(record):
                            self._on_call(call.event)
                    elif await letters.decode(record):
                        self.figures.dlq_count += 1
        finally:
            await consumer.stop()

    def _on_group(self, group: Any) -> None:
        if group.run_id != self.cfg.run_id:
            return
        self.figures.groups_seen += 1
        self.figures.group_times.append(time.monotonic())
        if getattr(group, "baseline", None) is not None:
            self.figures.baseline_groups += 1
        rewards = [t.reward for t in group.trajectories if t.reward is not None]
        if rewards:
            self.figures.group_reward_by_version.setdefault(group.max_policy_version, []).append(
                sum(rewards) / len(rewards))
        self.figures.newest_group_version = max(self.figures.newest_group_version or 0, group.max_policy_version)

    def _on_call(self, event: Any) -> None:
        from rlstream.schemas.models import CallKind

        if event.policy != self.cfg.policy or event.kind != CallKind.call:
            return
        served = self.figures.promotion.served_calls
        served[event.policy_version] = served.get(event.policy_version, 0) + 1

    def _on_decision(self, event: Any) -> None:
        if event.policy != self.cfg.policy:
            return
        p = self.figures.promotion
        kind = event.decision.value
        p.counts[kind] = p.counts.get(kind, 0) + 1
        p.last = (kind, event.version, event.reason)
        p.marks.append((kind, int(event.candidate_metrics.get("canary_version", event.version))))
        if self.figures.heldout_from_gate:
            self._scores_from_decision(event)

    def _scores_from_decision(self, event: Any) -> None:
        at = event.decided_at.timestamp()
        measured = [(event.version, event.candidate_metrics)]
        if event.serving_before is not None:
            measured.append((event.serving_before, event.serving_metrics))
        for version, metrics in measured:
            # the figures name the version they measured (a rollback's decision carries the canary's figures)
            version = int(metrics.get("version", version))
            score = score_from_gate(version, f"{self.cfg.policy}@{version}", metrics, at)
            if score is not None and self.figures.add_heldout(score):
                log.info("held-out reward (the gate's evaluation)", version=score.version,
                         reward_mean=round(score.reward_mean, 3))

    def _on_metric(self, event: Any) -> None:
        if event.run_id != self.cfg.run_id:
            return
        if event.name == mn.GATE_FEEDBACK_TO_SERVING_P50_S:
            self.figures.promotion.feedback_to_serving_p50_s = event.value
        elif event.name == mn.GATE_FEEDBACK_TO_SERVING_P90_S:
            self.figures.promotion.feedback_to_serving_p90_s = event.value
        elif event.name == mn.GATE_FEEDBACK_WAITING:
            self.figures.promotion.feedback_waiting = int(event.value)
        if event.name != mn.STREAMS_GROUPS_FILTERED:
            return
        # every streams worker reports its own count since start: keep each worker's latest, sum per reason
        worker, reason = event.tags.get("worker", event.source), event.tags.get("reason", "unknown")
        self._filtered_totals[(worker, reason)] = event.value
        totals: dict[str, float] = {}
        for (_, why), value in self._filtered_totals.items():
            totals[why] = totals.get(why, 0.0) + value
        self.figures.filtered = totals

    async def refresh_control(self) -> None:
        """Read the latest version, what each inference worker has loaded and the run's status from Redis."""
        latest = await self.control.latest(self.cfg.policy)
        if latest:
            self.figures.latest_version = int(latest["version"])
            self.figures.latest_published_at = float(latest.get("published_at", 0) or 0) or None
        workers = await self.control.workers(self.cfg.policy)
        self.figures.loaded = {w: f"{info.get('version', '?')} (down)" if info.get("down") else info.get("version", "?")
                               for w, info in workers.items()}
        from rlstream.transport.serving import ServingControl

        pointer = await ServingControl(self.control).serving(self.cfg.policy)
        if pointer is not None:
            p = self.figures.promotion
            p.serving, p.canary, p.canary_share = pointer.version, pointer.canary_version, pointer.canary_share
        status = await self.control.status(self.cfg.run_id)
        self.figures.users = {k: v for k, v in status.items() if k.startswith("users_")}

    async def poll_control(self, stop: asyncio.Event) -> None:
        from rlstream.ops.status import consumer_group_lags

        while not stop.is_set():
            try:
                await self.refresh_control()
                lags = await consumer_group_lags(self.cfg.kafka, prefix=self.cfg.topics.prefix)
                self.figures.lags = {f"{g.group}/{g.topic.removeprefix(self.cfg.topics.prefix)}": g.lag for g in lags}
            except Exception as exc:  # the view must not die with a transient error
                log.warning("live view refresh failed", error=str(exc))
            await sleep_or_stop(stop, 2.0)
