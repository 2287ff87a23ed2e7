"""Operator decisions about the serving version (``rlstream rollback``, ``rlstream promote``) and reading the
``promotions`` topic (``status``, ``lineage``). See docs/promotion.md.

An operator's move goes through the same path as the gate's: the version must be one the fenced learner announced
(transport/trusted_versions.py), the fleet loads it, the pointer moves once every alive replica acknowledged it
(fenced, with a new serving token), and the decision is recorded on ``promotions``.
"""
from __future__ import annotations

import getpass
import socket

from rlstream.schemas.codec import codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, PolicyVersion, PromotionDecision
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import create_topics, make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.serving import MoveOutcome, ServingControl, files_digest, move_serving_when_loaded
from rlstream.transport.topic_reader import TopicMissingError, TopicReader, open_reader, read_to_end
from rlstream.transport.trusted_versions import TrustedVersions, UntrustedVersionRecord

log = get_logger(__name__)


class OperatorMoveError(ValueError):
    """An operator's decision that cannot be carried out (no trusted record of the version, no Redis)."""


def operator_name() -> str:
    """Who an operator decision is recorded as: ``cli:<user>@<host>``."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in this environment
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


async def trusted_version(cfg: RlstreamConfig, control: ControlPlane, policy: str, version: int) -> PolicyVersion:
    """The trusted PolicyVersion record of ``version`` (read from the beginning of ``policy-versions``, each record
    checked in order); :class:`OperatorMoveError` when the fenced learner never announced it."""
    topic = TopicNames.from_config(cfg.topics).policy_versions
    trust = TrustedVersions(control, cfg.inference.max_version_jump, wait_pending=False)
    reader = await open_reader(cfg.kafka)
    found: PolicyVersion | None = None
    try:
        versions = TopicReader(reader, codec_for(cfg), PolicyVersion)
        async for item in versions.stream(read_to_end(reader, topic)):
            if item.event.policy != policy:
                continue
            try:
                await trust.check(item.event, item.source.value)
            except UntrustedVersionRecord:
                continue
            if item.event.version == version:
                found = item.event
    except TopicMissingError as exc:
        raise OperatorMoveError(str(exc)) from exc
    finally:
        await reader.stop()
    if found is None:
        raise OperatorMoveError(f"version {version} of {policy!r} was never announced by the fenced learner")
    return found


async def operator_move(cfg: RlstreamConfig, version: int, decision: DecisionKind, reason: str,
                        policy: str | None = None, timeout_s: float = 120.0) -> MoveOutcome:
    """Move serving to ``version`` by an operator's ``decision`` (``rollback`` or ``force_promote``) once every
    alive replica has it loaded, and record it on ``promotions``. Returns the outcome (moved, or why not)."""
    if decision not in (DecisionKind.rollback, DecisionKind.force_promote):
        raise ValueError(f"an operator decides rollback or force_promote, not {decision.value}")
    if not cfg.redis.url:
        raise OperatorMoveError("redis.url is not set: the serving pointer lives in Redis")
    policy = policy or cfg.policy
    names = TopicNames.from_config(cfg.topics)
    await create_topics(cfg.kafka, cfg.topics)  # the promotions topic may predate nothing yet
    control = ControlPlane(str(cfg.redis.url))
    producer = make_producer(cfg.kafka)
    try:
        record = await trusted_version(cfg, control, policy, version)
        digest = files_digest(record)
        await producer.start()
        return await move_serving_when_loaded(
            ServingControl(control), policy, version, decision=decision, reason=reason, decided_by=operator_name(),
            uri=record.uri, sha256=digest, timeout_s=timeout_s, producer=producer, codec=codec_for(cfg),
            topic=names.promotions)
    finally:
        await producer.stop()
        await control.close()


async def read_decisions(cfg: RlstreamConfig, policy: str | None = None, version: int | None = None,
                         tail: int | None = None) -> list[PromotionDecision]:
    """The decisions on ``promotions`` (of ``policy``, about ``version`` when given), oldest first; only the last
    ``tail`` per partition when given. A missing topic reads as none."""
    topic = TopicNames.from_config(cfg.topics).promotions
    reader = await open_reader(cfg.kafka)
    out: list[PromotionDecision] = []
    try:
        decisions = TopicReader(reader, codec_for(cfg), PromotionDecision)  # read-only: undecodable ones skipped
        async for item in decisions.stream(read_to_end(reader, topic, tail=tail)):
            event = item.event
            if (policy is None or event.policy == policy) and (version is None or event.version == version):
                out.append(event)
    except TopicMissingError:
        return []
    finally:
        await reader.stop()
    return sorted(out, key=lambda d: d.decided_at)
