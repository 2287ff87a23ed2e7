"""The correction window of production singles, as the gateway sees it (``streams.reward.correction_window_s``).

A single (group_size 1) waits in the stream app until its capture time plus the window, and a correction (a feedback
id repeated) within it replaces the score. After the window the single has left, or leaves at its first reward: a
correction would be dead-lettered (``correction_after_emit``), so the gateway answers it 409 instead of 202. The
gateway knows a feedback id was used by the feedback it accepted itself (bounded per tenant, oldest out first);
the capture time comes from the trajectory's id map entry, or from the feedback token (issued at capture, it
expires ``feedback_token_ttl_s`` later).
"""
from __future__ import annotations

import time

from rlstream.gateway.tenants import PerTenantLru


class CorrectionWindow:
    """Which feedback ids were accepted for which single, and whether a correction of one is still in time."""

    def __init__(self, window_s: float, capacity: int) -> None:
        self.window_s = window_s
        #: (trajectory id, feedback id) -> when it was first accepted, per tenant
        self._accepted: PerTenantLru[tuple[str, str], float] = PerTenantLru(capacity)

    def too_late(self, tenant: str, trajectory_id: str, feedback_id: str | None, captured_at: float | None,
                 now: float | None = None) -> bool:
        """True for a correction (``feedback_id`` already accepted for ``trajectory_id``) after the window of a
        single captured at ``captured_at`` (unknown: never too late here)."""
        if feedback_id is None or captured_at is None:
            return False
        if self._accepted.get(tenant, (trajectory_id, feedback_id)) is None:
            return False
        return (time.time() if now is None else now) > captured_at + self.window_s

    def accepted(self, tenant: str, trajectory_id: str, feedback_id: str | None, now: float | None = None) -> None:
        """Remember that ``feedback_id`` scored ``trajectory_id`` (the first time it did)."""
        if feedback_id is not None and self._accepted.get(tenant, (trajectory_id, feedback_id)) is None:
            self._accepted.put(tenant, (trajectory_id, feedback_id), time.time() if now is None else now)
