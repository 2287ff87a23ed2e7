"""Operator decisions about the serving version (``rlstream rollback``, ``rlstream promote``) and reading the
``promotions`` topic (``status``, ``lineage``). See docs/promotion.md.

An operator's move goes through the same path as the gate's: the version must be one the fenced learner announced
(transport/trusted_versions.py), the fleet loads it, the pointer moves once every alive replica acknowledged it
(fenced, with a new serving token), and the decision is recorded on ``promotions``.

An operator's move ends a running canary (the pointer's compare-and-set clears it; the gate drops its test) and a
``reject`` of the canary's version records why. ``rlstream rollback --to <the serving version>`` while a canary
runs ends the canary alone: serving stays where it is.
"""
from __future__ import annotations

import getpass
import socket
from typing import Any

from rlstream.schemas.codec import codec_for
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DecisionKind, PolicyVersion, PromotionDecision
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import create_topics, make_producer
from rlstream.transport.log import get_logger
from rlstream.transport.serving import (MoveOutcome, ServingControl, ServingPointer, files_digest,
                                        move_serving_when_loaded, publish_decision)
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
        serving = ServingControl(control)
        before = await serving.serving(policy)
        if decision == DecisionKind.rollback and before is not None and before.version == version \
                and before.canary_version is not None:
            await producer.start()
            return await end_canary(cfg, serving, producer, policy, before, decision, reason)
        record = await trusted_version(cfg, control, policy, version)
        digest = files_digest(record)
        await producer.start()
        outcome = await move_serving_when_loaded(
            serving, policy, version, decision=decision, reason=reason, decided_by=operator_name(),
            uri=record.uri, sha256=digest, timeout_s=timeout_s, producer=producer, codec=codec_for(cfg),
            topic=names.promotions)
        if outcome.moved and before is not None and before.canary_version not in (None, version):
            await end_canary(cfg, serving, producer, policy, before, decision, reason, moved_to=version)
        return outcome
    finally:
        await producer.stop()
        await control.close()


async def end_canary(cfg: RlstreamConfig, serving: ServingControl, producer: Any, policy: str,
                     before: ServingPointer, decision: DecisionKind, reason: str,
                     moved_to: int | None = None) -> MoveOutcome:
    """Record that an operator's ``decision`` ended the canary ``before`` names (a ``reject`` of its version on
    ``promotions``); without ``moved_to`` (serving stays) the canary is ended here first."""
    assert before.canary_version is not None
    canary = before.canary_version
    token = await serving.issue_token(policy)
    if moved_to is None:
        await serving.set_canary(policy, None, 0.0, token)
        why = f"canary v{canary} ended by an operator's {decision.value}, serving stays at v{before.version}: {reason}"
    else:
        why = f"canary v{canary} ended by an operator's {decision.value} to v{moved_to}: {reason}"
    record = PromotionDecision(policy=policy, version=canary, decision=DecisionKind.reject, reason=why,
                               serving_before=before.version, candidate_metrics={"canary_version": float(canary)},
                               decided_by=operator_name(), fencing_token=token)
    await publish_decision(producer, codec_for(cfg), TopicNames.from_config(cfg.topics).promotions, record)
    log.info("canary ended by an operator", policy=policy, canary=canary, decision=decision.value)
    pointer = await serving.serving(policy)
    return MoveOutcome(True, why, pointer, None, record)


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
