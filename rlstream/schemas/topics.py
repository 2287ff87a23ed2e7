"""Topic names of DESIGN.md, derived from the configured prefix."""
from __future__ import annotations

from dataclasses import dataclass

from rlstream.schemas.config import TopicsConfig
from rlstream.schemas.models import (CallEvent, DeadLetter, MetricEvent, PolicyVersion, PromotionDecision, RewardEvent,
                                     TrajectoryEvent, TrajectoryGroup)

TRAJECTORIES = "trajectories"
REWARDS = "rewards"
GROUPS = "groups"
POLICY_VERSIONS = "policy-versions"
METRICS = "metrics"
DLQ = "dlq"
PROMOTIONS = "promotions"
CALLS = "calls"
ALL_TOPICS = (TRAJECTORIES, REWARDS, GROUPS, POLICY_VERSIONS, METRICS, DLQ, PROMOTIONS, CALLS)
#: Topics kept as long as ``policy-versions`` (``topics.policy_versions_retention_ms``): the history lineage reads.
LONG_RETENTION_TOPICS = (POLICY_VERSIONS, PROMOTIONS)


@dataclass(frozen=True)
class TopicNames:
    """Full topic names for one prefix."""

    prefix: str = "rlstream."

    @property
    def trajectories(self) -> str:
        return self.prefix + TRAJECTORIES

    @property
    def rewards(self) -> str:
        return self.prefix + REWARDS

    @property
    def groups(self) -> str:
        return self.prefix + GROUPS

    @property
    def policy_versions(self) -> str:
        return self.prefix + POLICY_VERSIONS

    @property
    def metrics(self) -> str:
        return self.prefix + METRICS

    @property
    def dlq(self) -> str:
        return self.prefix + DLQ

    @property
    def promotions(self) -> str:
        return self.prefix + PROMOTIONS

    @property
    def calls(self) -> str:
        """A gateway's calls of sessions, keyed by session id (stitched into trajectories by the stream app)."""
        return self.prefix + CALLS

    def schema_topics(self) -> dict[str, str]:
        """The topic each event schema (full name) is written to: one schema per topic (a registry subject each)."""
        return {TrajectoryEvent.avro_name: self.trajectories, RewardEvent.avro_name: self.rewards,
                TrajectoryGroup.avro_name: self.groups, PolicyVersion.avro_name: self.policy_versions,
                MetricEvent.avro_name: self.metrics, DeadLetter.avro_name: self.dlq,
                PromotionDecision.avro_name: self.promotions, CallEvent.avro_name: self.calls}

    def all(self) -> list[str]:
        return [self.prefix + t for t in ALL_TOPICS]

    @classmethod
    def from_config(cls, topics: TopicsConfig) -> "TopicNames":
        return cls(prefix=topics.prefix)
