"""What ``rlstream console`` shows, and how it is read: :class:`ConsoleState` is fed by :class:`ConsoleFeed` from the
topics that exist (``policy-versions``, ``promotions``, ``metrics``, ``groups``, ``trajectories``, ``rewards``,
``dlq``), each read from its beginning by one group-less ``read_committed`` consumer (it never joins a consumer group
and never commits), and from Redis (the latest and serving pointers). Nothing is written anywhere.

Memory is bounded: per version a few sample trajectories, per example the answers of a few versions (held-out answers,
the ``validation`` trajectories the gate publishes, kept apart from training answers), a fixed number of recent dead
letters and feedback times.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import (DeadLetter, DecisionKind, MetricEvent, PolicyVersion, PromotionDecision,
                                     RewardEvent, TrajectoryEvent, TrajectoryGroup, TrajectorySource)
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.log import get_logger
from rlstream.transport.signals import sleep_or_stop

log = get_logger(__name__)

#: sample trajectories kept per version (the newest)
SAMPLES_PER_VERSION = 12
#: examples whose answers are kept for the side-by-side view (least recently answered dropped first)
COMPARE_EXAMPLES = 400
#: answers kept per (example, version)
ANSWERS_PER_VERSION = 2
#: dead letters and feedback arrival times kept for the rates
RECENT_EVENTS = 2000
#: the window of the per-minute rates
RATE_WINDOW_S = 600.0
#: added to a group's reward std before dividing (the learner's GRPO scaling, learner/grpo.py)
STD_EPS = 1e-4
#: what each decision does to the version it names, as the timeline shows it
STAGE_OF_DECISION = {
    DecisionKind.promote: "promoted", DecisionKind.finish_canary: "promoted", DecisionKind.force_promote: "promoted",
    DecisionKind.canary: "canary", DecisionKind.reject: "rejected", DecisionKind.rollback: "serving (rollback)",
}
#: the gate's per-version figures a decision carries (rules.EvalFigures.metrics) that the curves show
GUARD_FIGURES = ("reward_mean", "tool_call_parse_rate", "answer_parse_rate", "refusal_rate", "answer_length", "samples")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass
class VersionRow:
    """One policy version on the timeline: its announcement, every stage it went through and its figures."""

    version: int
    announced_at: float | None = None
    learner_step: int | None = None
    group_count: int = 0
    kind: str = ""
    stages: list[dict[str, Any]] = field(default_factory=list)
    heldout: dict[str, float] = field(default_factory=dict)  # the gate's figures, or `up`'s held-out reward
    training_rewards: list[float] = field(default_factory=list)  # mean reward of each group trained at this version
    trajectories: int = 0

    @property
    def status(self) -> str:
        """The last stage (``candidate`` while nothing was decided)."""
        decided = [s["stage"] for s in self.stages if s["stage"] != "evaluated"]
        if decided:
            return decided[-1]
        if self.heldout:
            return "evaluated"
        return "base" if self.version == 0 else "candidate"

    def as_json(self) -> dict[str, Any]:
        train = self.training_rewards
        return {"version": self.version, "status": self.status, "announced_at": self.announced_at,
                "learner_step": self.learner_step, "group_count": self.group_count, "kind": self.kind,
                "stages": self.stages, "heldout": self.heldout,
                "training_reward": sum(train) / len(train) if train else None, "groups": len(train),
                "trajectories": self.trajectories}


def advantage_of(reward: float | None, group: TrajectoryGroup) -> float | None:
    """The trajectory's advantage as the learner scales it by default: against its group's rewards,
    ``(r - mean) / (std + eps)``; against the keyed baseline for a single production response (``r - mean``,
    centred only)."""
    if reward is None:
        return None
    if group.baseline is not None:
        return _finite(reward - group.baseline.mean) if group.baseline.count else 0.0
    return _finite((reward - group.reward_mean) / (group.reward_std + STD_EPS))


def trajectory_json(event: TrajectoryEvent, advantage: float | None = None, group_id: str | None = None) -> dict[str, Any]:
    """A trajectory as the page shows it: messages (tool calls and results), reward and components, advantage,
    the turns' per-token logprobs."""
    return {
        "trajectory_id": event.trajectory_id, "example_id": event.example_id, "group_id": group_id or event.group_id,
        "policy_version": event.policy_version, "source": event.source.value, "run_id": event.run_id,
        "created_at": event.created_at.timestamp(), "reward": _finite(event.reward),
        "reward_components": {k: v for k, v in event.reward_components.items() if math.isfinite(v)},
        "advantage": advantage,
        "messages": [{"role": m.role, "content": m.content, "name": m.name, "tool_call_id": m.tool_call_id,
                      "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                     for c in m.tool_calls or ()]} for m in event.messages],
        "turns": [{"message_index": t.message_index, "model": t.model, "finish_reason": t.finish_reason,
                   "token_ids": list(t.completion_token_ids or ()),
                   "logprobs": [lp if math.isfinite(lp) else None for lp in t.completion_logprobs or ()]}
                  for t in event.turns],
    }


@dataclass
class ConsoleState:
    """Everything the console page shows, in memory, bounded."""

    policy: str
    run_id: str
    started: float = field(default_factory=time.time)
    versions: dict[int, VersionRow] = field(default_factory=dict)
    samples: dict[int, deque[dict[str, Any]]] = field(default_factory=dict)
    answers: OrderedDict[str, dict[int, list[dict[str, Any]]]] = field(default_factory=OrderedDict)
    # held-out answers (validation trajectories: the gate's, finetune's), apart from training answers to an example
    # of the same id
    heldout_answers: OrderedDict[str, dict[int, list[dict[str, Any]]]] = field(default_factory=OrderedDict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    feedback_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))
    feedback_total: int = 0
    feedback_ids: dict[str, int] = field(default_factory=dict)  # feedback id -> times seen (corrections)
    dlq_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))
    dlq_reasons: dict[str, dict[str, Any]] = field(default_factory=dict)  # "topic|error type" -> count, last message
    dlq_total: int = 0
    counters: dict[str, float] = field(default_factory=dict)  # the latest value of a few metrics
    latest: int | None = None
    serving: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def row(self, version: int) -> VersionRow:
        if version not in self.versions:
            self.versions[version] = VersionRow(version)
        return self.versions[version]

    # -- events ------------------------------------------------------------------------------------------------
    def on_version(self, event: PolicyVersion) -> None:
        if event.policy != self.policy:
            return
        row = self.row(event.version)
        row.announced_at, row.learner_step = event.created_at.timestamp(), event.learner_step
        row.group_count, row.kind = event.group_count, event.kind.value
        if not any(s["stage"] == "candidate" for s in row.stages):
            row.stages.insert(0, {"stage": "candidate", "at": row.announced_at,
                                  "reason": f"announced by the learner (step {event.learner_step}, "
                                            f"{event.group_count} groups)"})

    def on_decision(self, event: PromotionDecision) -> None:
        if event.policy != self.policy:
            return
        at = event.decided_at.timestamp()
        figures = {k: v for k, v in event.candidate_metrics.items() if math.isfinite(v)}
        serving_figures = {k: v for k, v in event.serving_metrics.items() if math.isfinite(v)}
        record = {"decision": event.decision.value, "version": event.version, "reason": event.reason,
                  "serving_before": event.serving_before, "decided_by": event.decided_by, "at": at,
                  "candidate_metrics": figures, "serving_metrics": serving_figures, "tests": tests_of(figures)}
        self.decisions.append(record)
        row = self.row(event.version)
        if "reward_mean" in figures and event.decision in (DecisionKind.promote, DecisionKind.reject,
                                                           DecisionKind.canary):
            row.heldout.update({k: figures[k] for k in GUARD_FIGURES if k in figures})
            row.stages.append({"stage": "evaluated", "at": at, "decided_by": event.decided_by,
                               "reason": evaluation_summary(figures, serving_figures, event.serving_before)})
        row.stages.append({"stage": STAGE_OF_DECISION[event.decision], "at": at, "reason": event.reason,
                           "decided_by": event.decided_by, "decision": event.decision.value,
                           "tests": record["tests"]})
        # a rollback names the version production went back to; a canary's, the canary in its figures
        left = int(figures["canary_version"]) if "canary_version" in figures else event.serving_before
        if event.decision == DecisionKind.rollback and left is not None and left != event.version:
            self.row(left).stages.append(
                {"stage": "rolled back", "at": at, "reason": event.reason, "decided_by": event.decided_by,
                 "decision": event.decision.value, "tests": []})

    def on_metric(self, event: MetricEvent) -> None:
        if event.run_id != self.run_id:
            return
        if event.name == mn.VALIDATION_REWARD_MEAN and event.step is not None \
                and event.tags.get(mn.STEP_TAG, mn.STEP_VERSION) == mn.STEP_VERSION:
            self.row(event.step).heldout.setdefault("reward_mean", event.value)
        elif event.name in (mn.GATE_FEEDBACK_TO_SERVING_P50_S, mn.GATE_FEEDBACK_TO_SERVING_P90_S,
                            mn.GATE_FEEDBACK_WAITING, mn.STREAMS_REWARDS_CORRECTED,
                            mn.STREAMS_REWARDS_CORRECTED_AFTER_EMIT):
            self.counters[event.name] = event.value

    def on_group(self, group: TrajectoryGroup) -> None:
        if group.policy != self.policy:
            return
        rewards = [t.reward for t in group.trajectories if t.reward is not None and math.isfinite(t.reward)]
        if rewards and not any(t.source == TrajectorySource.validation for t in group.trajectories):
            self.row(group.max_policy_version).training_rewards.append(sum(rewards) / len(rewards))
        for t in group.trajectories:
            self._sample(trajectory_json(t, advantage_of(t.reward, group), group.group_id))

    def on_trajectory(self, event: TrajectoryEvent) -> None:
        if event.policy != self.policy:
            return
        self.row(event.policy_version).trajectories += 1
        item = trajectory_json(event)
        self._answer(item, self.heldout_answers if event.source == TrajectorySource.validation else self.answers)
        if event.reward is not None:  # rewarded at once (rollout, validation): a sample before its group is
            self._sample(item)

    def on_reward(self, event: RewardEvent) -> None:
        self.feedback_total += 1
        self.feedback_times.append(event.created_at.timestamp())
        if event.feedback_id:
            self.feedback_ids[event.feedback_id] = self.feedback_ids.get(event.feedback_id, 0) + 1
            if len(self.feedback_ids) > RECENT_EVENTS * 10:
                self.feedback_ids.pop(next(iter(self.feedback_ids)))

    def on_dead_letter(self, letter: DeadLetter) -> None:
        self.dlq_total += 1
        self.dlq_times.append(letter.ts.timestamp())
        key = f"{letter.source_topic}|{letter.error_type}"
        entry = self.dlq_reasons.setdefault(key, {"topic": letter.source_topic, "error_type": letter.error_type,
                                                  "count": 0, "service": letter.service})
        entry["count"] += 1
        entry["last_message"] = letter.error_message[:500]
        entry["last_at"] = letter.ts.timestamp()

    def _sample(self, item: dict[str, Any]) -> None:
        kept = self.samples.setdefault(item["policy_version"], deque(maxlen=SAMPLES_PER_VERSION))
        for i, old in enumerate(kept):
            if old["trajectory_id"] == item["trajectory_id"]:  # the grouped copy carries the advantage
                kept[i] = item
                return
        kept.append(item)

    @staticmethod
    def _answer(item: dict[str, Any], kept: OrderedDict[str, dict[int, list[dict[str, Any]]]]) -> None:
        example = item["example_id"]
        by_version = kept.pop(example, {})
        answers = by_version.setdefault(item["policy_version"], [])
        answers.append(item)
        del answers[:-ANSWERS_PER_VERSION]
        kept[example] = by_version
        while len(kept) > COMPARE_EXAMPLES:
            kept.popitem(last=False)

    # -- views -------------------------------------------------------------------------------------------------
    def overview(self, now: float | None = None) -> dict[str, Any]:
        """The page's state: timeline, curves, rates, serving, the examples two versions answered."""
        now = time.time() if now is None else now
        rows = [self.versions[v].as_json() for v in sorted(self.versions)]
        heldout = [e for e, by in reversed(self.heldout_answers.items()) if len(by) >= 2]
        training = [e for e, by in reversed(self.answers.items()) if len(by) >= 2 and e not in self.heldout_answers]
        corrections = sum(n - 1 for n in self.feedback_ids.values() if n > 1)
        return {
            "policy": self.policy, "run_id": self.run_id, "now": now, "latest": self.latest,
            "serving": self.serving, "versions": rows,
            "curves": curves(rows),
            "decisions": self.decisions[-200:],
            "feedback": {"total": self.feedback_total, "per_min": per_minute(self.feedback_times, now),
                         "corrections": corrections,
                         "to_serving_p50_s": self.counters.get(mn.GATE_FEEDBACK_TO_SERVING_P50_S),
                         "to_serving_p90_s": self.counters.get(mn.GATE_FEEDBACK_TO_SERVING_P90_S),
                         "trained_not_serving": self.counters.get(mn.GATE_FEEDBACK_WAITING)},
            "dlq": {"total": self.dlq_total, "per_min": per_minute(self.dlq_times, now),
                    "reasons": sorted(self.dlq_reasons.values(), key=lambda r: -r["count"])},
            "sampled_versions": sorted(self.samples),
            "compare_examples": [
                *({"example_id": e, "heldout": True, "versions": sorted(self.heldout_answers[e])} for e in heldout),
                *({"example_id": e, "heldout": False, "versions": sorted(self.answers[e])} for e in training),
            ][:100],
            "errors": self.errors[-5:],
        }

    def version_samples(self, version: int) -> list[dict[str, Any]]:
        """The sample trajectories of ``version``, newest first."""
        return list(reversed(self.samples.get(version, ())))

    def compare(self, example_id: str, a: int, b: int) -> dict[str, Any]:
        """The answers of versions ``a`` and ``b`` to the same example (held-out answers when there are)."""
        heldout = example_id in self.heldout_answers
        by_version = (self.heldout_answers if heldout else self.answers).get(example_id, {})
        return {"example_id": example_id, "heldout": heldout,
                "a": {"version": a, "answers": by_version.get(a, [])},
                "b": {"version": b, "answers": by_version.get(b, [])}}


def tests_of(figures: dict[str, float]) -> list[dict[str, Any]]:
    """The gate's paired tests in a decision's figures (``test.<reference>.<figure>.<name>``), one dict each."""
    tests: dict[tuple[str, str], dict[str, Any]] = {}
    for key, value in figures.items():
        parts = key.split(".")
        if len(parts) == 4 and parts[0] == "test":
            tests.setdefault((parts[1], parts[2]), {"reference": parts[1], "figure": parts[2]})[parts[3]] = value
    return [tests[k] for k in sorted(tests)]


def evaluation_summary(candidate: dict[str, float], serving: dict[str, float], serving_version: int | None) -> str:
    """One line on the gate's evaluation: the candidate's held-out figures next to the serving version's."""
    def figures(f: dict[str, float]) -> str:
        parts = [f"reward {f['reward_mean']:.3f}"] if "reward_mean" in f else []
        if "tool_call_parse_rate" in f:
            parts.append(f"tool-call parse {f['tool_call_parse_rate']:.2f}")
        if "samples" in f:
            parts.append(f"n {f['samples']:.0f}")
        return ", ".join(parts)

    line = f"held-out {figures(candidate)}"
    if serving and serving_version is not None:
        line += f" vs serving v{serving_version}: {figures(serving)}"
    return line


def curves(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per version: held-out and training reward, the guards (tool-call and answer parse rates); None where a
    version has no figure."""
    return {"version": [r["version"] for r in rows],
            "heldout_reward": [r["heldout"].get("reward_mean") for r in rows],
            "training_reward": [r["training_reward"] for r in rows],
            "tool_call_parse_rate": [r["heldout"].get("tool_call_parse_rate") for r in rows],
            "answer_parse_rate": [r["heldout"].get("answer_parse_rate") for r in rows]}


def per_minute(times: deque[float], now: float, window_s: float = RATE_WINDOW_S) -> float:
    """Events per minute over the last ``window_s`` (or since the first event, when that is sooner)."""
    recent = [t for t in times if now - t <= window_s]
    if not recent:
        return 0.0
    span = max(60.0, min(window_s, now - min(recent)))
    return len(recent) * 60.0 / span


class ConsoleFeed:
    """Keeps a :class:`ConsoleState` current: follows the topics (from their beginning) and polls Redis."""

    def __init__(self, cfg: RlstreamConfig, state: ConsoleState) -> None:
        self.cfg, self.state = cfg, state
        self.names = TopicNames.from_config(cfg.topics)
        self.caught_up = asyncio.Event()

    async def follow_topics(self, stop: asyncio.Event) -> None:
        """Read every topic the page shows until ``stop``; reconnects after an error."""
        while not stop.is_set():
            try:
                await self._follow(stop)
            except Exception as exc:  # the page must outlive a broker restart
                self._error(f"reading the topics failed: {exc}")
                await sleep_or_stop(stop, 2.0)

    async def _follow(self, stop: asyncio.Event) -> None:
        from rlstream.schemas.codec import codec_for
        from rlstream.transport.kafka import make_consumer
        from rlstream.transport.topic_reader import SourceRecord, TopicReader, fetch_batch
        from rlstream.transport.trusted_versions import TrustedVersions, UntrustedVersionRecord

        def undecodable(source: SourceRecord, reason: BaseException | str) -> None:
            log.warning("undecodable record in the console", topic=source.topic, error=str(reason))

        n, s = self.names, self.state
        codec = codec_for(self.cfg, max_bytes=self.cfg.kafka.max_message_bytes * 4)
        consumer = make_consumer(self.cfg.kafka, n.policy_versions, n.promotions, n.metrics, n.groups,
                                 n.trajectories, n.rewards, n.dlq, group_id=None, isolation_level="read_committed")
        readers: dict[str, tuple[TopicReader[Any], Any]] = {
            n.policy_versions: (TopicReader(consumer, codec, PolicyVersion, on_reject=undecodable), None),
            n.promotions: (TopicReader(consumer, codec, PromotionDecision, on_reject=undecodable), s.on_decision),
            n.metrics: (TopicReader(consumer, codec, MetricEvent, on_reject=undecodable), s.on_metric),
            n.groups: (TopicReader(consumer, codec, TrajectoryGroup, on_reject=undecodable), s.on_group),
            n.trajectories: (TopicReader(consumer, codec, TrajectoryEvent, on_reject=undecodable), s.on_trajectory),
            n.rewards: (TopicReader(consumer, codec, RewardEvent, on_reject=undecodable), s.on_reward),
            n.dlq: (TopicReader(consumer, codec, DeadLetter, on_reject=undecodable), s.on_dead_letter),
        }
        control = ControlPlane(str(self.cfg.redis.url), self.cfg.redis.retry_max_s) if self.cfg.redis.url else None
        trust = TrustedVersions(control, self.cfg.inference.max_version_jump, wait_pending=False) if control else None
        try:
            await consumer.start()
            while not stop.is_set():
                batch = await fetch_batch(consumer, timeout_ms=500, max_records=1000)
                for record in batch:
                    reader, handle = readers[record.topic]
                    item = await reader.decode(record)
                    if item is None:
                        continue
                    if record.topic == n.policy_versions:
                        try:  # only what the fenced learner announced is a version (transport/trusted_versions.py)
                            if trust is not None:
                                await trust.check(item.event, item.source.value)
                        except UntrustedVersionRecord as exc:
                            log.warning("untrusted version record not shown", reason=exc.reason)
                            continue
                        s.on_version(item.event)
                    else:
                        handle(item.event)
                if not batch:
                    self.caught_up.set()
        finally:
            await consumer.stop()
            if control is not None:
                await control.close()

    async def poll_control(self, stop: asyncio.Event, every_s: float = 2.0) -> None:
        """Read the latest and serving pointers from Redis until ``stop``."""
        if not self.cfg.redis.url:
            return
        from rlstream.transport.serving import ServingControl

        control = ControlPlane(str(self.cfg.redis.url), self.cfg.redis.retry_max_s)
        try:
            serving = ServingControl(control)
            while not stop.is_set():
                try:
                    self.state.latest = await control.latest_version(self.cfg.policy)
                    pointer = await serving.serving(self.cfg.policy)
                    self.state.serving = {} if pointer is None else {
                        "version": pointer.version, "canary_version": pointer.canary_version,
                        "canary_share": pointer.canary_share, "anchor_version": pointer.anchor_version,
                        "reason": pointer.reason, "decided_by": pointer.decided_by, "moved_at": pointer.moved_at}
                except Exception as exc:  # Redis away: the page says so and keeps the last figures
                    self._error(f"reading Redis failed: {exc}")
                await sleep_or_stop(stop, every_s)
        finally:
            await control.close()

    def _error(self, message: str) -> None:
        log.warning("console feed", error=message)
        self.state.errors.append(f"{time.strftime('%H:%M:%S')} {message}")
        del self.state.errors[:-20]
