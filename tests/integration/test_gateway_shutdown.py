"""Nothing captured is lost when the gateway stops with more open sessions than its capture queue holds: what does
not fit the queue goes to the spool, and from there to Kafka (the real broker), also across a restart.

In-process: 300 open sessions, a queue of 100. ``tests/chaos/test_gateway_sigterm.py`` does the same with 21,000
sessions and a SIGTERM to the ``rlstream gateway serve`` process."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import pytest

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.rollout.publisher import TrajectoryPublisher
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from tests.support.learner_helpers import read_whole_topic
from tests.unit.test_gateway_sessions import USER, fake_upstream


async def run_gateway(config: GatewaySettings, publisher: TrajectoryPublisher, sessions: int) -> Gateway:
    """Open ``sessions`` sessions (one call each), then stop the gateway as a graceful shutdown does."""
    gateway = Gateway(config, publisher, client=httpx.AsyncClient(transport=httpx.MockTransport(fake_upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            for index in range(sessions):
                r = await c.post(f"/s/s{index}/v1/chat/completions", json={"model": "m", "messages": [USER]})
                assert r.status_code == 200
        assert len(gateway.sessions.open) == sessions
    finally:
        await gateway.stop()
    return gateway


@pytest.mark.parametrize("spool", [True, False], ids=["spool", "no-spool-control"])
async def test_open_sessions_past_the_queue_at_shutdown_reach_kafka(rl_config: RlstreamConfig,
                                                                    created_topics: TopicNames, tmp_path: Path,
                                                                    spool: bool) -> None:
    sessions, queue_size = 300, 100
    config = GatewaySettings(session_stitching="gateway",
                             queue_size=queue_size, session_idle_s=600, spool_dir=tmp_path / "spool" if spool else None,
                           run_id=rl_config.run_id, drain_timeout_s=20)
    publisher = TrajectoryPublisher.from_config(rl_config.kafka, created_topics.trajectories, created_topics.rewards)
    await publisher.start()
    try:
        gateway = await run_gateway(config, publisher, sessions)
        if spool and gateway.capture.spool is not None and gateway.capture.spool.pending:
            await run_gateway(config, publisher, 0)  # a restart sends what the spool still holds
    finally:
        await publisher.close()
    stats = gateway.capture.stats
    on_topic = Counter(e.metadata.get("session_id") for e in
                       await read_whole_topic(rl_config, created_topics.trajectories, TrajectoryEvent))
    if not spool:  # the control: what did not fit the queue is lost without a spool
        assert stats.dropped_full == sessions - queue_size and len(on_topic) == queue_size
        return
    assert stats.dropped_full == 0 and stats.overflowed == sessions - queue_size, stats
    assert set(on_topic) == {f"s{i}" for i in range(sessions)}, f"lost: {sessions - len(on_topic)}"
    assert max(on_topic.values()) == 1
    assert list((tmp_path / "spool").glob("*.seg")) == []
