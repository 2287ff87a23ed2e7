"""A serving fleet as the gate sees it in Redis, set up without a sync worker."""
from __future__ import annotations

from typing import Iterable

from rlstream.schemas.config import RlstreamConfig
from rlstream.transport.control import ControlPlane
from rlstream.transport.serving import ReplicaAck, ServingControl


async def serving_fleet(cfg: RlstreamConfig, control: ControlPlane, loaded: Iterable[int] = (1, 2),
                        url: str = "") -> ServingControl:
    """Serving v1 (the pointer's first promotion) and one serve replica, ``w0`` at ``url``, acknowledging the
    versions ``loaded`` (the newest of them as the one it loaded last)."""
    policy, versions = cfg.policy, sorted(loaded)
    serving = ServingControl(control)
    await serving.promote(policy, 1, token=await serving.issue_token(policy), reason="start", decided_by="test",
                          expected_version=-1)
    await serving.record_replica(policy, ReplicaAck("w0", versions[-1], f"{policy}-v{versions[-1]}", url=url,
                                                    loaded={v: f"{policy}-v{v}" for v in versions}), 120.0)
    return serving
