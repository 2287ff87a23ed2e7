"""Which model name to request, and which policy version that is: from the sync workers' heartbeats."""
from __future__ import annotations

import time
from dataclasses import dataclass

from rlstream.transport.control import ControlPlane


@dataclass(frozen=True)
class Route:
    """Requests for the policy go to ``model``, which serves ``version``."""

    model: str
    version: int
    worker_id: str | None = None


class VersionRouter:
    """Routes to the newest version an inference worker reports loaded (cached for ``ttl_s``).

    Without any worker heartbeat, requests go to the plain policy model and carry the learner's
    latest published version (0 before the first).
    """

    def __init__(self, control: ControlPlane, policy: str, base_model: str, worker_id: str | None = None,
                 ttl_s: float = 1.0) -> None:
        self.control, self.policy, self.base_model, self.worker_id, self.ttl_s = (
            control, policy, base_model, worker_id, ttl_s)
        self._cached: tuple[float, Route, bool] | None = None

    async def current(self) -> Route:
        route, _ = await self.current_with_source()
        return route

    async def current_with_source(self) -> tuple[Route, bool]:
        """(route, whether it came from a worker heartbeat)."""
        now = time.monotonic()
        if self._cached and now - self._cached[0] < self.ttl_s:
            return self._cached[1], self._cached[2]
        workers = await self.control.workers(self.policy)
        candidates = [
            (int(info["version"]), wid, info.get("name") or self.base_model)
            for wid, info in workers.items()
            if "version" in info and (self.worker_id is None or wid == self.worker_id)
        ]
        if candidates:
            version, wid, name = max(candidates)
            route, from_worker = Route(name, version, wid), True
        else:
            route, from_worker = Route(self.base_model, max(0, await self.control.latest_version(self.policy))), False
        self._cached = (now, route, from_worker)
        return route, from_worker
