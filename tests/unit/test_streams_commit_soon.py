"""The stream app's early commit: a session's stitched trajectory asks for a commit within
``streams.session_commit_delay_s``, a group within ``streams.group_commit_delay_s``, and the commit comes at the
soonest of the delays asked since the last one (negative control: a group alone waits its own, longer delay; a delay
of 0 asks for none, the periodic commit takes the output)."""
from __future__ import annotations

import asyncio
import time

import pytest

from rlstream.streams.app import CommitSoon

pytestmark = pytest.mark.unit


async def waited_s(soon: CommitSoon, timeout_s: float = 2.0) -> float | None:
    """Seconds until ``soon.wait()`` returns, or None when it does not within ``timeout_s``."""
    started = time.monotonic()
    try:
        await asyncio.wait_for(soon.wait(), timeout_s)
    except asyncio.TimeoutError:
        return None
    return time.monotonic() - started


async def test_a_stitched_trajectory_brings_a_waiting_group_commit_forward() -> None:
    soon = CommitSoon()
    soon.request(0.5)  # a group
    waiter = asyncio.create_task(waited_s(soon))
    await asyncio.sleep(0.05)
    soon.request(0.01)  # then a session's trajectory: the commit comes for both, early
    took = await waiter
    assert took is not None and took < 0.2, took
    # negative control: the group alone waits its own delay
    soon.request(0.3)
    took = await waited_s(soon)
    assert took is not None and took >= 0.28, took


async def test_each_commit_covers_what_was_asked_before_it_and_zero_asks_for_none() -> None:
    soon = CommitSoon()
    soon.request(0.01)
    soon.request(0.02)
    assert await waited_s(soon) is not None
    assert await waited_s(soon, timeout_s=0.1) is None  # both outputs went with that commit
    soon.request(0.0)  # 0: the periodic commit takes it
    assert await waited_s(soon, timeout_s=0.1) is None
