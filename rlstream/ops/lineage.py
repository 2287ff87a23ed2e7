"""``rlstream lineage VERSION``: from a published weight version back to the groups it was trained on and, through
the groups' source offsets, to the trajectory (and reward) records behind them.

The version's record on ``policy-versions`` lists in ``trained_on`` the offsets of ``groups`` that the learner
trained into it (exactly those: skipped and dead-lettered records are not in it). Each group record there carries
``source_offsets``: where each of its members was read on ``trajectories`` (and each late reward on ``rewards``).
Nothing is written and no consumer group is joined: the reads are group-less.

Only a version record the fenced learner announced counts (transport/trusted_versions.py); a record of the
version that is not is reported with the reason and never resolved.

A listed offset whose record is gone (retention), does not decode, or is not a group of the version's policy (a
version announced before lineage was exact, or by another tool that announces ranges) is reported under
``unresolved`` with the reason, never silently dropped.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from rlstream.schemas.codec import codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import OffsetRange, PolicyVersion, SourceOffset, TrajectoryGroup
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.log import get_logger
from rlstream.transport.topic_reader import SourceRecord, TopicReader, open_reader, read_slice, read_to_end
from rlstream.transport.trusted_versions import TrustedVersions, UntrustedVersionRecord

log = get_logger(__name__)


class LineageError(ValueError):
    """The version cannot be resolved (no such version of the policy on ``policy-versions``)."""


@dataclass(frozen=True)
class RecordRef:
    """One record by its position."""

    topic: str
    partition: int
    offset: int

    @classmethod
    def of(cls, source: SourceOffset) -> "RecordRef":
        return cls(source.topic, source.partition, source.offset)


@dataclass
class GroupLineage:
    """One group a version was trained on, and the records behind it."""

    topic: str
    partition: int
    offset: int
    group_id: str
    example_id: str
    run_id: str
    min_policy_version: int
    max_policy_version: int
    reward_mean: float
    trajectory_ids: list[str]
    trajectories: list[RecordRef]  # the members, on `trajectories`
    rewards: list[RecordRef]  # late rewards joined to members, on `rewards` (and any other source topic)


@dataclass(frozen=True)
class Unresolved:
    """An offset of ``trained_on`` that does not resolve to a group of the version's policy, and why."""

    topic: str
    partition: int
    offset: int
    reason: str


@dataclass
class VersionLineage:
    """A published version with the groups and trajectories it was trained on."""

    policy: str
    version: int
    run_id: str
    uri: str
    learner_step: int
    group_count: int
    created_at: str
    trained_on: list[OffsetRange]
    groups: list[GroupLineage] = field(default_factory=list)
    unresolved: list[Unresolved] = field(default_factory=list)

    @property
    def trajectory_offsets(self) -> list[RecordRef]:
        """Every trajectory record behind the version, in group order."""
        return [ref for g in self.groups for ref in g.trajectories]

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "version": self.version, "run_id": self.run_id, "uri": self.uri,
            "learner_step": self.learner_step, "group_count": self.group_count, "created_at": self.created_at,
            "trained_on": [r.model_dump() for r in self.trained_on],
            "groups": [asdict(g) for g in self.groups],
            "trajectories": [asdict(r) for r in self.trajectory_offsets],
            "unresolved": [asdict(u) for u in self.unresolved],
        }


async def find_version(consumer: AIOKafkaConsumer, cfg: RlstreamConfig, version: int, policy: str,
                       trust: TrustedVersions) -> PolicyVersion:
    """The trusted record of ``policy``'s ``version`` on ``policy-versions`` (the last one, should it have been
    announced twice, e.g. after an interrupted publication); :class:`LineageError` when there is none."""
    topic = TopicNames.from_config(cfg.topics).policy_versions
    reader = TopicReader(consumer, codec_for(cfg), PolicyVersion)  # read-only: an undecodable record is skipped
    found: PolicyVersion | None = None
    known: set[int] = set()
    refused: list[str] = []
    async for item in reader.stream(read_to_end(consumer, topic)):
        if item.event.policy != policy:
            continue
        try:
            await trust.check(item.event, item.source.value)
        except UntrustedVersionRecord as exc:
            if item.event.version == version:
                refused.append(f"offset {item.source.offset}: {exc.reason}: {exc}")
            continue
        known.add(item.event.version)
        if item.event.version == version:
            found = item.event
    if found is None:
        listed = ", ".join(str(v) for v in sorted(known)[-10:]) or "none"
        untrusted = f"; untrusted records of it, not resolved: {'; '.join(refused)}" if refused else ""
        raise LineageError(f"policy {policy!r} has no version {version} announced by its learner on {topic} "
                           f"(latest versions: {listed}){untrusted}")
    return found


def _group_lineage(source: SourceRecord, group: TrajectoryGroup, trajectories_topic: str) -> GroupLineage:
    refs = [RecordRef.of(o) for o in group.source_offsets]
    return GroupLineage(
        topic=source.topic, partition=source.partition, offset=source.offset, group_id=group.group_id,
        example_id=group.example_id, run_id=group.run_id, min_policy_version=group.min_policy_version,
        max_policy_version=group.max_policy_version, reward_mean=group.reward_mean,
        trajectory_ids=[t.trajectory_id for t in group.trajectories],
        trajectories=[r for r in refs if r.topic == trajectories_topic],
        rewards=[r for r in refs if r.topic != trajectories_topic])


async def resolve_groups(consumer: AIOKafkaConsumer, cfg: RlstreamConfig,
                         version: PolicyVersion) -> tuple[list[GroupLineage], list[Unresolved]]:
    """Read the records of ``version.trained_on`` from ``groups``: the groups, and the offsets that are not."""
    names = TopicNames.from_config(cfg.topics)
    unresolved: list[Unresolved] = []

    def rejected(source: SourceRecord, reason: BaseException | str) -> None:
        unresolved.append(Unresolved(source.topic, source.partition, source.offset, f"does not decode: {reason}"))

    reader = TopicReader(consumer, codec_for(cfg), TrajectoryGroup, on_reject=rejected)
    groups: list[GroupLineage] = []
    for rng in version.trained_on:
        tp = TopicPartition(rng.topic, rng.partition)
        begin = (await consumer.beginning_offsets([tp]))[tp]
        end = (await consumer.end_offsets([tp]))[tp]
        seen: set[int] = set()
        start, stop = max(rng.first, begin), min(rng.last + 1, end)
        if stop > start:
            async for item in reader.stream(read_slice(consumer, {tp: start}, {tp: stop})):
                seen.add(item.source.offset)
                group = item.event
                if group.policy != version.policy:
                    unresolved.append(Unresolved(rng.topic, rng.partition, item.source.offset,
                                                 f"a group of policy {group.policy!r}, not {version.policy!r}"))
                    continue
                groups.append(_group_lineage(item.source, group, names.trajectories))
        seen.update(u.offset for u in unresolved if (u.topic, u.partition) == (rng.topic, rng.partition))
        for offset in range(rng.first, rng.last + 1):
            if offset not in seen:
                why = "deleted by retention" if offset < begin else \
                    "beyond the end of the partition" if offset >= end else "no record at this offset"
                unresolved.append(Unresolved(rng.topic, rng.partition, offset, why))
    return groups, unresolved


async def version_lineage(cfg: RlstreamConfig, version: int, policy: str | None = None) -> VersionLineage:
    """Resolve ``version`` of ``policy`` (default: the config's) to its groups and trajectory offsets."""
    policy = policy or cfg.policy
    if not cfg.redis.url:
        raise LineageError("redis.url is not set: version records cannot be checked against the control plane")
    consumer = await open_reader(cfg.kafka)
    control = ControlPlane(cfg.redis.url, retry_max_s=cfg.redis.retry_max_s)
    try:
        trust = TrustedVersions(control, cfg.inference.max_version_jump, wait_pending=False)
        record = await find_version(consumer, cfg, version, policy, trust)
        groups, unresolved = await resolve_groups(consumer, cfg, record)
    finally:
        await consumer.stop()
        await control.close()
    return VersionLineage(
        policy=record.policy, version=record.version, run_id=record.run_id, uri=record.uri,
        learner_step=record.learner_step, group_count=record.group_count, created_at=record.created_at.isoformat(),
        trained_on=list(record.trained_on), groups=groups,
        unresolved=sorted(unresolved, key=lambda u: (u.topic, u.partition, u.offset)))


def render_lineage(lineage: VersionLineage, console: Any) -> None:
    """Print a lineage as rich tables: the version, its groups, its trajectories, and what did not resolve."""
    from rich.table import Table

    console.print(f"policy {lineage.policy} version {lineage.version} (run {lineage.run_id or '-'}, learner step "
                  f"{lineage.learner_step}, {lineage.group_count} groups, {lineage.created_at})\n{lineage.uri}",
                  highlight=False)
    groups = Table("partition", "offset", "group_id", "example_id", "run_id", "versions", "reward_mean",
                   "trajectories", title="groups trained on")
    for g in lineage.groups:
        versions = str(g.min_policy_version) if g.min_policy_version == g.max_policy_version else \
            f"{g.min_policy_version}-{g.max_policy_version}"
        groups.add_row(str(g.partition), str(g.offset), g.group_id, g.example_id, g.run_id, versions,
                       f"{g.reward_mean:.4f}", str(len(g.trajectory_ids)))
    console.print(groups)
    trajectories = Table("group offset", "topic", "partition", "offset", title="trajectory records")
    for g in lineage.groups:
        for ref in g.trajectories:
            trajectories.add_row(f"{g.partition}:{g.offset}", ref.topic, str(ref.partition), str(ref.offset))
    console.print(trajectories)
    if lineage.unresolved:
        missing = Table("topic", "partition", "offset", "reason", title="not resolved")
        for u in lineage.unresolved:
            missing.add_row(u.topic, str(u.partition), str(u.offset), u.reason)
        console.print(missing)
