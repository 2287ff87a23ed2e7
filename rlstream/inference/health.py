"""Whether a replica's server is up, from its health checks (vLLM's ``/health``).

A server that fails ``inference.health_failures`` checks in a row is down: its sync worker takes the replica out of
routing at once (rlstream/transport/serving.py ``mark_replica_down``) instead of waiting for the heartbeat to expire,
and counts it (``inference/engine_down``). When the server answers again (its supervisor restarted it: rlstream/ops/
vllm.py) the worker loads its versions again and only then puts the replica back.
"""
from __future__ import annotations

from enum import Enum


class HealthChange(str, Enum):
    """A change of a server's state seen by :class:`HealthTracker`."""

    down = "down"
    up = "up"


class HealthTracker:
    """Turns single health checks into up/down changes: down after ``failures`` failed checks in a row, up again at
    the first check that passes."""

    def __init__(self, failures: int) -> None:
        self.failures = max(1, failures)
        self.failed_in_row = 0
        self.down = False

    def observe(self, healthy: bool) -> HealthChange | None:
        """Record one check; the change it makes, if any."""
        if healthy:
            self.failed_in_row = 0
            if self.down:
                self.down = False
                return HealthChange.up
            return None
        self.failed_in_row += 1
        if not self.down and self.failed_in_row >= self.failures:
            self.down = True
            return HealthChange.down
        return None
