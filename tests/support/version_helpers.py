"""Announcing PolicyVersion records the way the fenced learner does (tests that need versions without a learner)."""
from __future__ import annotations

from typing import Sequence

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import PolicyVersion
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane, Lease
from rlstream.transport.kafka import make_producer
from rlstream.transport.trusted_versions import announce_record, record_digest

CODEC = AvroCodec()


def learner_transactional_id(policy: str) -> str:
    """The learner's announcing transactional id (rlstream.learner.publish.transactional_id, without torch)."""
    return f"rlstream-learner-{policy}"


async def announce_versions(cfg: RlstreamConfig, versions: Sequence[PolicyVersion], *, lease: Lease | None = None,
                            holder: str = "test-learner") -> dict[str, Lease]:
    """Announce ``versions`` in order through each policy's transactional producer, registered and confirmed under
    a learner lease (``lease`` for ``cfg.policy`` if given, else one acquired per policy and kept); each record
    carries its lease's fencing token. Returns the lease used per policy."""
    topic = TopicNames.from_config(cfg.topics).policy_versions
    control = ControlPlane(cfg.redis.url)
    leases: dict[str, Lease] = {cfg.policy: lease} if lease is not None else {}
    producers = {}
    try:
        for version in versions:
            if version.policy not in leases:
                acquired = await control.acquire_lease(version.policy, holder, ttl_s=600)
                assert acquired is not None, f"the learner lease of {version.policy!r} is held"
                leases[version.policy] = acquired
            if version.policy not in producers:
                producer = make_producer(cfg.kafka, transactional_id=learner_transactional_id(version.policy))
                await producer.start()
                producers[version.policy] = producer
            held = leases[version.policy]
            event = version.model_copy(update={"fencing_token": held.token})
            await announce_record(producers[version.policy], control, held, topic=topic, policy=version.policy,
                                  version=version.version, value=CODEC.encode(event), transactional=True)
    finally:
        for producer in producers.values():
            await producer.stop()
        await control.close()
    return leases


async def register_committed(control: ControlPlane, version: PolicyVersion, lease: Lease) -> bytes:
    """Register the encoded ``version`` as a committed announcement under ``lease`` without writing it anywhere
    (a learner that announced what the record says); returns the bytes to send."""
    value = CODEC.encode(version)
    digest = record_digest(value)
    await control.register_announcement(version.policy, digest, version.version, lease)
    await control.confirm_announcement(version.policy, digest, version.version, lease)
    return value
