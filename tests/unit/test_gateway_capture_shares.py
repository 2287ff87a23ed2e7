"""One tenant's flood of captures never evicts or blocks another tenant's: each tenant's share of the capture queue and
of the spool is bounded (``gateway.capture_tenant_share``). The control shares them whole (a share of 1), where the
same flood leaves no room for the second tenant."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import AccessConfig
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.queue import CaptureQueue
from rlstream.gateway.spool import Spool, SpoolRecord, encode_record
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from tests.unit.test_gateway_sessions import USER
from tests.unit.test_gateway_spool import FlakyPublisher, wait_until
from tests.unit.test_gateway_tenant_isolation import upstream

pytestmark = pytest.mark.unit

FLOODER, VICTIM = "flooder-key-0123456789ab", "victim-key-0123456789abc"
SHARES = pytest.mark.parametrize("share", [0.5, 1.0], ids=["per-tenant", "shared-control"])


def record(tenant: str) -> SpoolRecord:
    return SpoolRecord("t.trajectories", b"key", b"v" * 1000, tenant)


@SHARES
def test_spool_share_keeps_room_for_other_tenants(tmp_path: Path, share: float) -> None:
    frame = len(encode_record(record("a")))
    whole = 20 * frame + 64  # 20 records and the segment header
    spool = Spool.open(tmp_path / "spool", max_bytes=whole, tenant_max_bytes=int(whole * share))
    try:
        flood = spool.append([record("flooder") for _ in range(50)])
        victim = spool.append([record("victim") for _ in range(3)])
        kept = [p for p in flood if p is not None]
        if share == 1.0:  # the control: the flood took the whole spool, the second tenant's records are dropped
            assert len(kept) == 20 and victim == [None] * 3 and spool.stats.dropped_full == 33
            return
        assert len(kept) == 10 and spool.stats.dropped_tenant == 40 and spool.stats.dropped_full == 0
        assert all(p is not None for p in victim) and spool.tenant_bytes("victim") == 3 * frame
        assert spool.tenant_bytes("flooder") == 10 * frame and not spool.tenant_full("victim")
        for position in kept[:2]:  # what Kafka acknowledged gives the tenant's share back
            spool.mark_acknowledged(position)
        assert sum(p is not None for p in spool.append([record("flooder") for _ in range(3)])) == 2
    finally:
        spool.close()


@SHARES
async def test_queue_overflow_to_the_spool_keeps_room_for_other_tenants(tmp_path: Path, share: float) -> None:
    """Kafka down: every event goes to the spool; the flooder's 200 fill only its share, the victim's still fit and
    reach Kafka once it is back."""
    publisher = FlakyPublisher()
    frame = len(encode_record(SpoolRecord("traj", b"e", publisher.codec.encode(event("flooder")))))
    spool = Spool.open(tmp_path / "spool", max_bytes=40 * frame + 64, tenant_max_bytes=int((40 * frame + 64) * share))
    queue = CaptureQueue(publisher, maxsize=10, spool=spool, spool_after_s=0.1, tenant_share=share)
    queue.start()
    try:
        stats = queue.stats
        for _ in range(200):
            queue.put(event("flooder"), "flooder")
            await asyncio.sleep(0)
        await wait_until(lambda: stats.spooled + stats.spool_dropped + stats.dropped_full == 200)
        victims = [event("victim") for _ in range(5)]
        for e in victims:
            queue.put(e, "victim")
        await wait_until(lambda: stats.spooled + stats.spool_dropped + stats.dropped_full == 205)
        publisher.come_back()
        await wait_until(lambda: spool.pending == 0)
    finally:
        await queue.drain(2.0)
    written = {publisher.codec.decode(v, TrajectoryEvent).trajectory_id for v in publisher.written}
    arrived = sum(e.trajectory_id in written for e in victims)
    if share == 1.0:  # the control: the flood filled the spool, the victim's captures were dropped
        assert arrived == 0 and queue.stats.spool_dropped >= 5
    else:
        assert arrived == 5 and spool.stats.dropped_tenant > 0


def event(tenant: str) -> TrajectoryEvent:
    return TrajectoryEvent(run_id="r", example_id="e", group_id="g", group_size=1, generation_index=0, policy="p",
                           policy_version=0,
                           messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                           metadata={"tenant": tenant})


class StalledKafka:
    """A producer that takes nothing until ``gate`` is set (Kafka stalled), then writes everything."""

    trajectories_topic, rewards_topic, calls_topic = "traj", "rew", "calls"

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.sent: list[Any] = []

    async def submit(self, topic: str, key: str, event: Any) -> "asyncio.Future[Any]":
        await self.gate.wait()
        self.sent.append(event)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


@SHARES
async def test_a_tenants_flood_of_n_choices_leaves_room_for_another_tenants_call(tmp_path: Path,
                                                                                 share: float) -> None:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"keys": [{"key": FLOODER, "tenant": "flooder"},
                                              {"key": VICTIM, "tenant": "victim"}]}))
    keys_file.chmod(0o600)
    kafka = StalledKafka()
    gateway = Gateway(GatewaySettings(policy="m", served_model="m", queue_size=20, capture_tenant_share=share),
                      kafka, client=httpx.AsyncClient(transport=httpx.MockTransport(upstream())),
                      access=AccessConfig(api_keys_file=keys_file, feedback_secret=SecretStr("s" * 32)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            for _ in range(4):  # 64 trajectories while Kafka takes none: more than the queue and one batch hold
                r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER], "n": 16},
                                 headers={"authorization": f"Bearer {FLOODER}"})
                assert r.status_code == 200
            mine = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER]},
                                headers={"authorization": f"Bearer {VICTIM}"})
            assert mine.status_code == 200
            victim_id = mine.headers["x-rlstream-trajectory-id"]
            assert gateway.capture.stats.dropped_full > 0  # the flood was bounded either way
            kafka.gate.set()
            await wait_until(lambda: gateway.capture.queue.empty()
                             and gateway.capture.stats.acknowledged == gateway.capture.stats.queued)
    finally:
        await gateway.stop()
    captured = {e.trajectory_id for e in kafka.sent if isinstance(e, TrajectoryEvent)}
    if share == 1.0:  # the control: one shared queue, full of the flooder's events, dropped the victim's capture
        assert victim_id not in captured
    else:
        assert victim_id in captured and gateway.capture.stats.over_share > 0


@SHARES
async def test_a_tenants_flood_of_rewards_leaves_room_for_another_tenants_reward(tmp_path: Path,
                                                                                  share: float) -> None:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"keys": [{"key": FLOODER, "tenant": "flooder"},
                                              {"key": VICTIM, "tenant": "victim"}]}))
    keys_file.chmod(0o600)
    kafka = StalledKafka()
    gateway = Gateway(GatewaySettings(policy="m", served_model="m", queue_size=20, capture_tenant_share=share),
                      kafka, client=httpx.AsyncClient(transport=httpx.MockTransport(upstream())),
                      access=AccessConfig(api_keys_file=keys_file, feedback_secret=SecretStr("s" * 32)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            async def reward(key: str) -> str:
                answer = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER]},
                                      headers={"authorization": f"Bearer {key}"})
                return str(answer.headers["x-rlstream-trajectory-id"])

            flooded = await reward(FLOODER)
            for _ in range(80):  # rewards while Kafka takes none: more than the queue and one batch hold
                await c.post("/v1/feedback", json={"trajectory_id": flooded, "reward": 1.0},
                             headers={"authorization": f"Bearer {FLOODER}"})
            victim_tid = await reward(VICTIM)
            mine = await c.post("/v1/feedback", json={"trajectory_id": victim_tid, "reward": 0.5},
                                headers={"authorization": f"Bearer {VICTIM}"})
            assert gateway.capture.stats.dropped_full > 0  # the flood was bounded either way
            kafka.gate.set()
            await wait_until(lambda: gateway.capture.queue.empty()
                             and gateway.capture.stats.acknowledged == gateway.capture.stats.queued)
    finally:
        await gateway.stop()
    rewarded = {e.trajectory_id for e in kafka.sent if isinstance(e, RewardEvent)}
    if share == 1.0:  # the control: one shared queue, full of the flooder's rewards, dropped the victim's
        assert victim_tid not in rewarded and mine.status_code == 503
    else:
        assert victim_tid in rewarded and mine.status_code == 202 and mine.json()["queued"] is True


def write_keys(keys_file: Path, tenants: list[tuple[str, str]]) -> None:
    keys_file.write_text(json.dumps({"keys": [{"key": key, "tenant": tenant} for key, tenant in tenants]}))
    keys_file.chmod(0o600)


async def test_a_single_tenant_has_the_whole_queue_until_a_second_tenant_has_keys(tmp_path: Path) -> None:
    """One tenant's share would only keep room for tenants that do not exist: while the keys name one tenant its
    captures may fill the whole queue; once the keys file names a second, each is held to its share again."""
    keys_file = tmp_path / "keys.json"
    write_keys(keys_file, [(FLOODER, "flooder")])
    kafka = StalledKafka()
    gateway = Gateway(GatewaySettings(policy="m", served_model="m", queue_size=20, capture_tenant_share=0.5),
                      kafka, client=httpx.AsyncClient(transport=httpx.MockTransport(upstream())),
                      access=AccessConfig(api_keys_file=keys_file, feedback_secret=SecretStr("s" * 32)))
    gateway.keys.reload_check_s = 0.0
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER], "n": 16},
                             headers={"authorization": f"Bearer {FLOODER}"})
            assert r.status_code == 200
            stats = gateway.capture.stats
            # 16 trajectories while Kafka takes none: all fit (half the queue, the share, would be 10)
            assert (stats.queued, stats.dropped_full, stats.over_share) == (16, 0, 0)
            assert gateway.capture.tenant_slots == 20

            write_keys(keys_file, [(FLOODER, "flooder"), (VICTIM, "victim")])
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER], "n": 2},
                             headers={"authorization": f"Bearer {VICTIM}"})  # the reload happens on this key
            assert r.status_code == 200 and gateway.capture.tenant_slots == 10
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER], "n": 2},
                             headers={"authorization": f"Bearer {FLOODER}"})
            assert r.status_code == 200
            # the flooder is past its share now (16 of 10): its two are refused room; the victim's two fitted
            assert (stats.queued, stats.over_share, stats.dropped_full) == (18, 2, 2)
    finally:
        kafka.gate.set()
        await gateway.stop()
