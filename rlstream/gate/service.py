"""``rlstream gate``: the promotion gate service (docs/gate.md).

It follows ``policy-versions`` in its own consumer group (``gate.group_id``-``policy``), accepts only records the
fenced learner announced (transport/trusted_versions.py), and decides about the newest candidate above the serving
version: it evaluates the candidate on the held-out set under the candidate's own model name on a replica that
acknowledged loading it (an ``evaluate`` replica first: a dedicated evaluation server for full-weight versions;
never through the serving name, never through the gateway), compares it with the serving
version's and the anchor's (the best version promoted) on the same prompts and seeds, both measured fresh for this
decision, by the paired non-inferiority tests of rules.py / statistics.py, and promotes it (the serving pointer moves once every
alive replica has it loaded: transport/serving.py) or rejects it with the reason. With ``gate.canary_share`` above 0
a promoted version first serves that share of new sessions; the sequential test of sequential.py over the online
rewards of feedback.py finishes the promotion or rolls the canary back. Every decision is a PromotionDecision on
``promotions``. Candidates that arrive while one is evaluated or a canary runs are not decided one by one: the next
decision is about the newest.

The answers of the first ``gate.publish_answers`` held-out examples (their first sample) of every version measured go
to ``trajectories`` once per version, marked ``source: validation``: the stream app never groups them, no learner
trains on them, and ``rlstream console`` shows two versions' answers to the same prompt side by side.

Each decision measures the candidate, the serving version and the anchor on a replica that has each loaded (the
anchor's latest measurement stands in only while no replica holds it, as with full weights), with the sample size gate.power asks for (statistics.sample_size). An evaluation that
produces no result (:class:`rlstream.gate.evaluation.EvaluationFailed`) decides nothing: it is counted in
``gate/evaluation_failures`` and the decision is tried again. The anchor after each decision is on its record
(``candidate_metrics["anchor_version"]``) and on the serving pointer (``anchor_version``: replicas keep it loaded,
a restarted gate reads it back).
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

from aiokafka import ConsumerRecord, TopicPartition

from rlstream.gate.evaluation import (EvaluationFailed, EvaluationSet, EvaluationSetError, evaluate_version,
                                      load_episode, load_evaluation_examples, load_reward_function)
from rlstream.gate.feedback import FeedbackClock, OnlineRewards, trained_trajectories
from rlstream.gate.rules import DecisionRule, EvalFigures, Verdict, judge, next_anchor
from rlstream.gate.sequential import SequentialOutcome, SequentialState, SprtSettings, sprt
from rlstream.gate.statistics import sample_size
from rlstream.schemas.codec import AvroCodec, codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.masking import secret_value
from rlstream.schemas.rewards import Invalid, RewardRange, check_rewards, validate_reward
from rlstream.schemas.models import (DecisionKind, MetricEvent, PolicyVersion, PromotionDecision, RewardEvent,
                                     TrajectoryEvent, TrajectoryGroup, TrajectorySource, WeightsKind)
from rlstream.schemas.topics import TopicNames
from rlstream.transport import metric_names as mn
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import create_topics, make_consumer, make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.metrics import MetricsPublisher
from rlstream.transport.serving import (CanaryState, FleetReadiness, ReplicaAck, ServingControl, ServingMoveRefused,
                                        ServingPointer, canary_replicas, fleet_readiness, move_serving_when_loaded,
                                        publish_decision)
from rlstream.transport.signals import stop_event
from rlstream.transport.topic_reader import SourceRecord, TopicReader, fetch_batch, read_slice, wait_for_partitions
from rlstream.transport.trusted_versions import TrustedVersions, UntrustedVersionRecord

log = get_logger(__name__)

#: Seconds between two polls while the gate waits (for a replica, for feedback).
POLL_S = 0.5
#: Seconds the gate spends at most reading one ``trained_on`` range of ``groups`` (a range lost to retention).
GROUPS_READ_TIMEOUT_S = 15.0
#: Seconds a promotion of a full-weights version waits for the fleet (see PromotionGate._move_timeout).
FULL_MOVE_TIMEOUT_S = 5.0
#: Seconds an evaluation hold on an ``evaluate`` replica lasts at most (a gate that dies mid-evaluation delays that
#: replica's next candidate by this much at worst; a finished evaluation releases it at once).
EVALUATION_HOLD_S = 120.0
#: Seconds the gate waits after a failed step before it tries again.
ERROR_BACKOFF_S = 2.0
#: Who the gate's decisions are recorded as.
DECIDED_BY = "gate"
#: The metrics-map key of a decision's anchor (the best version promoted, after the decision).
ANCHOR_KEY = "anchor_version"


def evaluation_set(cfg: RlstreamConfig) -> EvaluationSet:
    """The held-out set of ``gate.*`` (defaults: ``finetuning.validation_dataset``, ``rollout.reward_function``; the
    episode of ``gate.episode``, one chat completion when unset)."""
    g = cfg.gate
    dataset = g.dataset or cfg.finetuning.validation_dataset
    reward = g.reward_function or cfg.rollout.reward_function
    if dataset is None:
        raise EvaluationSetError("no evaluation set: set gate.dataset (or finetuning.validation_dataset)")
    if not reward:
        raise EvaluationSetError("no reward function: set gate.reward_function (or rollout.reward_function)")
    return EvaluationSet(
        examples=load_evaluation_examples(Path(dataset), g.examples), reward_function=load_reward_function(reward),
        samples=g.samples, temperature=g.temperature if g.temperature is not None else cfg.rollout.temperature,
        max_tokens=g.max_tokens or cfg.rollout.max_tokens, answer_pattern=g.answer_pattern,
        refusal_patterns=tuple(g.refusal_patterns), concurrency=g.concurrency,
        request_timeout_s=cfg.inference.request_timeout_s, episode=load_episode(g.episode),
        retries=g.evaluation_retries, retry_backoff_s=g.evaluation_retry_backoff_s)


@dataclass(frozen=True)
class EvaluationPlan:
    """How much of the held-out set one decision uses: ``examples`` x ``samples`` paired samples, ``needed`` the
    sample size the power asks for (above ``examples x samples`` when the set is too small for it)."""

    examples: int
    samples: int
    needed: int

    @property
    def pairs(self) -> int:
        return self.examples * self.samples


def evaluation_plan(needed: int, available_examples: int, max_samples: int) -> EvaluationPlan:
    """The examples (first) and samples per example that give at least ``needed`` paired samples: as many examples
    as there are (independent prompts weigh more than more samples of one), then the fewest samples per example;
    everything when the set holds fewer than ``needed``."""
    examples = max(1, min(available_examples, needed))
    samples = max(1, min(max_samples, math.ceil(needed / examples)))
    return EvaluationPlan(examples, samples, needed)


@dataclass(frozen=True)
class ReplicaRoute:
    """Where to ask one version: the replica's server (``.../v1``) and the model name it answers the version by;
    ``evaluates``: an ``evaluate`` replica (every replica is held on the version while it is evaluated)."""

    base_url: str
    model: str
    worker_id: str
    evaluates: bool = False


@dataclass
class Canary:
    """A running canary: ``version`` gets ``share`` of new sessions while ``serving`` serves the rest; ``uri`` and
    ``sha256`` name its files for the move that finishes it; the metrics are the offline figures it started on;
    ``held``: undecided and waiting for an operator (``gate.canary_undecided: hold``)."""

    version: int
    serving: int
    started_at: float
    share: float
    uri: str
    sha256: str
    rewards: OnlineRewards
    candidate_metrics: dict[str, float]
    serving_metrics: dict[str, float]
    held: bool = False


class PromotionGate:
    """The gate of ``cfg.policy`` (see the module docstring)."""

    def __init__(self, cfg: RlstreamConfig, control: ControlPlane, evaluation: EvaluationSet,
                 producer: Any = None, codec: AvroCodec | None = None) -> None:
        if not cfg.redis.url:
            raise EvaluationSetError("redis.url is not set: the serving pointer lives in Redis")
        self.cfg, self.gcfg, self.policy = cfg, cfg.gate, cfg.policy
        self.control = control
        self.serving = ServingControl(control)
        self.evaluation = evaluation
        self.codec = codec or codec_for(cfg)
        self.topics = TopicNames.from_config(cfg.topics)
        self.producer = producer or make_producer(cfg.kafka)
        self.metrics = MetricsPublisher(self.producer, self.codec, self.topics.metrics, source="gate",
                                        run_id=cfg.run_id, prometheus_port=self.gcfg.prometheus_port)
        self.trust = TrustedVersions(control, cfg.inference.max_version_jump)
        self.rule = DecisionRule(margin=self.gcfg.margin, alpha=self.gcfg.alpha, parse_margin=self.gcfg.parse_margin,
                                 tool_call_margin=self.gcfg.tool_call_margin, refusal_margin=self.gcfg.refusal_margin,
                                 success_margin=self.gcfg.success_margin, length_tolerance=self.gcfg.length_tolerance,
                                 min_reward=self.gcfg.min_reward)
        self.difference_std = self.gcfg.difference_std  # the prior; then what the last decision measured
        self.sprt = SprtSettings(alpha=self.gcfg.canary_alpha, beta=self.gcfg.canary_beta,
                                 delta=self.gcfg.canary_min_effect, min_samples=self.gcfg.canary_min_samples,
                                 max_samples=self.gcfg.canary_max_samples)
        self.known: dict[int, PolicyVersion] = {}  # trusted records of the policy
        self.anchor: int | None = None  # the best version promoted (None: not known yet; the serving version then)
        self.anchor_figures: EvalFigures | None = None  # its latest measurement (for when no replica holds it)
        self.decided = 0  # the newest candidate decided about (or given up on)
        self.canary: Canary | None = None
        self.clock = FeedbackClock()
        self.reward_range = RewardRange(*cfg.streams.reward_range)  # the rules streams applies to the same rewards
        self.decisions: list[PromotionDecision] = []
        self._versions_consumer: Any = None
        self._versions: TopicReader[PolicyVersion] | None = None
        self._feedback_consumer: Any = None
        self._groups_consumer: Any = None
        self._serving_read_at = 0.0
        self.answers_published: set[int] = set()  # versions whose held-out answers this gate published

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Decide about candidates until ``stop`` is set."""
        stop = stop or asyncio.Event()
        await self._start()
        try:
            while not stop.is_set():
                try:
                    await self.pump(timeout_ms=200)
                    if self.canary is not None:
                        await self.step_canary()
                    else:
                        await self.step()
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # noqa: BLE001 - a transient failure (broker, Redis, a replica) is retried
                    log.exception("gate step failed; retrying", error=str(exc))
                    await asyncio.sleep(ERROR_BACKOFF_S)
                await asyncio.sleep(0)
        finally:
            await self._stop()

    async def _start(self) -> None:
        await self.producer.start()
        self._versions_consumer = make_consumer(self.cfg.kafka, group_id=f"{self.gcfg.group_id}-{self.policy}",
                                                isolation_level="read_committed")
        await self._versions_consumer.start()
        self._versions_consumer.subscribe([self.topics.policy_versions])
        self._versions = TopicReader(self._versions_consumer, self.codec, PolicyVersion,
                                     on_reject=self._undecodable)
        # feedback: every reward from the beginning (arrival times), trajectories from now on (canaries)
        self._feedback_consumer = make_consumer(self.cfg.kafka, group_id=None, isolation_level="read_committed")
        await self._feedback_consumer.start()
        rewards = await wait_for_partitions(self._feedback_consumer, self.topics.rewards, timeout_s=30.0)
        trajectories = await wait_for_partitions(self._feedback_consumer, self.topics.trajectories, timeout_s=30.0)
        self._feedback_consumer.assign([*rewards, *trajectories])
        await self._feedback_consumer.seek_to_beginning(*rewards)
        await self._feedback_consumer.seek_to_end(*trajectories)
        self._groups_consumer = make_consumer(self.cfg.kafka, group_id=None, isolation_level="read_committed")
        await self._groups_consumer.start()
        pointer = await self.serving.serving(self.policy)
        if pointer is not None:
            self.clock.served_version = pointer.version
        self.anchor = pointer.anchor_version if pointer is not None else None  # what the last gate recorded
        await self._resume_canary(pointer)
        log.info("gate started", policy=self.policy, examples=len(self.evaluation.examples),
                 samples=self.evaluation.samples, canary_share=self.gcfg.canary_share)

    async def _stop(self) -> None:
        for consumer in (self._versions_consumer, self._feedback_consumer, self._groups_consumer):
            if consumer is not None:
                await consumer.stop()
        await self.producer.stop()

    def _undecodable(self, source: SourceRecord, reason: BaseException | str) -> None:
        log.warning("undecodable record skipped by the gate", topic=source.topic, partition=source.partition,
                    offset=source.offset, error=str(reason))

    async def pump(self, timeout_ms: int = 0) -> None:
        """Read what arrived: version records, feedback, and the serving pointer (for the latency)."""
        assert self._versions is not None
        items = await self._versions.fetch(timeout_ms=timeout_ms, max_records=100)
        for item in items:
            await self.on_version(item.event, item.source)
        if items:
            await self._versions_consumer.commit()
        await self._read_feedback()
        await self._observe_serving()

    async def on_version(self, event: PolicyVersion, source: SourceRecord) -> None:
        """One record of ``policy-versions``: remembered when trusted, with what it trained on (lineage)."""
        if event.policy != self.policy:
            return
        while True:
            try:
                await self.trust.check(event, source.value)
                break
            except UntrustedVersionRecord as exc:
                log.warning("untrusted policy version ignored by the gate", version=event.version, error=str(exc))
                await self.metrics.emit(mn.GATE_VERSION_REFUSED, 1.0, step=event.version,
                                        tags={"policy": self.policy, "reason": exc.reason})
                return
            except Exception as exc:  # noqa: BLE001 - Redis unreachable: nothing counts until it can be checked
                log.warning("cannot check a policy version; retrying", version=event.version, error=str(exc))
                await asyncio.sleep(1.0)
        self.known[event.version] = event
        self.clock.on_version(event.version, await self._trained_on(event))
        await self.metrics.emit(mn.GATE_FEEDBACK_WAITING, float(self.clock.waiting), step=event.version,
                                tags={"policy": self.policy})

    async def _trained_on(self, event: PolicyVersion) -> list[Any]:
        """The rewarded trajectories of the groups ``event`` trained on (its ``trained_on`` ranges of ``groups``),
        read in one pass over the partitions the ranges name (one assignment per version, not one per range)."""
        out: list[Any] = []
        if not event.trained_on:
            return out
        reader = TopicReader(self._groups_consumer, self.codec, TrajectoryGroup, on_reject=self._undecodable)
        ranges: dict[TopicPartition, list[tuple[int, int]]] = {}
        for rng in event.trained_on:
            ranges.setdefault(TopicPartition(rng.topic, rng.partition), []).append((rng.first, rng.last + 1))
        starts = {tp: min(first for first, _ in spans) for tp, spans in ranges.items()}
        stops = {tp: max(stop for _, stop in spans) for tp, spans in ranges.items()}

        async def in_ranges() -> AsyncIterator[ConsumerRecord]:
            async for record in read_slice(self._groups_consumer, starts, stops):
                spans = ranges[TopicPartition(record.topic, record.partition)]
                if any(first <= record.offset < stop for first, stop in spans):
                    yield record

        async def read() -> None:
            async for item in reader.stream(in_ranges()):
                out.extend(trained_trajectories(item.event))

        try:
            await asyncio.wait_for(read(), timeout=GROUPS_READ_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - lineage is a figure; a read failure must not stop decisions
            log.warning("groups of a version not read (its feedback latency is not measured)",
                        version=event.version, error=str(exc) or type(exc).__name__)
        return out

    async def _read_feedback(self) -> None:
        """Rewards (every one: feedback arrival times; the canary's arms) and, while a canary runs, trajectories.
        A reward that fails the reward rules streams applies (rlstream/schemas/rewards.py) is counted and left out."""
        for record in await fetch_batch(self._feedback_consumer, timeout_ms=0, max_records=2000):
            if record.topic == self.topics.rewards:
                try:
                    reward = self.codec.decode(record.value, RewardEvent)
                except Exception:  # noqa: BLE001 - streams dead-letters it; the gate only reads
                    continue
                invalid = validate_reward(reward, self.reward_range)
                if invalid is not None:
                    await self._invalid_reward(invalid, reward.trajectory_id)
                    continue
                self.clock.on_reward(reward)
                if self.canary is not None:
                    self.canary.rewards.on_reward(reward)
            elif self.canary is not None:
                try:
                    trajectory = self.codec.decode(record.value, TrajectoryEvent)
                except Exception:  # noqa: BLE001
                    continue
                invalid = check_rewards(trajectory.reward, trajectory.reward_components, self.reward_range)
                if invalid is not None:
                    await self._invalid_reward(invalid, trajectory.trajectory_id)
                    continue
                self.canary.rewards.on_trajectory(trajectory, self.policy)

    async def _invalid_reward(self, invalid: Invalid, trajectory_id: str) -> None:
        if self.canary is not None:
            self.canary.rewards.invalid += 1
        log.warning("invalid reward left out by the gate", reason=invalid.reason, error=invalid.message,
                    trajectory_id=trajectory_id)
        await self.metrics.emit(mn.GATE_INVALID_REWARDS, 1.0, tags={"policy": self.policy, "reason": invalid.reason})

    async def _observe_serving(self, moved: bool = False) -> None:
        """Measure feedback-to-serving when the serving pointer reached a newer version (read at most every
        ``POLL_S``, and always right after the gate moved it: an evaluation may follow, and it reads nothing)."""
        now = time.monotonic()
        if now - self._serving_read_at < POLL_S and not moved:
            return
        self._serving_read_at = now
        pointer = await self.serving.serving(self.policy)
        if pointer is None or pointer.version <= self.clock.served_version:
            return
        samples = self.clock.on_serving(pointer.version, pointer.moved_at or time.time())
        for value in samples:
            await self.metrics.emit(mn.GATE_FEEDBACK_TO_SERVING_S, value, step=pointer.version,
                                    tags={"policy": self.policy})
        await self.metrics.emit(mn.GATE_FEEDBACK_WAITING, float(self.clock.waiting), step=pointer.version,
                                tags={"policy": self.policy})
        if samples:
            p50, p90 = self.clock.quantiles()
            await self.metrics.emit_many({mn.GATE_FEEDBACK_TO_SERVING_P50_S: p50,
                                          mn.GATE_FEEDBACK_TO_SERVING_P90_S: p90}, step=pointer.version,
                                         tags={"policy": self.policy})
            log.info("feedback to serving", version=pointer.version, trajectories=len(samples),
                     p50_s=round(p50, 2), p90_s=round(p90, 2))

    # -- routes -----------------------------------------------------------------------------------
    def route_of(self, replicas: list[ReplicaAck], version: int) -> ReplicaRoute | None:
        """A replica that acknowledged loading ``version`` (an ``evaluate`` replica first, else any), and the name it
        answers it by."""
        for replica in sorted(replicas, key=lambda r: r.serves):  # evaluate replicas first
            if version in replica.loaded:
                url = (replica.url or secret_value(self.cfg.inference.url) or "").rstrip("/")
                return ReplicaRoute(f"{url}/v1", replica.loaded[version] or self.cfg.inference.served_model,
                                    replica.worker_id, evaluates=not replica.serves)
        return None

    async def _still_loaded(self, route: ReplicaRoute, version: int) -> bool:
        """Whether the replica still acknowledges ``version`` (a full reload may have replaced it meanwhile)."""
        replicas = await self.serving.replicas(self.policy)
        return any(r.worker_id == route.worker_id and version in r.loaded for r in replicas)

    async def measure(self, version: int, evaluation: EvaluationSet, role: str) -> EvalFigures | None:
        """``version``'s figures on ``evaluation``, measured now (nothing is kept between decisions), or None when
        no replica has it loaded (or one replaced it meanwhile). Raises :class:`EvaluationFailed` (counted in
        ``gate/evaluation_failures``, tag ``role``) when the evaluation produced no result."""
        route = self.route_of(await self.serving.replicas(self.policy), version)
        if route is None:
            log.info("no replica has the version loaded; not measured", version=version, role=role)
            return None
        # the replica keeps the version loaded until the figures are in (an evaluate replica loads no newer
        # full-weights candidate over it; a serve replica does not trim the adapter away)
        hold = self.serving.held_for_evaluation(self.policy, route.worker_id, version, EVALUATION_HOLD_S)

        async def request_failed(reason: str) -> None:
            await self.metrics.emit(mn.GATE_EVALUATION_REQUEST_FAILURES, 1.0, step=version,
                                    tags={"policy": self.policy, "role": role, "reason": reason})

        try:
            async with hold:
                figures = await evaluate_version(evaluation, version, route.base_url, route.model,
                                                 secret_value(self.cfg.inference.api_key),
                                                 on_request_failure=request_failed)
                # asked while the hold stands: once released, a serve replica may trim the adapter at once
                still_loaded = await self._still_loaded(route, version)
        except EvaluationFailed as exc:
            await self.metrics.emit(mn.GATE_EVALUATION_FAILURES, 1.0, step=version,
                                    tags={"policy": self.policy, "role": role})
            log.warning("evaluation failed: no decision, tried again later", version=version, role=role,
                        error=str(exc))
            raise
        if not still_loaded:
            log.info("version replaced on the replica during its evaluation; figures dropped", version=version)
            return None
        log.info("version evaluated", version=version, role=role, model=route.model,
                 reward_mean=round(figures.reward_mean, 3), answer_parse_rate=round(figures.answer_parse_rate, 3),
                 samples=figures.samples, seconds=round(figures.seconds, 2))
        await self.publish_answers(figures, evaluation, route.model, role)
        return figures

    def answer_trajectories(self, figures: EvalFigures, evaluation: EvaluationSet, model: str,
                            role: str) -> list[TrajectoryEvent]:
        """The held-out answers of ``figures``' version that ``gate.publish_answers`` asks for: the first sample of
        each of the first examples (the same prompts and seeds for every version), as ``validation``
        trajectories."""
        wanted = {f"{e['id']}#0": str(e["id"]) for e in evaluation.examples[:self.gcfg.publish_answers]}
        events = []
        for result in figures.results:
            example_id = wanted.get(result.key)
            if example_id is None or result.answer is None or not result.answer.messages:
                continue
            answer = result.answer
            events.append(TrajectoryEvent(
                run_id=self.cfg.run_id, example_id=example_id,
                group_id=f"gate-{self.policy}-v{figures.version}-{result.key}", group_size=1, generation_index=0,
                policy=self.policy, policy_version=figures.version, source=TrajectorySource.validation,
                messages=list(answer.messages), reward=result.reward, reward_components=dict(answer.components),
                metadata={"gate.sample_key": result.key, "gate.seed": str(answer.seed), "gate.model": model,
                          "gate.role": role},
                producer_id=DECIDED_BY))
        return events

    async def publish_answers(self, figures: EvalFigures, evaluation: EvaluationSet, model: str, role: str) -> None:
        """Publish a version's held-out answers (:meth:`answer_trajectories`) once per gate, on ``trajectories``
        keyed by example id; a failure to publish is logged and decides nothing."""
        if self.gcfg.publish_answers <= 0 or figures.version in self.answers_published:
            return
        events = self.answer_trajectories(figures, evaluation, model, role)
        try:
            for event in events:
                await self.producer.send_and_wait(self.topics.trajectories, self.codec.encode(event),
                                                  key=event.example_id.encode())
        except Exception as exc:  # noqa: BLE001 - what the console shows must never stop a decision
            log.warning("held-out answers not published", version=figures.version, error=str(exc))
            return
        self.answers_published.add(figures.version)
        log.info("held-out answers published", version=figures.version, role=role, trajectories=len(events))

    def plan(self) -> EvaluationPlan:
        """This decision's sample size: what ``gate.power`` asks for at the paired reward std of the last decision
        (at least ``gate.difference_std``), within the held-out set (all of it when too small)."""
        needed = sample_size(self.difference_std, self.rule.margin, self.rule.alpha, self.gcfg.power)
        plan = evaluation_plan(needed, len(self.evaluation.examples), self.evaluation.samples)
        if plan.pairs < needed:
            log.warning("the held-out set is too small for the power asked; all of it is used", needed=needed,
                        examples=plan.examples, samples=plan.samples, pairs=plan.pairs, power=self.gcfg.power,
                        margin=self.rule.margin, difference_std=round(self.difference_std, 3))
        return plan

    def sized(self, plan: EvaluationPlan) -> EvaluationSet:
        """The held-out set cut to ``plan`` (the first examples, the first samples of each: the same for every
        version of one decision)."""
        return replace(self.evaluation, examples=self.evaluation.examples[:plan.examples], samples=plan.samples)

    # -- deciding about a candidate ---------------------------------------------------------------
    def next_candidate(self, serving_version: int | None) -> int | None:
        floor = max(self.decided, serving_version if serving_version is not None else 0)
        newer = [v for v in self.known if v > floor]
        return max(newer) if newer else None

    async def serve_base(self) -> None:
        """Promote version 0 (the base weights, announced by the learner) without evaluation while no serving pointer
        exists: production traffic gets nothing before it (the gateway answers 503) and nothing unevaluated after
        it. A fenced compare-and-set from no pointer: a gate that lost the race changes nothing."""
        record = self.known[0]
        outcome = await move_serving_when_loaded(
            self.serving, self.policy, 0, decision=DecisionKind.promote,
            reason="version 0: the base weights serve without evaluation", decided_by=DECIDED_BY, expected_version=-1,
            uri=record.uri, sha256=_digest(record), timeout_s=self.gcfg.load_timeout_s, producer=self.producer,
            codec=self.codec, topic=self.topics.promotions)
        if outcome.moved and outcome.decision is not None:
            await self._decided(outcome.decision)
        else:
            log.warning("version 0 not serving yet", reason=outcome.reason)
            await asyncio.sleep(ERROR_BACKOFF_S)

    async def step(self) -> None:
        """Decide about the newest candidate above the serving version, when there is one: the candidate, the
        serving version and the anchor are measured now on the same prompts and seeds, and judged (rules.py)."""
        pointer = await self.serving.serving(self.policy)
        serving_version = pointer.version if pointer is not None else None
        if pointer is None and 0 in self.known:  # the base weights serve first, without evaluation
            await self.serve_base()
            return
        if pointer is not None and pointer.floor > self.decided:
            self.decided = pointer.floor  # a rolled-back version (or older) never comes back by a promotion
        baseline_version = serving_version if serving_version is not None else 0
        anchor_version = self.anchor_for(pointer, baseline_version)
        candidate = self.next_candidate(serving_version)
        if candidate is None:
            return
        route = await self._wait_loaded(candidate)
        if route is None:
            return
        plan = self.plan()
        evaluation = self.sized(plan)
        try:
            candidate_figures = await self.measure(candidate, evaluation, "candidate")
            if candidate_figures is None:
                return  # replaced during the evaluation: the next step takes the newest
            serving_figures = await self.measure(baseline_version, evaluation, "serving")
            anchor_figures = (serving_figures if anchor_version == baseline_version
                              else await self.measure(anchor_version, evaluation, "anchor"))
        except EvaluationFailed:
            await asyncio.sleep(ERROR_BACKOFF_S)
            return  # no result is no decision: the next step measures again
        if serving_figures is None and serving_version is not None:
            log.warning("serving version not measurable now; no decision", candidate=candidate,
                        serving=serving_version)
            await asyncio.sleep(ERROR_BACKOFF_S)
            return
        anchor_fresh = anchor_figures is not None
        if anchor_figures is None and serving_figures is not None:
            anchor_figures, anchor_version = self._anchor_not_loaded(anchor_version, serving_figures)
        elif anchor_figures is not None:
            self.anchor_figures = anchor_figures
        await self.metrics.emit(mn.GATE_EVAL_REWARD_MEAN, candidate_figures.reward_mean, step=candidate,
                                tags={"policy": self.policy, "role": "candidate"})
        if serving_figures is not None:
            await self.metrics.emit(mn.GATE_EVAL_REWARD_MEAN, serving_figures.reward_mean, step=baseline_version,
                                    tags={"policy": self.policy, "role": "serving"})
        self.decided = candidate
        verdict = judge(candidate_figures, serving_figures, self.rule, anchor_figures)
        measured = verdict.test("reward", "serving")
        if measured is not None and measured.n >= 2:
            # the pilot of the next decision's sample size; never below the configured std (a pilot of near-identical
            # versions measures almost no spread, and a tiny sample would lose the power asked for)
            self.difference_std = max(measured.std, self.gcfg.difference_std)
        evidence = {**verdict.evidence(), "plan.needed": float(plan.needed), "plan.examples": float(plan.examples),
                    "plan.samples": float(plan.samples), "anchor_fresh": float(anchor_fresh)}
        if verdict.promote:
            moved = next_anchor(verdict, candidate, anchor_version)  # version 0 (the base weights) is an anchor too
            evidence[ANCHOR_KEY] = float(candidate if moved is None else moved)
        else:
            evidence[ANCHOR_KEY] = float(anchor_version)
        if not verdict.promote:
            await self.record(DecisionKind.reject, candidate, f"rejected: {verdict.reason}", serving_version,
                              candidate_figures, serving_figures, extra=evidence)
        elif self.gcfg.canary_share > 0 and serving_version is not None:
            await self.start_canary(candidate, serving_version, candidate_figures, serving_figures, verdict, evidence)
        else:
            await self.promote(candidate, serving_version, candidate_figures, serving_figures, verdict, evidence)

    def anchor_for(self, pointer: ServingPointer | None, serving_version: int) -> int:
        """The anchor of this decision: the best version promoted, unless an operator's rollback left it behind (at
        or below the pointer's floor, above serving), or none is known yet: then the serving version."""
        anchor = self.anchor
        if anchor is None or (pointer is not None and serving_version < anchor <= pointer.floor):
            anchor = serving_version
        self.anchor = anchor
        return anchor

    def _anchor_not_loaded(self, anchor: int, serving: EvalFigures) -> tuple[EvalFigures, int]:
        """The anchor's figures when no replica holds it now (a full-weights fleet holds serving and the candidate
        only): its latest measurement, on the same prompts and seeds; without one (a restarted gate) the serving
        version becomes the anchor."""
        if self.anchor_figures is not None and self.anchor_figures.version == anchor:
            log.info("anchor not loaded on any replica; its latest measurement is used", anchor=anchor)
            return self.anchor_figures, anchor
        log.warning("anchor not loaded on any replica and not measured by this gate; the serving version is the "
                    "anchor now", anchor=anchor, serving=serving.version)
        self.anchor, self.anchor_figures = serving.version, serving
        return serving, serving.version

    async def _move_anchor(self, version: int) -> None:
        """Make ``version`` the anchor, on the serving pointer too (replicas keep it loaded; a restart reads it)."""
        self.anchor = version
        try:
            await self.serving.set_anchor(self.policy, version, await self.serving.issue_token(self.policy))
        except ServingMoveRefused as exc:  # a newer decision took over; the next promotion records it again
            log.warning("anchor not recorded on the serving pointer", anchor=version, error=str(exc))

    async def _wait_loaded(self, candidate: int) -> ReplicaRoute | None:
        """A replica that loaded ``candidate``; None when a newer candidate came meanwhile, or after
        ``gate.load_timeout_s`` (a rejection is recorded then)."""
        deadline = time.monotonic() + self.gcfg.load_timeout_s
        while True:
            route = self.route_of(await self.serving.replicas(self.policy), candidate)
            if route is not None:
                return route
            if max(self.known) > candidate:
                return None  # superseded: decide about the newest
            if time.monotonic() >= deadline:
                self.decided = candidate
                pointer = await self.serving.serving(self.policy)
                await self.record(DecisionKind.reject, candidate, f"rejected: no replica loaded version {candidate} "
                                  f"within {self.gcfg.load_timeout_s:g}s", pointer.version if pointer else None)
                return None
            await asyncio.sleep(POLL_S)
            await self.pump()

    async def promote(self, candidate: int, serving_version: int | None, candidate_figures: EvalFigures,
                      serving_figures: EvalFigures | None, verdict: Verdict,
                      evidence: dict[str, float] | None = None) -> None:
        """Move serving to ``candidate``; ``evidence`` (the tests' figures and the anchor after the decision) goes
        into the decision's ``candidate_metrics``."""
        evidence = evidence if evidence is not None else verdict.evidence()
        record = self.known[candidate]
        outcome = await move_serving_when_loaded(
            self.serving, self.policy, candidate, decision=DecisionKind.promote, reason=f"promoted: {verdict.reason}",
            decided_by=DECIDED_BY, expected_version=serving_version if serving_version is not None else -1,
            uri=record.uri, sha256=_digest(record), timeout_s=await self._move_timeout(record), producer=self.producer,
            codec=self.codec, topic=self.topics.promotions,
            candidate_metrics={**candidate_figures.metrics(), **evidence},
            serving_metrics=serving_figures.metrics() if serving_figures else {})
        if outcome.moved and outcome.decision is not None:
            await self._decided(outcome.decision)
            if ANCHOR_KEY in evidence:
                await self._move_anchor(int(evidence[ANCHOR_KEY]))
                if self.anchor == candidate:
                    self.anchor_figures = candidate_figures
            await self._observe_serving(moved=True)
        else:
            await self.record(DecisionKind.reject, candidate, f"rejected: serving could not move: {outcome.reason}",
                              serving_version, candidate_figures, serving_figures,
                              extra={**evidence, ANCHOR_KEY: float(self.anchor if self.anchor is not None else -1)})

    async def _move_timeout(self, record: PolicyVersion) -> float:
        """How long a move waits for the fleet. A serve replica following the newest announced version holds one
        set of full weights and never goes back to an older full version by itself, so a full version already
        replaced by a newer candidate will not come back: a short wait. Serve replicas that follow the serving
        pointer (``inference.full_weights_follow: serving``) load it on the move's request: ``gate.load_timeout_s``."""
        if record.kind != WeightsKind.full:
            return self.gcfg.load_timeout_s
        serving = await self.serving.serve_replicas(self.policy)
        if serving and all(r.follows == "serving" for r in serving):
            return self.gcfg.load_timeout_s
        return FULL_MOVE_TIMEOUT_S

    # -- canaries ---------------------------------------------------------------------------------
    async def start_canary(self, candidate: int, serving_version: int, candidate_figures: EvalFigures,
                           serving_figures: EvalFigures | None, verdict: Verdict,
                           evidence: dict[str, float] | None = None) -> None:
        """Give the candidate ``gate.canary_share`` of new sessions (and of sessionless callers): a LoRA candidate
        once every alive serve replica loaded it, a full-weights one on its share of the serve replicas
        (:func:`canary_replicas`; the others keep serving). With fewer than two serve replicas a full-weights
        candidate cannot run beside serving: it is promoted on the offline test alone, and the record says so."""
        record = self.known[candidate]
        evidence = evidence if evidence is not None else verdict.evidence()
        share = self.gcfg.canary_share
        workers: tuple[str, ...] = ()
        if record.kind == WeightsKind.full:
            workers = canary_replicas([r.worker_id for r in await self.serving.serve_replicas(self.policy)], share)
            if not workers:
                log.warning("no canary for a full-weights version with fewer than two serve replicas; promoted on "
                            "the offline test", version=candidate)
                await self.promote(candidate, serving_version, candidate_figures, serving_figures, verdict,
                                   {**evidence, "canary_skipped": 1.0})
                return
        token = await self.serving.issue_token(self.policy)
        try:
            if workers:  # the canary's replicas load it as soon as the pointer names them
                await self.serving.set_canary(self.policy, candidate, share, token, workers)
            else:
                await self.serving.request_load(self.policy, candidate, token)
            readiness = await self._canary_readiness(candidate, workers)
            deadline = time.monotonic() + self.gcfg.load_timeout_s
            while not readiness.ready and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
                await self.pump()
                readiness = await self._canary_readiness(candidate, workers)
            if not readiness.ready:
                await (self.serving.set_canary(self.policy, None, 0.0, token) if workers
                       else self.serving.request_load(self.policy, None, token))
                await self.record(DecisionKind.reject, candidate, f"rejected: canary not started: {readiness.reason}",
                                  serving_version, candidate_figures, serving_figures, token, extra=evidence)
                return
            if not workers:
                await self.serving.set_canary(self.policy, candidate, share, token)
                await self.serving.request_load(self.policy, None, token)
        except ServingMoveRefused as exc:
            await self.record(DecisionKind.reject, candidate, f"rejected: canary not started: {exc}",
                              serving_version, candidate_figures, serving_figures, extra=evidence)
            return
        now = time.time()
        self.canary = Canary(candidate, serving_version, now, share, record.uri, _digest(record),
                             OnlineRewards(candidate, serving_version, datetime.fromtimestamp(now, timezone.utc)),
                             {**candidate_figures.metrics(), **evidence},
                             serving_figures.metrics() if serving_figures else {})
        await self._save_canary(self.canary)
        where = f" on replicas {', '.join(workers)}" if workers else ""
        await self._record_canary(DecisionKind.canary, candidate, f"canary on {share:.0%} of new sessions{where}: "
                                  f"{verdict.reason}", serving_version, token, self.canary, {})

    async def _canary_readiness(self, candidate: int, workers: tuple[str, ...]) -> FleetReadiness:
        """Whether the canary can take its share: every alive serve replica has it (LoRA), or every replica of its
        share (full weights)."""
        replicas = await self.serving.replicas(self.policy)
        if workers:
            replicas = [r for r in replicas if r.worker_id in workers]
        return fleet_readiness(replicas, candidate)

    async def _save_canary(self, canary: Canary) -> None:
        """Save the canary's test state in Redis (a restarted gate resumes it)."""
        arm_canary, arm_serving = canary.rewards.state()
        await self.serving.save_canary_state(self.policy, CanaryState(
            canary.version, canary.serving, canary.share, canary.started_at, arm_canary, arm_serving,
            canary.rewards.invalid, canary.held, canary.candidate_metrics, canary.serving_metrics, canary.uri,
            canary.sha256))

    async def _resume_canary(self, pointer: ServingPointer | None) -> None:
        """Take over the canary the serving pointer names, with the test state a previous gate saved (from zero
        when none matches: its earlier feedback is then not counted); forget a saved state whose canary ended."""
        saved = await self.serving.canary_state(self.policy)
        running = pointer.canary_version if pointer is not None else None
        if running is None:
            if saved is not None:
                log.info("the saved canary ended while the gate was down; its state is dropped", version=saved.version)
                await self.serving.clear_canary_state(self.policy)
            return
        assert pointer is not None
        if saved is None or saved.version != running:
            log.warning("a running canary with no saved test state: its test starts from zero", version=running)
            saved = CanaryState(running, pointer.version, pointer.canary_share, time.time())
        self.canary = Canary(saved.version, saved.serving, saved.started_at, saved.share, saved.uri, saved.sha256,
                             OnlineRewards.resumed(saved.version, saved.serving,
                                                   datetime.fromtimestamp(saved.started_at, timezone.utc),
                                                   saved.canary, saved.serving_arm, saved.invalid_rewards),
                             dict(saved.candidate_metrics), dict(saved.serving_metrics), held=saved.held)
        self.decided = max(self.decided, saved.version)
        log.info("canary resumed", version=saved.version, serving=saved.serving, canary_n=saved.canary.count,
                 serving_n=saved.serving_arm.count, held=saved.held)

    async def step_canary(self) -> None:
        """Run the sequential test on the canary's online rewards; finish or roll back when it decides. Undecided
        at ``gate.canary_max_s`` or ``gate.canary_max_samples`` per arm: rejected, or held for an operator
        (``gate.canary_undecided``), never promoted. A canary an operator ended (``rlstream rollback`` /
        ``rlstream promote`` clear it on the pointer, and record why) is dropped."""
        canary = self.canary
        assert canary is not None
        pointer = await self.serving.serving(self.policy)
        if pointer is None or pointer.canary_version != canary.version:
            log.warning("the canary was ended by another decision; its test is dropped", version=canary.version,
                        serving=pointer.version if pointer else None)
            await self.serving.clear_canary_state(self.policy)
            self.canary = None
            return
        state = sprt(canary.rewards.canary, canary.rewards.serving, self.sprt)
        elapsed = time.time() - canary.started_at
        outcome = state.outcome
        if outcome == SequentialOutcome.wait and elapsed >= self.gcfg.canary_max_s:
            outcome = SequentialOutcome.undecided
        if outcome == SequentialOutcome.wait or canary.held:
            await self._save_canary(canary)
            await asyncio.sleep(POLL_S)
            return
        online = {**canary.rewards.figures(), **state.figures(), "canary_seconds": elapsed}
        if outcome == SequentialOutcome.undecided:
            await self.undecided_canary(canary, state, online)
            if canary.held:
                return
        elif outcome == SequentialOutcome.rollback:
            await self.rollback_canary(canary, state, online)
        else:
            await self.finish_canary(canary, state, online)
        await self.serving.clear_canary_state(self.policy)
        self.canary = None

    def _online_summary(self, canary: Canary, state: SequentialState) -> str:
        return (f"online reward {canary.rewards.canary.mean:.3f} (n={state.canary_n}) vs serving "
                f"{canary.rewards.serving.mean:.3f} (n={state.serving_n}), {canary.rewards.invalid} invalid rewards "
                f"left out, sequential test llr {state.llr:.2f} within ({self.sprt.lower:.2f}, {self.sprt.upper:.2f})")

    async def undecided_canary(self, canary: Canary, state: SequentialState, online: dict[str, float]) -> None:
        """The test did not decide in time or samples: the canary ends rejected (serving stays), or, with
        ``gate.canary_undecided: hold``, keeps its share until an operator promotes or rolls back."""
        limit = (f"{self.sprt.max_samples} rewards per arm" if min(state.canary_n, state.serving_n)
                 >= self.sprt.max_samples else f"gate.canary_max_s {self.gcfg.canary_max_s:g}s")
        why = (f"canary v{canary.version} undecided after {online['canary_seconds']:.1f}s ({limit}): "
               f"{self._online_summary(canary, state)}")
        token = await self.serving.issue_token(self.policy)
        if self.gcfg.canary_undecided == "hold":
            canary.held = True
            await self._save_canary(canary)
            await self._record_canary(DecisionKind.canary, canary.version, f"held for an operator: {why}",
                                      canary.serving, token, canary, {**online, "canary_held": 1.0})
            return
        try:
            await self.serving.set_canary(self.policy, None, 0.0, token)
        except ServingMoveRefused as exc:  # a newer decision (an operator's) took over: nothing left to end
            log.warning("canary not ended by the gate", version=canary.version, error=str(exc))
        await self._record_canary(DecisionKind.reject, canary.version, f"rejected: {why}", canary.serving, token,
                                  canary, {**online, "canary_undecided": 1.0})

    async def rollback_canary(self, canary: Canary, state: SequentialState, online: dict[str, float]) -> None:
        token = await self.serving.issue_token(self.policy)
        try:
            await self.serving.set_canary(self.policy, None, 0.0, token)
        except ServingMoveRefused as exc:  # a newer decision (an operator's) took over: nothing left to end
            log.warning("canary not ended by the gate", version=canary.version, error=str(exc))
        elapsed = time.time() - canary.started_at
        await self.metrics.emit(mn.GATE_CANARY_ROLLBACK_S, elapsed, step=canary.version, tags={"policy": self.policy})
        reason = (f"canary v{canary.version} rolled back to v{canary.serving} after {elapsed:.1f}s: online reward "
                  f"{canary.rewards.canary.mean:.3f} (n={state.canary_n}) vs serving {canary.rewards.serving.mean:.3f} "
                  f"(n={state.serving_n}), sequential test llr {state.llr:.2f} >= {self.sprt.upper:.2f} "
                  f"(alpha {self.sprt.alpha:g}, effect {self.sprt.delta:g})")
        await self._record_canary(DecisionKind.rollback, canary.serving, reason, canary.serving, token, canary, online)

    async def finish_canary(self, canary: Canary, state: SequentialState, online: dict[str, float]) -> None:
        token = await self.serving.issue_token(self.policy)
        reason = (f"canary v{canary.version} finished after {online['canary_seconds']:.1f}s: online reward "
                  f"{canary.rewards.canary.mean:.3f} (n={state.canary_n}) vs serving {canary.rewards.serving.mean:.3f} "
                  f"(n={state.serving_n}), sequential test llr {state.llr:.2f} <= {self.sprt.lower:.2f}")
        outcome = await move_serving_when_loaded(
            self.serving, self.policy, canary.version, decision=DecisionKind.finish_canary, reason=reason,
            decided_by=DECIDED_BY, token=token, expected_version=canary.serving, uri=canary.uri,
            sha256=canary.sha256, timeout_s=self.gcfg.load_timeout_s, producer=self.producer,
            codec=self.codec, topic=self.topics.promotions,
            candidate_metrics={**canary.candidate_metrics, **online}, serving_metrics=canary.serving_metrics)
        try:
            await self.serving.set_canary(self.policy, None, 0.0, token)
        except ServingMoveRefused as exc:
            log.warning("canary not ended by the gate", version=canary.version, error=str(exc))
        if outcome.moved and outcome.decision is not None:
            await self._decided(outcome.decision)
            anchor = canary.candidate_metrics.get(ANCHOR_KEY)
            if anchor is not None and int(anchor) != self.anchor:
                await self._move_anchor(int(anchor))
            await self._observe_serving(moved=True)
        else:
            await self._record_canary(DecisionKind.reject, canary.version, f"canary ended, serving could not move: "
                                      f"{outcome.reason}", canary.serving, token, canary, online)

    async def _record_canary(self, decision: DecisionKind, version: int, reason: str, serving_before: int | None,
                             token: int, canary: Canary, online: dict[str, float]) -> None:
        """A canary decision on ``promotions``: the offline figures it started on, its online figures and version."""
        event = PromotionDecision(policy=self.policy, version=version, decision=decision, reason=reason,
                                  serving_before=serving_before,
                                  candidate_metrics={**canary.candidate_metrics, **online,
                                                     "canary_version": float(canary.version)},
                                  serving_metrics=canary.serving_metrics, decided_by=DECIDED_BY,
                                  fencing_token=token)
        await publish_decision(self.producer, self.codec, self.topics.promotions, event)
        await self._decided(event)

    # -- records ----------------------------------------------------------------------------------
    async def record(self, decision: DecisionKind, version: int, reason: str, serving_before: int | None,
                     candidate: EvalFigures | None = None, serving: EvalFigures | None = None, token: int = 0,
                     extra: dict[str, float] | None = None) -> PromotionDecision:
        """Write a decision that does not move the pointer itself (the moves record theirs) to ``promotions``."""
        event = PromotionDecision(policy=self.policy, version=version, decision=decision, reason=reason,
                                  serving_before=serving_before,
                                  candidate_metrics={**(candidate.metrics() if candidate else {}), **(extra or {})},
                                  serving_metrics=serving.metrics() if serving else {}, decided_by=DECIDED_BY,
                                  fencing_token=token)
        await publish_decision(self.producer, self.codec, self.topics.promotions, event)
        await self._decided(event)
        return event

    async def _decided(self, event: PromotionDecision) -> None:
        self.decisions.append(event)
        log.info("promotion decision", decision=event.decision.value, version=event.version, reason=event.reason)
        # a canary's rollback is marked at the canary's version (the record names the version production went back to)
        step = int(event.candidate_metrics.get("canary_version", event.version))
        await self.metrics.emit(mn.GATE_DECISIONS, 1.0, step=step,
                                tags={"policy": self.policy, "decision": event.decision.value})


def _digest(record: PolicyVersion) -> str:
    """One digest naming the version's files (the first file's sha256 when it has one file)."""
    return record.files[0].sha256 if len(record.files) == 1 else ""


async def run_gate(cfg: RlstreamConfig, stop: asyncio.Event | None = None) -> None:
    """Run the promotion gate of ``cfg.policy`` until ``stop`` (or SIGINT/SIGTERM through the CLI)."""
    evaluation = evaluation_set(cfg)
    await create_topics(cfg.kafka, cfg.topics)
    codec = codec_for(cfg)
    codec.ensure_registered([PromotionDecision.avro_name, MetricEvent.avro_name, TrajectoryEvent.avro_name])
    control = ControlPlane(str(cfg.redis.url), cfg.redis.retry_max_s)
    try:
        await PromotionGate(cfg, control, evaluation, codec=codec).run(stop)
    finally:
        await control.close()


def serve_gate(cfg: RlstreamConfig) -> None:
    """Run the promotion gate until SIGINT/SIGTERM. Raises :class:`rlstream.gate.evaluation.EvaluationSetError`
    when the held-out set cannot be read."""

    async def main() -> None:
        await run_gate(cfg, stop_event())

    asyncio.run(main())
