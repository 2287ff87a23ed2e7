"""State every gateway of a deployment shares, per tenant: the ids feedback may name (trajectory ids, response ids,
W3C trace and span ids, LangSmith feedback ids) and the items of stored Responses (``previous_response_id``,
``conversation``). It lives in Redis through the control plane (one hash and one sorted set per tenant and kind,
entries kept ``streams.reward_window_s``, each tenant bounded to its own count), so feedback and the next turn of a
conversation work on any gateway behind a load balancer and after a restart. Without Redis it stays in this
process's memory (one gateway only).

Lookups run after the credential check and only inside the caller's tenant: another tenant's id is never found,
never echoed.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any

from rlstream.gateway.sessions import KnownTrajectory
from rlstream.gateway.tenants import PerTenantLru
from rlstream.transport.control import ControlPlane
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: W3C trace context header of an inference call: its trace id and span id name the call's trajectory too
TRACEPARENT_HEADER = "traceparent"
#: the most a Redis call of the request path waits for an unreachable Redis (then it is skipped, logged)
PATIENCE_S = 1.0


def dumps_known(known: KnownTrajectory) -> str:
    """``known`` as the text an id maps to."""
    return json.dumps([known.trajectory_id, known.example_id, known.group_id], separators=(",", ":"))


def loads_known(text: str | None) -> KnownTrajectory | None:
    """The trajectory an id maps to (None for no text or a malformed one)."""
    if text is None:
        return None
    try:
        trajectory_id, example_id, group_id = json.loads(text)
    except (ValueError, TypeError):
        return None
    return KnownTrajectory(str(trajectory_id), str(example_id), str(group_id))


def trace_ids(traceparent: str | None) -> list[str]:
    """The trace id and span id (lowercase hex) of a W3C ``traceparent`` header; none when it is malformed or
    all zeros."""
    if not traceparent:
        return []
    parts = traceparent.strip().lower().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return []
    ids = [p for p in parts[1:3] if p.strip("0") and all(c in "0123456789abcdef" for c in p)]
    return ids if len(ids) == 2 else []


class TenantMap:
    """One kind (``namespace``) of per-tenant state: ``name -> text`` entries kept ``ttl_s``, at most ``capacity``
    per tenant (a tenant's newest push out its own oldest, never another tenant's). In Redis when ``control`` is
    given, else in this process's memory. A Redis that cannot be reached within :data:`PATIENCE_S` makes a put a
    logged no-op and a get a miss: serving never waits on it longer."""

    def __init__(self, namespace: str, policy: str, ttl_s: float, capacity: int,
                 control: ControlPlane | None = None) -> None:
        self.namespace, self.policy, self.ttl_s, self.capacity = namespace, policy, ttl_s, capacity
        self.control = control
        self._local: PerTenantLru[str, tuple[float, str]] = PerTenantLru(capacity)
        self.dropped = 0  # entries pushed out by their own tenant's newer ones
        self.failed = 0  # puts and gets Redis did not answer

    @property
    def shared(self) -> bool:
        """True when every gateway with the same Redis sees the entries."""
        return self.control is not None

    async def put(self, tenant: str, entries: dict[str, str]) -> None:
        if self.control is None:
            now = time.monotonic()
            for name, value in entries.items():
                self.dropped += len(self._local.put(tenant, name, (now, value)))
            return
        try:
            self.dropped += await self.control.tenant_put(self.policy, self.namespace, tenant, entries, self.ttl_s,
                                                          self.capacity, patience_s=PATIENCE_S)
        except Exception as exc:  # Redis down: feedback by id works on this gateway only until it is back
            self.failed += 1
            log.warning("shared gateway state not written", kind=self.namespace, error=str(exc)[:200])

    async def get(self, tenant: str, name: str) -> str | None:
        if self.control is None:
            held = self._local.get(tenant, name)
            return held[1] if held is not None and time.monotonic() - held[0] < self.ttl_s else None
        try:
            return await self.control.tenant_get(self.policy, self.namespace, tenant, name, self.ttl_s,
                                                 patience_s=PATIENCE_S)
        except Exception as exc:
            self.failed += 1
            log.warning("shared gateway state not read", kind=self.namespace, error=str(exc)[:200])
            return None


class Background:
    """Writes that go on after a response was answered (tracked, so a stopping gateway finishes them)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def run(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
