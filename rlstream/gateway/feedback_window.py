"""The correction window of production singles, as the gateway sees it (``streams.reward.correction_window_s``).

A single (group_size 1) waits in the stream app until its capture time plus the window, and a correction (a feedback
id repeated) within it replaces the score. After the window the single has left, or leaves at its first reward: a
correction would be dead-lettered (``correction_after_emit``), so the gateway answers it 409 instead of 202. The
feedback ids accepted are kept per tenant (bounded, oldest out first) in the gateways' shared state (Redis, kept
``streams.reward_window_s``), so a correction sent to another gateway, or after a restart, is answered alike; without
Redis, in this gateway's memory. The capture time comes from the trajectory's id map entry, or from the feedback
token (issued at capture, it expires ``feedback_token_ttl_s`` later).
"""
from __future__ import annotations

import time

from rlstream.gateway.shared_ids import TenantMap


def _entry(trajectory_id: str, feedback_id: str) -> str:
    return f"{trajectory_id}\x1f{feedback_id}"


class CorrectionWindow:
    """Which feedback ids were accepted for which single, and whether a correction of one is still in time."""

    def __init__(self, window_s: float, accepted: TenantMap) -> None:
        self.window_s = window_s
        #: "<trajectory id>\x1f<feedback id>" -> when it was first accepted, per tenant
        self._accepted = accepted

    async def too_late(self, tenant: str, trajectory_id: str, feedback_id: str | None, captured_at: float | None,
                       now: float | None = None) -> bool:
        """True for a correction (``feedback_id`` already accepted for ``trajectory_id``) after the window of a
        single captured at ``captured_at`` (unknown: never too late here)."""
        if feedback_id is None or captured_at is None:
            return False
        if await self._accepted.get(tenant, _entry(trajectory_id, feedback_id)) is None:
            return False
        return (time.time() if now is None else now) > captured_at + self.window_s

    async def accepted(self, tenant: str, trajectory_id: str, feedback_id: str | None,
                       now: float | None = None) -> None:
        """Remember that ``feedback_id`` scored ``trajectory_id`` (the first time it did)."""
        if feedback_id is not None and await self._accepted.get(tenant, _entry(trajectory_id, feedback_id)) is None:
            await self._accepted.put(tenant, {_entry(trajectory_id, feedback_id): str(time.time() if now is None
                                                                                       else now)})
