"""Which PolicyVersion records count: one check shared by every reader of ``policy-versions``.

Anyone who can write to the topic can announce anything, so a record counts only when the fenced learner announced
it. The learner's announcement (:func:`announce_record`) is: register the sha256 of the record's bytes in Redis as
pending under its lease (fenced: refused unless that lease is held), send the record in a transaction of its
transactional producer and commit it, then confirm the registration (fenced again). A reader
(:class:`TrustedVersions`) reads ``policy-versions`` with ``read_committed`` and accepts a record only when

* its fencing token is one Redis issued for the policy (``1 <= token <=`` the fencing counter) and not older than
  the newest token of a record it already accepted (a fenced-out learner never counts again),
* its version is at most ``max_version_jump`` above the newest trusted version (the newest it accepted, or the
  Redis latest pointer, which only the lease holder moves),
* Redis holds a committed announcement of exactly these bytes, under a lease with the record's fencing token.

So a record from a plain producer, from any other transactional producer, or with any byte changed is not
announced; a byte-for-byte copy of an accepted record is refused as ``replayed`` by a reader that saw the original; a record whose learner lost its lease or died between its Kafka commit and the confirmation never
counts (``never_committed``); an aborted record is never read at all. A refused record is reported to the caller
(services dead-letter it with the reason; operator tools flag it) and changes nothing.
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

from rlstream.schemas.models import PolicyVersion
from rlstream.transport.control import Announcement, ControlPlane, Lease
from rlstream.transport.log import get_logger
from rlstream.transport.topic_reader import Decoded, TopicReader

log = get_logger(__name__)


class UntrustedVersionRecord(ValueError):
    """A PolicyVersion record that does not count; ``reason`` is the metric tag and the dead letter's reason."""

    reason = "untrusted_version"


class ForeignFencingToken(UntrustedVersionRecord):
    reason = "foreign_fencing_token"


class StaleFencingToken(UntrustedVersionRecord):
    reason = "stale_fencing_token"


class VersionJump(UntrustedVersionRecord):
    reason = "version_jump"


class NotAnnounced(UntrustedVersionRecord):
    reason = "not_announced"


class NeverCommitted(UntrustedVersionRecord):
    reason = "never_committed"


class ReplayedRecord(UntrustedVersionRecord):
    """The exact bytes of a record already accepted, written again (a genuine re-announcement has new bytes)."""

    reason = "replayed"


class AnnouncementPending(UntrustedVersionRecord):
    """Committed in Kafka, not yet confirmed by its learner (which still holds the lease): it counts once confirmed.
    Raised only to readers that do not wait (operator tools)."""

    reason = "announcement_pending"


def record_digest(value: bytes) -> str:
    """The sha256 (hex) of a PolicyVersion record's bytes: what Redis registers for an announcement."""
    return hashlib.sha256(value).hexdigest()


async def announce_record(producer: Any, control: ControlPlane, lease: Lease, *, topic: str, policy: str,
                          version: int, value: bytes, transactional: bool,
                          before_commit: Callable[[], None] | None = None) -> None:
    """Announce one encoded PolicyVersion: registered in Redis under ``lease``, sent in a transaction of ``producer``
    (which must be transactional: ``transactional`` says whether its caller built it with a transactional id),
    confirmed once committed.

    Raises :class:`~rlstream.transport.control.LeaseLost` when the lease is not held (before the send: nothing is
    written; after the commit: the record is never confirmed, so it never counts) and
    aiokafka's ``ProducerFenced`` when Kafka fenced the producer (aborted). ``before_commit`` (fault injection for
    tests) runs once the record is in the log and registered, before the transaction commits.
    """
    if not transactional:
        raise ValueError("policy versions are announced only by a transactional producer")
    digest = record_digest(value)
    # registered before the transaction opens: no control-plane wait can outlast the broker's transaction timeout
    await control.register_announcement(policy, digest, version, lease)
    async with producer.transaction():
        await producer.send_and_wait(topic, value, key=policy.encode())
        if before_commit is not None:
            before_commit()
    await control.confirm_announcement(policy, digest, version, lease)


@dataclass
class _PolicyTrust:
    newest_version: int = 0
    newest_token: int = 0


@dataclass
class TrustedVersions:
    """The check of one reader of ``policy-versions``: feed it the records in topic order (see the module docstring).

    ``wait_pending``: a record committed in Kafka whose learner still holds its lease but has not confirmed it yet
    (the moment between the two) is waited for; without it, :class:`AnnouncementPending` is raised.
    """

    control: ControlPlane
    max_version_jump: int
    wait_pending: bool = True
    pending_poll_s: float = 0.05
    _policies: dict[str, _PolicyTrust] = field(default_factory=dict)
    _accepted: set[str] = field(default_factory=set)  # digests of the records accepted

    def newest(self, policy: str) -> int | None:
        """The newest trusted version of ``policy`` this reader accepted, None before the first."""
        trust = self._policies.get(policy)
        return trust.newest_version if trust is not None else None

    async def check(self, event: PolicyVersion, value: bytes | None) -> None:
        """Accept ``event`` (decoded from ``value``) or raise an :class:`UntrustedVersionRecord` naming why.

        An accepted record moves this reader's newest trusted version and fencing token of its policy forward.
        """
        policy, token = event.policy, event.fencing_token
        trust = self._policies.get(policy) or _PolicyTrust()
        digest = record_digest(value or b"")
        if digest in self._accepted:
            raise ReplayedRecord(f"version {event.version} of {policy!r}: a copy of a record already accepted")
        issued = await self.control.fencing_tokens_issued(policy)
        if not 1 <= token <= issued:
            raise ForeignFencingToken(f"version {event.version} of {policy!r} carries fencing token {token}; the "
                                      f"control plane issued tokens 1..{issued} for this policy")
        if token < trust.newest_token:
            raise StaleFencingToken(f"version {event.version} of {policy!r} carries fencing token {token}, older "
                                    f"than {trust.newest_token} already seen (a fenced-out learner)")
        newest = max(trust.newest_version, await self.control.latest_version(policy))
        if event.version > newest + self.max_version_jump:
            raise VersionJump(f"version {event.version} of {policy!r} is more than inference.max_version_jump="
                              f"{self.max_version_jump} above the newest trusted version {newest}")
        announcement = await self._announcement(event, digest)
        if announcement.fencing_token != token or announcement.version != event.version:
            raise ForeignFencingToken(f"version {event.version} of {policy!r} (fencing token {token}) does not match "
                                      f"its announcement (version {announcement.version} under lease "
                                      f"{announcement.lease})")
        trust.newest_version = max(trust.newest_version, event.version)
        trust.newest_token = max(trust.newest_token, token)
        self._policies[policy] = trust
        self._accepted.add(digest)

    async def _announcement(self, event: PolicyVersion, digest: str) -> Announcement:
        while True:
            announcement = await self.control.announcement(event.policy, digest)
            if announcement is None:
                raise NotAnnounced(f"version {event.version} of {event.policy!r}: the learner never announced this "
                                   "record (written by another producer, or changed)")
            if announcement.committed:
                return announcement
            if await self.control.lease_holder(event.policy) != announcement.lease:
                raise NeverCommitted(f"version {event.version} of {event.policy!r}: its learner (lease "
                                     f"{announcement.lease}) lost the lease or stopped before confirming it")
            if not self.wait_pending:
                raise AnnouncementPending(f"version {event.version} of {event.policy!r}: committed, not yet "
                                          "confirmed by its learner")
            await asyncio.sleep(self.pending_poll_s)

    async def admit(self, reader: TopicReader[PolicyVersion], item: Decoded[PolicyVersion]) -> bool:
        """True when ``item`` counts; otherwise it is taken out through ``reader`` (dead-lettered with the reason
        when the reader has a sink) and False."""
        try:
            await self.check(item.event, item.source.value)
        except UntrustedVersionRecord as exc:
            log.warning("untrusted policy version refused", policy=item.event.policy, version=item.event.version,
                        reason=exc.reason, offset=item.source.offset, error=str(exc))
            await reader.reject(item.source, exc)
            return False
        return True
