"""``rlstream replay``: re-publish a slice of ``trajectories`` as a new run, while the live run goes on.

A slice is ``[from, to)`` per partition. A position is

* a plain offset (``120``), applied to every partition;
* ``partition:offset`` pairs (``0:120,3:80``): only the named partitions are replayed, an
  unnamed one in the other bound means the beginning (``from``) or the end (``to``);
* an ISO-8601 time (``2026-05-01T12:00:00Z``; no zone = UTC), resolved per partition with
  ``offsets_for_times`` to the first record at or after that time.

Without ``--to`` the slice ends at the end offsets of the moment the replay starts, so events the
live run writes meanwhile (and the replay's own output) are never read back.

Every replayed event is a copy with ``run_id`` = the new run, ``source = replay`` (a ``validation`` trajectory, a
held-out answer, stays ``validation``: replayed, it is still never grouped or trained), a new
``trajectory_id`` (uuid5 of new run + original id, so running the same replay twice gives the same
ids and the assembler's de-duplication holds), and ``group_id = "<new run>:<original group id>"``
so groups stay whole and never mix with the live run's. Metadata keeps the lineage:
``replay_of_trajectory_id``, ``replay_of_run_id``, ``replay_of_group_id``, ``replay_of_source``,
``replay_of_offset`` (``topic:partition:offset``). Trajectories without a reward get the one of
the ``rewards`` topic when there is one. Records that do not decode go to ``dlq``.
"""
from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Iterable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from pydantic import ValidationError

from rlstream.transport import metric_names
from rlstream.transport.deadletter import DeadLetterSink
from rlstream.transport.kafka import create_topics, make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.topic_reader import TopicReader, open_reader, partitions_of, read_slice, read_to_end
from rlstream.schemas.codec import AvroCodec, CodecError, codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import MetricEvent, RewardEvent, TrajectoryEvent, TrajectorySource
from rlstream.schemas.topics import TopicNames

log = get_logger(__name__)
SERVICE = "replay"
_REPLAY_NAMESPACE = uuid.UUID("5b0c2f4e-8f1e-4d6a-9a57-2f0b8e1c7d31")


class ReplayError(ValueError):
    """A replay request that cannot be carried out (bad position, unknown partition, ...)."""


# --- positions --------------------------------------------------------------------------
@dataclass(frozen=True)
class Position:
    """One bound of a slice: exactly one of ``offset``, ``per_partition`` or ``timestamp_ms`` is set."""

    offset: int | None = None
    per_partition: dict[int, int] | None = None
    timestamp_ms: int | None = None

    @property
    def names_partitions(self) -> bool:
        return self.per_partition is not None


def parse_position(text: str) -> Position:
    """Parse ``120``, ``0:120,3:80`` or an ISO-8601 time; raises :class:`ReplayError` with the reason."""
    raw = text.strip()
    if not raw:
        raise ReplayError("empty position")
    if raw.isdigit():
        return Position(offset=int(raw))
    if all(_is_pair(part) for part in raw.split(",")):
        pairs: dict[int, int] = {}
        for part in raw.split(","):
            partition, offset = (int(x) for x in part.split(":"))
            if partition in pairs:
                raise ReplayError(f"partition {partition} named twice in {text!r}")
            pairs[partition] = offset
        return Position(per_partition=pairs)
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ReplayError(
            f"position {text!r} is neither an offset (120), partition:offset pairs (0:120,3:80) "
            "nor an ISO-8601 time (2026-05-01T12:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return Position(timestamp_ms=int(when.timestamp() * 1000))


def check_range(first: Position | None, last: Position | None) -> None:
    """Raise :class:`ReplayError` when ``first`` is not before ``last`` (exclusive) in the same terms: an offset
    or a time, or the same partition's offsets; a range that can only be empty is a mistake on the command line."""
    if first is None or last is None:
        return
    if first.timestamp_ms is not None or last.timestamp_ms is not None:
        if first.timestamp_ms is not None and last.timestamp_ms is not None and first.timestamp_ms >= last.timestamp_ms:
            raise ReplayError("--from is not before --to: the time range is empty (--to is exclusive)")
        return
    starts, stops = first.per_partition or {}, last.per_partition or {}
    for partition in sorted(set(starts) | set(stops)):
        a = starts.get(partition, first.offset)
        b = stops.get(partition, last.offset)
        if a is not None and b is not None and a >= b:
            where = f" on partition {partition}" if first.per_partition or last.per_partition else ""
            raise ReplayError(f"--from {a} is not before --to {b}{where}: the range is empty (--to is exclusive)")
    if first.offset is not None and last.offset is not None and first.offset >= last.offset:
        raise ReplayError(f"--from {first.offset} is not before --to {last.offset}: the range is empty "
                          "(--to is exclusive)")


def _is_pair(part: str) -> bool:
    pieces = part.strip().split(":")
    return len(pieces) == 2 and all(p.isdigit() for p in pieces)


async def resolve_slice(
    consumer: AIOKafkaConsumer, topic: str, start: Position | None, stop: Position | None,
) -> dict[TopicPartition, tuple[int, int]]:
    """``{partition: (first offset, stop offset)}`` of the slice, clamped to what the broker holds."""
    parts = await partitions_of(consumer, topic)
    by_number = {tp.partition: tp for tp in parts}
    named: set[int] = set()
    for bound in (start, stop):
        if bound is not None and bound.per_partition is not None:
            unknown = sorted(set(bound.per_partition) - set(by_number))
            if unknown:
                raise ReplayError(f"{topic} has partitions {sorted(by_number)}; no partition {unknown}")
            named |= set(bound.per_partition)
    chosen = [by_number[p] for p in sorted(named)] if named else parts
    begins = await consumer.beginning_offsets(chosen)
    ends = await consumer.end_offsets(chosen)
    firsts = await _resolve(consumer, chosen, start, begins, ends, missing=begins)
    stops = await _resolve(consumer, chosen, stop, begins, ends, missing=ends)
    return {tp: (firsts[tp], max(firsts[tp], stops[tp])) for tp in chosen}


async def _resolve(
    consumer: AIOKafkaConsumer, parts: list[TopicPartition], bound: Position | None,
    begins: dict[TopicPartition, int], ends: dict[TopicPartition, int], missing: dict[TopicPartition, int],
) -> dict[TopicPartition, int]:
    if bound is None:
        return dict(missing)
    out: dict[TopicPartition, int] = {}
    if bound.timestamp_ms is not None:
        found = await consumer.offsets_for_times({tp: bound.timestamp_ms for tp in parts})
        for tp in parts:
            hit = found.get(tp)
            out[tp] = hit.offset if hit is not None else ends[tp]
    else:
        for tp in parts:
            if bound.per_partition is not None:
                out[tp] = bound.per_partition.get(tp.partition, missing[tp])
            else:
                assert bound.offset is not None
                out[tp] = bound.offset
    return {tp: min(max(off, begins[tp]), ends[tp]) for tp, off in out.items()}


# --- filters and rewriting --------------------------------------------------------------
@dataclass(frozen=True)
class ReplayFilter:
    """Which events of the slice are replayed (an empty set means no restriction)."""

    sources: frozenset[str] = frozenset()
    example_ids: frozenset[str] = frozenset()
    run_ids: frozenset[str] = frozenset()
    min_policy_version: int | None = None
    max_policy_version: int | None = None

    def __post_init__(self) -> None:
        allowed = {s.value for s in TrajectorySource}
        bad = sorted(set(self.sources) - allowed)
        if bad:
            raise ReplayError(f"unknown source {bad}; one of {sorted(allowed)}")
        if (self.min_policy_version is not None and self.max_policy_version is not None
                and self.min_policy_version > self.max_policy_version):
            raise ReplayError("min policy version is above max policy version")

    def accepts(self, event: TrajectoryEvent) -> bool:
        if self.sources and _source_value(event) not in self.sources:
            return False
        if self.example_ids and event.example_id not in self.example_ids:
            return False
        if self.run_ids and event.run_id not in self.run_ids:
            return False
        if self.min_policy_version is not None and event.policy_version < self.min_policy_version:
            return False
        if self.max_policy_version is not None and event.policy_version > self.max_policy_version:
            return False
        return True


def _source_value(event: TrajectoryEvent) -> str:
    return event.source.value if isinstance(event.source, TrajectorySource) else str(event.source)


def replay_trajectory_id(new_run_id: str, original_id: str) -> str:
    """Deterministic id of a replayed copy (same replay twice = same ids)."""
    return str(uuid.uuid5(_REPLAY_NAMESPACE, f"{new_run_id}|{original_id}"))


def replay_group_id(new_run_id: str, original_group_id: str) -> str:
    return f"{new_run_id}:{original_group_id}"


def rewrite(event: TrajectoryEvent, new_run_id: str, topic: str, partition: int, offset: int,
            reward: RewardEvent | None = None) -> TrajectoryEvent:
    """The replayed copy of ``event`` (see the module docstring for what changes)."""
    metadata = dict(event.metadata)
    metadata.update(
        replay_of_trajectory_id=event.trajectory_id,
        replay_of_run_id=event.run_id,
        replay_of_group_id=event.group_id,
        replay_of_source=_source_value(event),
        replay_of_offset=f"{topic}:{partition}:{offset}",
    )
    update: dict[str, object] = dict(
        trajectory_id=replay_trajectory_id(new_run_id, event.trajectory_id),
        run_id=new_run_id,
        group_id=replay_group_id(new_run_id, event.group_id),
        # a held-out answer stays one: replaying it must not put held-out prompts into training
        source=TrajectorySource.validation if event.source == TrajectorySource.validation else TrajectorySource.replay,
        metadata=metadata,
        producer_id=SERVICE,
    )
    if event.reward is None and reward is not None:
        update["reward"] = reward.reward
        update["reward_components"] = dict(reward.components)
    return event.model_copy(update=update, deep=True)


# --- the replay -------------------------------------------------------------------------
@dataclass
class ReplayReport:
    """What a replay did; ``ranges`` maps partition -> [first, stop)."""

    new_run_id: str
    source_topic: str
    target_topic: str
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)
    read: int = 0
    published: int = 0
    filtered: int = 0
    dead_lettered: int = 0
    rewards_joined: int = 0
    without_reward: int = 0

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["ranges"] = {str(p): list(r) for p, r in self.ranges.items()}
        return out


async def replay(
    cfg: RlstreamConfig,
    new_run_id: str,
    start: Position | None = None,
    stop: Position | None = None,
    selection: ReplayFilter | None = None,
    *,
    into_prefix: str | None = None,
    join_rewards: bool = True,
) -> ReplayReport:
    """Re-publish ``[start, stop)`` of the trajectories topic as run ``new_run_id`` (source=replay)."""
    if not new_run_id.strip():
        raise ReplayError("the new run id is empty")
    selection = selection or ReplayFilter()
    names = TopicNames.from_config(cfg.topics)
    target_names = TopicNames(prefix=into_prefix) if into_prefix is not None else names
    if into_prefix is not None and into_prefix != names.prefix:
        await create_topics(cfg.kafka, cfg.topics.model_copy(update={"prefix": into_prefix}))
    codec = codec_for(cfg)
    report = ReplayReport(new_run_id=new_run_id, source_topic=names.trajectories,
                          target_topic=target_names.trajectories)
    consumer = await open_reader(cfg.kafka)
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        ranges = await resolve_slice(consumer, names.trajectories, start, stop)
        report.ranges = {tp.partition: r for tp, r in ranges.items()}
        if new_run_id in selection.run_ids:
            log.warning("replaying a run into its own run id: its groups will mix", run_id=new_run_id)
        log.info("replay started", new_run_id=new_run_id, topic=names.trajectories,
                 ranges=report.to_dict()["ranges"], target=target_names.trajectories)
        pending: list[tuple[TrajectoryEvent, int, int]] = []
        starts = {tp: r[0] for tp, r in ranges.items()}
        stops = {tp: r[1] for tp, r in ranges.items()}
        reader = TopicReader(consumer, codec, TrajectoryEvent, errors=(CodecError, ValidationError),
                             dead_letters=DeadLetterSink(producer, codec, names.dlq, SERVICE))
        async for item in reader.stream(read_slice(consumer, starts, stops)):
            event, record = item.event, item.source
            if not selection.accepts(event):
                report.filtered += 1
                continue
            if event.reward is None and join_rewards:
                pending.append((event, record.partition, record.offset))
                continue
            await _send(producer, codec, target_names.trajectories,
                        rewrite(event, new_run_id, record.topic, record.partition, record.offset))
            report.published += 1
        report.read, report.dead_lettered = reader.seen, reader.rejected
        if pending:
            rewards = await _rewards_for(consumer, codec, names.rewards, {e.trajectory_id for e, _, _ in pending})
            for event, partition, offset in pending:
                reward = rewards.get(event.trajectory_id)
                report.rewards_joined += reward is not None
                report.without_reward += reward is None
                await _send(producer, codec, target_names.trajectories,
                            rewrite(event, new_run_id, names.trajectories, partition, offset, reward))
                report.published += 1
        await producer.flush()
        metric = MetricEvent(source=SERVICE, run_id=new_run_id, name=metric_names.REPLAY_PUBLISHED,
                             value=float(report.published), tags={"from_topic": names.trajectories})
        await producer.send_and_wait(target_names.metrics, codec.encode(metric), key=SERVICE.encode())
    finally:
        await producer.stop()
        await consumer.stop()
    log.info("replay done", **{k: v for k, v in report.to_dict().items() if k != "ranges"})
    return report


async def _send(producer: AIOKafkaProducer, codec: AvroCodec, topic: str, event: TrajectoryEvent) -> None:
    await producer.send(topic, codec.encode(event), key=event.example_id.encode())


async def _rewards_for(consumer: AIOKafkaConsumer, codec: AvroCodec, topic: str,
                       wanted: Iterable[str]) -> dict[str, RewardEvent]:
    """The latest reward event of each wanted trajectory id found on the rewards topic."""
    wanted = set(wanted)
    found: dict[str, RewardEvent] = {}
    # no sink: a bad reward event is the streams app's to dead-letter, not ours
    rewards = TopicReader(consumer, codec, RewardEvent, errors=(CodecError, ValidationError))
    async for item in rewards.stream(read_to_end(consumer, topic)):
        reward = item.event
        if reward.trajectory_id in wanted:
            found[reward.trajectory_id] = reward
    return found
