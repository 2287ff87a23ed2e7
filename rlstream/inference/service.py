"""``rlstream inference sync``'s service: one sync worker keeping one vLLM server on the newest policy version."""
from __future__ import annotations

import asyncio

from rlstream.inference.sync import InferenceSyncWorker
from rlstream.inference.vllm_backend import VllmBackend
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.masking import secret_value
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import create_topics
from rlstream.transport.signals import stop_event


async def sync_until_stopped(cfg: RlstreamConfig, stop: asyncio.Event) -> None:
    """Create the topics, then follow policy-versions (verify, load, heartbeat) until ``stop``."""
    await create_topics(cfg.kafka, cfg.topics)
    backend = VllmBackend(cfg.inference.url, cfg.inference.request_timeout_s, secret_value(cfg.inference.api_key))
    control = ControlPlane(cfg.redis.url, cfg.redis.retry_max_s)
    try:
        await InferenceSyncWorker(cfg, backend, control).run(stop)
    finally:
        await backend.close()
        await control.close()


def run_sync(cfg: RlstreamConfig) -> None:
    """Run the sync worker of ``cfg.inference`` until SIGINT/SIGTERM."""

    async def main() -> None:
        await sync_until_stopped(cfg, stop_event())

    asyncio.run(main())
