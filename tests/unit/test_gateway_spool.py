"""The gateway's spool: segment format (round trip, cut-short and damaged records, fsync), acknowledgements across a
reopen, the size cap, the directory lock; and the capture queue over it with a publisher that is down, then back."""
from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlstream.gateway import spool as spool_module
from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.queue import CaptureQueue
from rlstream.gateway.spool import (SEGMENT_HEADER, Spool, SpoolError, SpoolRecord, encode_record, read_frame,
                                            scan)
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from tests.support.factories import make_trajectory
from tests.unit.test_gateway_sessions import USER, fake_upstream


def records(n: int, size: int = 100, topic: str = "t.trajectories") -> list[SpoolRecord]:
    return [SpoolRecord(topic, f"key-{i}".encode(), bytes([i % 251]) * size + f"#{i}".encode()) for i in range(n)]


def values(stored: list[Any]) -> list[bytes]:
    return [s.record.value for s in stored]


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def test_frame_round_trip_and_damage_detection() -> None:
    record = SpoolRecord("rlstream.rewards", b"ex-\x00\xff", b"\xc3\x01" + os.urandom(300))
    frame = encode_record(record)
    assert read_frame(frame, 0) == (record, len(frame), "")
    assert read_frame(frame[:-1], 0)[2] == "truncated"          # cut short
    assert read_frame(frame[:5], 0)[2] == "truncated"           # not even a whole header
    flipped = bytearray(frame)
    flipped[-10] ^= 0x01
    assert read_frame(bytes(flipped), 0)[2] == "corrupt"        # one bit: the checksum fails
    # a scan skips the damaged record and finds the next one
    data = SEGMENT_HEADER + bytes(flipped) + frame
    result = scan(data)
    assert [(s, e) for s, e in result.spans] == [(len(SEGMENT_HEADER) + len(frame), len(data))]
    assert [reason for *_, reason in result.skipped] == ["corrupt"]


def test_append_read_round_trip_survives_reopen(tmp_path: Path) -> None:
    sp = Spool.open(tmp_path / "spool", max_bytes=1 << 20, segment_bytes=4096)
    batch = records(50)
    positions = sp.append(batch)
    assert all(p is not None for p in positions) and sp.pending == 50
    assert len(segment_files(tmp_path / "spool")) > 1  # rolled at segment_bytes
    assert [s.record for s in sp.unacknowledged(1000)] == batch
    sp.close()
    again = Spool.open(tmp_path / "spool", max_bytes=1 << 20)
    assert [s.record for s in again.unacknowledged(1000)] == batch  # same records, same order
    again.close()


def test_truncated_tail_is_skipped_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sp = Spool.open(tmp_path, max_bytes=1 << 20)
    sp.append(records(5))
    path = segment_files(tmp_path)[0]
    sp.close()
    # a crash in the middle of writing a sixth record: its frame is cut short
    partial = encode_record(records(6)[5])[:37]
    with open(path, "ab") as fh:
        fh.write(partial)
    again = Spool.open(tmp_path, max_bytes=1 << 20)
    assert values(again.unacknowledged(100)) == [r.value for r in records(5)]
    assert again.stats.skipped_damaged == 1
    # new records go to a new segment, the damaged one is never appended to
    again.append(records(1))
    assert len(segment_files(tmp_path)) == 2 and again.pending == 6
    again.close()


def test_corrupt_record_in_the_middle_is_skipped_and_the_rest_kept(tmp_path: Path) -> None:
    sp = Spool.open(tmp_path, max_bytes=1 << 20)
    positions = sp.append(records(5))
    path = segment_files(tmp_path)[0]
    sp.close()
    data = bytearray(path.read_bytes())
    data[positions[2].offset + 20] ^= 0xFF  # a byte inside the third record
    path.write_bytes(bytes(data))
    again = Spool.open(tmp_path, max_bytes=1 << 20)
    kept = values(again.unacknowledged(100))
    assert kept == [r.value for i, r in enumerate(records(5)) if i != 2]
    again.close()


def test_every_append_is_fsynced_on_the_segment_descriptor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(spool_module.os, "fsync", recording_fsync)
    sp = Spool.open(tmp_path, max_bytes=1 << 20)
    sp.append(records(3))  # creates the segment: header fsync, directory fsync, then the batch
    active = sp._active
    assert active is not None and active.fd is not None
    before = synced.count(active.fd)
    for _ in range(4):
        sp.append(records(2))
    assert synced.count(active.fd) == before + 4  # one fsync per batch, on the segment's own descriptor
    sp.close()


def test_acknowledged_records_are_not_returned_after_a_reopen(tmp_path: Path) -> None:
    sp = Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=2048)
    batch = records(30)
    positions = sp.append(batch)
    first_segment = positions[0].segment
    acked = {0, 1, 2, 5, 7}  # a contiguous prefix and some beyond it
    acked |= {i for i, p in enumerate(positions) if p.segment == first_segment}
    for i in acked:
        sp.mark_acknowledged(positions[i])
    sp.commit()
    assert not (tmp_path / f"{first_segment:020d}.seg").exists()  # sealed and wholly acknowledged: deleted
    # a crash: nothing closed, the acknowledgement files are what was committed
    os.close(sp._lock_fd)
    again = Spool.open(tmp_path, max_bytes=1 << 20)
    assert values(again.unacknowledged(100)) == [r.value for i, r in enumerate(batch) if i not in acked]
    assert again.pending == 30 - len(acked)
    for item in again.unacknowledged(100):
        again.mark_acknowledged(item.position)
    again.commit()
    again.close()
    assert segment_files(tmp_path) == [] and list(tmp_path.glob("*.ack")) == []


def test_cap_drops_and_counts(tmp_path: Path) -> None:
    sp = Spool.open(tmp_path, max_bytes=2000)
    positions = sp.append(records(40))
    kept = [p for p in positions if p is not None]
    assert 0 < len(kept) < 40 and sp.stats.dropped_full == 40 - len(kept)
    assert sp.disk_bytes <= 2000
    sp.close()


def test_one_gateway_per_spool_directory(tmp_path: Path) -> None:
    sp = Spool.open(tmp_path, max_bytes=1 << 20)
    with pytest.raises(SpoolError, match="in use"):
        Spool.open(tmp_path, max_bytes=1 << 20)
    sp.close()
    Spool.open(tmp_path, max_bytes=1 << 20).close()


class FlakyPublisher:
    """Kafka down (``submit_encoded`` raises, or deliveries never complete) until ``up`` is set."""

    trajectories_topic, rewards_topic = "traj", "rew"

    def __init__(self, hang: bool = False) -> None:
        self.codec = AvroCodec()
        self.up = False
        self.hang = hang
        self.written: list[bytes] = []
        self.pending: list[tuple[asyncio.Future[Any], bytes]] = []

    async def submit(self, topic: str, key: str, event: Any) -> asyncio.Future[Any]:
        return await self.submit_encoded(topic, key.encode(), self.codec.encode(event))

    async def submit_encoded(self, topic: str, key: bytes, value: bytes) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        if self.up:
            self.written.append(value)
            fut.set_result(None)
        elif self.hang:  # taken, never acknowledged while down (a producer retrying)
            self.pending.append((fut, value))
        else:
            raise ConnectionError("broker down")
        return fut

    def come_back(self) -> None:
        self.up = True
        for fut, value in self.pending:  # the producer's retries finally write what it held
            self.written.append(value)
            fut.set_result(None)
        self.pending = []


async def wait_until(check: Any, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("hang", [False, True], ids=["refused", "unacknowledged"])
async def test_capture_spools_while_down_and_drains_once_when_back(tmp_path: Path, hang: bool) -> None:
    publisher = FlakyPublisher(hang=hang)
    queue = CaptureQueue(publisher, maxsize=1000, spool=Spool.open(tmp_path, 1 << 24), spool_after_s=0.1)
    queue.start()
    events = [make_trajectory(example_id=f"ex-{i}") for i in range(20)]
    for event in events:
        queue.put(event)
    queue.put(RewardEvent(trajectory_id=events[0].trajectory_id, group_id=events[0].group_id,
                          example_id=events[0].example_id, reward=1.0))
    await wait_until(lambda: queue.spooling and queue.stats.spooled >= 21 - len(publisher.pending))
    publisher.come_back()
    await wait_until(lambda: not queue.spooling)
    await queue.drain(1.0)
    assert queue.spool is not None and queue.spool.pending == 0
    assert len(publisher.written) == 21 and len(set(publisher.written)) == 21  # each once
    assert queue.stats.acknowledged == 21
    assert list(tmp_path.glob("*.seg")) == []


async def test_a_restart_sends_what_the_previous_gateway_spooled(tmp_path: Path) -> None:
    first = FlakyPublisher()
    queue = CaptureQueue(first, maxsize=1000, spool=Spool.open(tmp_path, 1 << 24), spool_after_s=0.1)
    queue.start()
    events = [make_trajectory(example_id=f"ex-{i}") for i in range(10)]
    for event in events:
        queue.put(event)
    await wait_until(lambda: queue.stats.spooled == 10)
    await queue.drain(0.2)  # Kafka still down: they stay on disk
    assert first.written == []
    second = FlakyPublisher()
    second.up = True
    restarted = CaptureQueue(second, maxsize=1000, spool=Spool.open(tmp_path, 1 << 24), spool_after_s=0.1)
    assert restarted.spooling  # the spool goes first
    restarted.start()
    await wait_until(lambda: len(second.written) == 10)
    await restarted.drain(1.0)
    codec = AvroCodec()
    assert [codec.decode(v, TrajectoryEvent).trajectory_id for v in second.written] == \
        [e.trajectory_id for e in events]  # in order, each once


def test_disk_failure_drops_and_counts_then_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sp = Spool.open(tmp_path, max_bytes=1 << 20)
    assert all(sp.append(records(2)))
    real_write = os.write

    def disk_full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_module.os, "write", disk_full)
    assert sp.append(records(3)) == [None, None, None]  # never raises
    assert sp.stats.dropped_error == 3 and sp.pending == 2
    monkeypatch.setattr(spool_module.os, "write", real_write)
    assert all(sp.append(records(1)))  # a fresh segment once the disk has room again
    assert sp.pending == 3 and len(sp.unacknowledged(10)) == 3
    sp.close()


async def test_full_spool_never_fails_a_response(tmp_path: Path) -> None:
    config = GatewaySettings(session_stitching="gateway",
                             policy="p", spool_dir=tmp_path, spool_max_bytes=4096, spool_after_s=0.1)
    gateway = Gateway(config, FlakyPublisher(), client=httpx.AsyncClient(transport=httpx.MockTransport(fake_upstream)))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            for _ in range(30):
                r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER]})
                assert r.status_code == 200
            await wait_until(lambda: gateway.capture.stats.spooled + gateway.capture.stats.spool_dropped == 30)
            figures = (await c.get("/rlstream/stats")).json()
    finally:
        await gateway.stop()
    assert figures["capture"]["spool_dropped"] > 0 and figures["capture"]["spooled"] > 0
    assert figures["spool"]["spooling"] and figures["spool"]["bytes"] <= 4096
