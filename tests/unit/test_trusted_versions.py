"""The announcement entries the control plane holds, parsed; the record digest."""
from __future__ import annotations

import hashlib

import pytest

from rlstream.transport.control import Announcement, Lease
from rlstream.transport.trusted_versions import record_digest

pytestmark = pytest.mark.unit


def test_an_announcement_entry_names_its_state_version_and_lease() -> None:
    lease = Lease("host|pid 7", 12)  # a holder may contain the separator: the token is the last field
    committed = Announcement.parse(f"committed|41|{lease.value}")
    assert committed == Announcement(True, 41, lease.value) and committed.fencing_token == 12
    pending = Announcement.parse(f"pending|41|{lease.value}")
    assert not pending.committed and pending.fencing_token == 12
    with pytest.raises(ValueError):
        Announcement.parse("committed|41")


def test_the_record_digest_is_the_sha256_of_its_bytes() -> None:
    assert record_digest(b"\xc3\x01record") == hashlib.sha256(b"\xc3\x01record").hexdigest()
    assert record_digest(b"a") != record_digest(b"b")
