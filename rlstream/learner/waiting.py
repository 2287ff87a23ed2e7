"""The learner says when it is starved: it has read every group there is and waits for the next one.

A rollout runner paused by its admission count reads this (:meth:`ControlPlane.learner_waiting_s`) to tell groups
that are on their way from groups that will never come (filtered, skipped as stale, dead-lettered): only the learner
knows it has nothing left to read. The mark is refreshed while the learner waits and expires on its own, so a learner
that stopped or died leaves none behind; an unreachable Redis never holds the learner up.
"""
from __future__ import annotations

import time

from rlstream.transport.control import ControlPlane
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: how often a waiting learner refreshes its mark, and how long the mark outlives the last refresh
REFRESH_S = 1.0
TTL_S = 5.0
#: how long one report may wait for Redis
PATIENCE_S = 1.0


class WaitingForGroups:
    """Call :meth:`nothing_to_read` after each fetch that came back empty and :meth:`reading` after one with records."""

    def __init__(self, control: ControlPlane, policy: str) -> None:
        self.control = control
        self.policy = policy
        self._since: float | None = None
        self._reported_at = float("-inf")
        self._reported = False

    async def nothing_to_read(self) -> None:
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._reported_at >= REFRESH_S:
            self._reported_at = now
            await self._report(now - self._since)

    async def reading(self) -> None:
        self._since = None
        self._reported_at = float("-inf")
        if self._reported:
            await self._report(None)

    async def _report(self, waited_s: float | None) -> None:
        try:
            await self.control.report_learner_waiting(self.policy, waited_s, TTL_S, patience_s=PATIENCE_S)
            self._reported = waited_s is not None
        except Exception as exc:  # noqa: BLE001 - for the rollout's admission only: training goes on without it
            log.warning("learner waiting state not written (Redis unreachable?)", error=str(exc))
