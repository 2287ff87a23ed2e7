"""Following the ``promotions`` topic: how many of the learner's versions the gate rejected in a row.

The learner reads the gate's decisions here (it never imports the gate): :class:`PromotionsFollower` reads the topic
from its start, keeps one policy's decisions (a few per published version) and :func:`rejection_run` folds them
into the run of rejections that decides when the learner moves back to the serving version's weights
(docs/off-policy.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from aiokafka import AIOKafkaConsumer

from rlstream.schemas.codec import AvroCodec, CodecError
from rlstream.schemas.models import DecisionKind, PromotionDecision
from rlstream.transport.log import get_logger
from rlstream.transport.serving import MOVE_OF_DECISION
from rlstream.transport.topic_reader import fetch_batch, wait_for_partitions

log = get_logger(__name__)


@dataclass(frozen=True)
class RejectionRun:
    """The reject decisions since the serving pointer last moved, of versions above a floor: ``count`` of them and
    the ``versions`` they named."""

    count: int = 0
    versions: frozenset[int] = frozenset()


def rejection_run(decisions: Iterable[PromotionDecision], policy: str, above: int) -> RejectionRun:
    """The run of ``reject`` decisions for ``policy`` of versions above ``above`` since the serving pointer last
    moved (``promote``, ``finish_canary``, ``rollback`` or ``force_promote`` end a run; ``canary`` does not)."""
    count, versions = 0, set()
    for decision in decisions:
        if decision.policy != policy:
            continue
        if decision.decision in MOVE_OF_DECISION:
            count, versions = 0, set()
        elif decision.decision == DecisionKind.reject and decision.version > above:
            count += 1
            versions.add(decision.version)
    return RejectionRun(count, frozenset(versions))


class PromotionsFollower:
    """Reads ``promotions`` from its start and keeps ``policy``'s decisions, in order (records that do not decode
    are logged and left out)."""

    def __init__(self, consumer: AIOKafkaConsumer, codec: AvroCodec, topic: str, policy: str) -> None:
        self.consumer = consumer
        self.codec = codec
        self.topic = topic
        self.policy = policy
        self.decisions: list[PromotionDecision] = []
        self._assigned = False

    async def poll(self, timeout_ms: int = 0) -> int:
        """Read what arrived since the last poll; returns how many decisions of the policy were new."""
        if not self._assigned:
            partitions = await wait_for_partitions(self.consumer, self.topic, timeout_s=10.0)
            self.consumer.assign(partitions)
            await self.consumer.seek_to_beginning(*partitions)
            self._assigned = True
        new = 0
        for record in await fetch_batch(self.consumer, timeout_ms=timeout_ms):
            if record.value is None:
                continue
            try:
                decision = self.codec.decode(record.value, PromotionDecision)
            except (CodecError, ValueError) as exc:
                log.warning("promotion decision not decoded", partition=record.partition, offset=record.offset,
                            error=str(exc))
                continue
            if decision.policy == self.policy:
                self.decisions.append(decision)
                new += 1
        return new

    def rejections(self, above: int) -> RejectionRun:
        """:func:`rejection_run` over the decisions read so far."""
        return rejection_run(self.decisions, self.policy, above)
