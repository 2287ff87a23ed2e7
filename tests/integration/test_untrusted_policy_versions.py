"""Hostile records on ``policy-versions`` change nothing: every reader checks each record against the control plane
(transport/trusted_versions.py) and only the fenced learner's announcements count.

Hostile records (a version jump, a fencing token never issued, a plain producer's plausible version, a byte copy
of the learner's own record, garbage bytes, an aborted transaction) are written while the real learner trains on what the real streams worker
emits: the streams worker and the sync worker dead-letter each of them with its reason, every valid group reaches
``groups``, the learner trains and announces its versions, the sync worker loads them, and ``status``, ``tail``,
``lineage`` and the router show only the learner's versions. Negative control: with the check bypassed, one such
record makes the streams tracker judge every valid group stale (0 groups would reach ``groups``, for good).
"""
from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from rlstream.schemas.codec import AvroCodec, CodecError
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, FileDigest, PolicyVersion, WeightsKind
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane, LeaseLost, announcements_key
from rlstream.transport.kafka import make_consumer, make_producer
from rlstream.transport.trusted_versions import (AnnouncementPending, NeverCommitted, NotAnnounced, ReplayedRecord,
                                                 TrustedVersions, record_digest)
from tests.support.streams_helpers import Worker, interleaved_stream, publish, read_all, read_groups

CODEC = AvroCodec()
PARTITION = 0


def hostile_version(cfg: RlstreamConfig, version: int, token: int, uri: str) -> PolicyVersion:
    return PolicyVersion(policy=cfg.policy, version=version, base_model="tiny", kind=WeightsKind.lora, uri=uri,
                         files=[FileDigest(path="adapter_model.safetensors", sha256="0" * 64, size=1)],
                         learner_step=version, fencing_token=token)


def hostile_records(cfg: RlstreamConfig, token: int) -> dict[bytes, tuple[bytes, str]]:
    """key -> (value, the dead letter's error type) of each record a foreign plain producer writes."""
    versions_root = Path(cfg.learner.output_dir) / "versions"
    garbage = b"\x00\x01\x02 not an avro record"
    try:
        CODEC.decode(garbage, PolicyVersion)
        raise AssertionError("the garbage decodes")
    except CodecError as exc:
        garbage_type = type(exc).__name__
    return {
        b"jump": (CODEC.encode(hostile_version(cfg, 2 ** 62, token, "/etc")), "VersionJump"),
        b"token-zero": (CODEC.encode(hostile_version(cfg, 1, 0, str(versions_root / "v000001"))),
                        "ForeignFencingToken"),
        b"token-never-issued": (CODEC.encode(hostile_version(cfg, 1, token + 1000, str(versions_root / "v000001"))),
                                "ForeignFencingToken"),
        # everything a genuine version 1 would carry, the learner's token included, but not announced by it
        b"plain-producer": (CODEC.encode(hostile_version(cfg, 1, token, str(versions_root / "v000001"))),
                            "NotAnnounced"),
        b"garbage": (garbage, garbage_type),
    }


async def place(cfg: RlstreamConfig, topic: str, values: list[tuple[bytes, bytes]]) -> None:
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for key, value in values:
            await producer.send_and_wait(topic, value, key=key, partition=PARTITION)
    finally:
        await producer.stop()


async def write_aborted(cfg: RlstreamConfig, topic: str, key: bytes, value: bytes) -> None:
    """A record of a transaction that is aborted: in the log, never read by read_committed."""
    producer = make_producer(cfg.kafka, transactional_id=f"{cfg.run_id}-hostile-tx")
    await producer.start()
    try:
        await producer.begin_transaction()
        await producer.send_and_wait(topic, value, key=key, partition=PARTITION)
        await producer.abort_transaction()
    finally:
        await producer.stop()


async def raw_records(cfg: RlstreamConfig, topic: str, isolation_level: str) -> list[Any]:
    from rlstream.transport.topic_reader import read_to_end

    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level=isolation_level)
    await consumer.start()
    try:
        return [record async for record in read_to_end(consumer, topic)]
    finally:
        await consumer.stop()


async def dead_letters_of(cfg: RlstreamConfig, topic: str, service: str, expect: int,
                          timeout_s: float = 60.0) -> list[DeadLetter]:
    deadline = time.monotonic() + timeout_s
    while True:
        letters = [d for _, d in await read_all(cfg, topic, DeadLetter, timeout_s=3, quiet_s=0.5)]
        mine = [d for d in letters if d.service == service]  # type: ignore[union-attr]
        if len(mine) >= expect or time.monotonic() > deadline:
            return mine  # type: ignore[return-value]
        await asyncio.sleep(0.5)


class RecordingBackend:
    """A vLLM server double: records the adapters it was asked to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    async def load_lora(self, name: str, path: Path) -> None:
        assert sorted(p.name for p in Path(path).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        self.loaded.append(name)

    async def unload_lora(self, name: str) -> None:
        pass

    async def load_full(self, weights_dir: Path, rollback_dir: Path | None = None) -> None:  # pragma: no cover
        raise AssertionError("LoRA only in this test")


def learner_config(cfg: RlstreamConfig, tmp_path: Path) -> RlstreamConfig:
    from tests.support.learner_helpers import tiny_model

    cfg = cfg.model_copy(deep=True)
    cfg.learner = cfg.learner.model_copy(update={
        "model": str(tiny_model(tmp_path)), "lora": cfg.learner.lora.model_copy(update={"enabled": True}),
        "groups_per_step": 2, "publish_every": 1, "total_steps": 2, "device": "cpu", "lease_ttl_s": 5.0})
    cfg.streams.max_policy_lag = 3
    cfg.inference.staging_dir = tmp_path / "staging"
    return cfg


def test_hostile_version_records_are_dead_lettered_by_every_reader_while_training_goes_on(
        rl_config: RlstreamConfig, tmp_path: Path) -> None:
    from rlstream.streams.app import prepare_topics

    cfg = learner_config(rl_config, tmp_path)
    asyncio.run(prepare_topics(cfg))
    names = TopicNames.from_config(cfg.topics)
    worker = Worker(cfg, "w1", tmp_path, **{"streams.max_policy_lag": 3}).start()
    try:
        asyncio.run(_hostile_scenario(cfg, names, worker))
    finally:
        worker.stop()


async def _hostile_scenario(cfg: RlstreamConfig, names: TopicNames, worker: Worker) -> None:
    from rlstream.inference.sync import InferenceSyncWorker
    from rlstream.learner.service import Learner
    from rlstream.ops.lineage import LineageError, version_lineage
    from rlstream.ops.status import collect_status
    from rlstream.ops.tail import TailOptions, run_tail
    from rlstream.rollout.routing import VersionRouter

    control = ControlPlane(cfg.redis.url)
    learner = Learner(cfg, holder="genuine-learner")
    learner_task = asyncio.create_task(learner.run())
    sync_stop = asyncio.Event()
    sync_task: asyncio.Task[None] | None = None
    try:
        deadline = time.monotonic() + 120
        while (holder := await control.lease_holder(cfg.policy)) is None:
            assert not learner_task.done() and time.monotonic() < deadline, "the learner took no lease"
            await asyncio.sleep(0.2)
        token = int(holder.rsplit("|", 1)[1])

        hostile = hostile_records(cfg, token)
        await place(cfg, names.policy_versions, [(key, value) for key, (value, _) in hostile.items()])
        aborted = CODEC.encode(hostile_version(cfg, 2 ** 61, token, "/etc"))
        await write_aborted(cfg, names.policy_versions, b"aborted", aborted)
        # the streams worker's tracker dead-letters each before any trajectory is sent
        streams_letters = await dead_letters_of(cfg, names.dlq, "streams:w1", expect=len(hostile))
        assert worker.alive(), worker.log_tail()

        backend = RecordingBackend()
        sync = InferenceSyncWorker(cfg, backend=backend, control=control)  # type: ignore[arg-type]
        sync_task = asyncio.create_task(sync.run(sync_stop))

        records, expected = interleaved_stream(cfg, n_examples=4, group_size=2, seed=11)
        await publish(cfg, records)
        groups = await read_groups(cfg, names.groups, expect=len(expected), timeout_s=90)
        assert {g.group_id for g in groups} == set(expected), "every valid group reaches groups"

        state = await asyncio.wait_for(learner_task, timeout=240)
        assert state.step == 2 and state.version == 2, "training went on"
        deadline = time.monotonic() + 60
        while sync.state.version < 2:
            assert not sync_task.done() and time.monotonic() < deadline, f"sync worker at {sync.state.version}"
            await asyncio.sleep(0.2)
        # a byte-for-byte copy of the learner's version 1, by a plain producer
        genuine = [r for r in await raw_records(cfg, names.policy_versions, "read_committed")
                   if r.key == cfg.policy.encode()]
        replayed = next(r.value for r in genuine if CODEC.decode(r.value, PolicyVersion).version == 1)
        await place(cfg, names.policy_versions, [(b"replay", replayed)])
        hostile[b"replay"] = (replayed, "ReplayedRecord")
        streams_letters = await dead_letters_of(cfg, names.dlq, "streams:w1", expect=len(hostile))
        inference_letters = await dead_letters_of(cfg, names.dlq, f"inference:{cfg.inference.worker_id}",
                                                  expect=len(hostile))
        route = await VersionRouter(control, cfg.policy, cfg.inference.served_model).current()
    finally:
        sync_stop.set()
        if sync_task is not None:
            await sync_task
        if not learner_task.done():
            learner.request_stop()
            await asyncio.gather(learner_task, return_exceptions=True)

    want = {key: error_type for key, (_, error_type) in hostile.items()}
    for service, letters in (("streams", streams_letters), ("sync worker", inference_letters)):
        assert {d.key: d.error_type for d in letters} == want, (service, [(d.key, d.error_message) for d in letters])
        assert len(letters) == len(want), service  # the learner's own versions are never dead-lettered
    for letter in streams_letters:
        assert letter.value == hostile[letter.key][0] and letter.error_message
    assert "max_version_jump" in {d.key: d.error_message for d in streams_letters}[b"jump"]
    assert worker.alive(), worker.log_tail()

    # the aborted record is in the log but no read_committed reader ever sees it
    assert b"aborted" in [r.key for r in await raw_records(cfg, names.policy_versions, "read_uncommitted")]
    assert b"aborted" not in [r.key for r in await raw_records(cfg, names.policy_versions, "read_committed")]

    # the sync worker loaded the learner's versions, and only them; the router serves version 2
    assert backend.loaded == [f"{cfg.policy}-v1", f"{cfg.policy}-v2"]
    assert route.version == 2

    # operator tools: only the learner's versions count; the others are flagged with their reason
    status = await collect_status(cfg)
    assert [v["version"] for v in status["recent_versions"]] == [2, 1, 0]  # 0: the base weights
    assert sorted(u["reason"] for u in status["untrusted_versions"]) == sorted(
        ["version_jump", "foreign_fencing_token", "foreign_fencing_token", "not_announced", "replayed"])
    out = io.StringIO()
    await run_tail(cfg, "versions", TailOptions(from_beginning=True), fmt="json", out=out)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    trusted_rows = [r["version"] for r in rows if "_error" not in r and "_untrusted" not in r]
    flagged = sorted(r["_untrusted"].split(":", 1)[0] for r in rows if "_untrusted" in r)
    # each learner version counted once (a partition holding a byte copy may be read before the learner's)
    assert sorted(trusted_rows) == [0, 1, 2] and flagged == sorted(u["reason"] for u in status["untrusted_versions"])
    with pytest.raises(LineageError, match="version_jump"):
        await version_lineage(cfg, 2 ** 62)
    assert len((await version_lineage(cfg, 2)).groups) == 2
    await control.close()


async def test_without_the_check_one_hostile_record_makes_every_group_stale(
        rl_config: RlstreamConfig, created_topics: TopicNames, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the streams tracker with the trust check and with it bypassed, on the same topic."""
    from rlstream.streams.filters import STALE, apply_filters
    from rlstream.streams.policy import PolicyTracker
    from tests.support.learner_helpers import random_group

    control = ControlPlane(rl_config.redis.url)
    lease = await control.acquire_lease(rl_config.policy, "learner", ttl_s=60)
    assert lease is not None
    jump = hostile_records(rl_config, lease.token)[b"jump"][0]
    await place(rl_config, created_topics.policy_versions, [(b"jump", jump)])
    group = random_group(rl_config.policy, rl_config.run_id, 0)  # behaviour version 0, rewards spread

    async def latest_seen() -> int | None:
        tracker = PolicyTracker(rl_config, created_topics.policy_versions, CODEC, redis_poll_s=0.2,
                                dlq_topic=created_topics.dlq, service="tracker-test")
        task = asyncio.create_task(tracker.run())
        try:
            await asyncio.wait_for(tracker.ready.wait(), timeout=30)
            await asyncio.sleep(0.5)
            return tracker.version_of(rl_config.policy)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    checked = await latest_seen()
    assert checked is None
    assert apply_filters(group, rl_config.streams, checked, {}, 0).reason != STALE

    async def bypassed(self: TrustedVersions, event: PolicyVersion, value: bytes | None) -> None:
        return None

    monkeypatch.setattr(TrustedVersions, "check", bypassed)
    unchecked = await latest_seen()
    assert unchecked == 2 ** 62
    assert apply_filters(group, rl_config.streams, unchecked, {}, 0).reason == STALE  # every group, for good
    letters = [d for _, d in await read_all(rl_config, created_topics.dlq, DeadLetter, timeout_s=5, quiet_s=1)]
    assert [(d.key, d.error_type, d.service) for d in letters] == [(b"jump", "VersionJump", "tracker-test")]
    await control.close()


async def test_a_record_counts_once_its_announcement_is_committed_and_confirmed(
        rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    """The announcement protocol on the real broker and Redis: pending between the Kafka commit and the
    confirmation, never counted when the learner lost its lease in between, never read when aborted, and a lease
    that is not held registers nothing."""
    topic, policy = created_topics.policy_versions, rl_config.policy
    control = ControlPlane(rl_config.redis.url)
    lease = await control.acquire_lease(policy, "learner", ttl_s=60)
    assert lease is not None
    producer = make_producer(rl_config.kafka, transactional_id=f"rlstream-learner-{policy}")
    await producer.start()
    trust = TrustedVersions(control, max_version_jump=10, wait_pending=False)

    async def send_registered(version: int, commit: bool = True) -> bytes:
        value = CODEC.encode(hostile_version(rl_config, version, lease.token, "/w"))
        await producer.begin_transaction()
        await producer.send_and_wait(topic, value, key=policy.encode())
        await control.register_announcement(policy, record_digest(value), version, lease)
        if commit:
            await producer.commit_transaction()
        else:
            await producer.abort_transaction()
        return value

    try:
        one = await send_registered(1)
        with pytest.raises(AnnouncementPending):
            await trust.check(CODEC.decode(one, PolicyVersion), one)
        await control.confirm_announcement(policy, record_digest(one), 1, lease)
        await trust.check(CODEC.decode(one, PolicyVersion), one)
        assert trust.newest(policy) == 1
        with pytest.raises(ReplayedRecord):  # the same bytes again, e.g. copied by a plain producer
            await trust.check(CODEC.decode(one, PolicyVersion), one)
        changed = CODEC.encode(CODEC.decode(one, PolicyVersion).model_copy(update={"uri": "/elsewhere"}))
        with pytest.raises(NotAnnounced):
            await trust.check(CODEC.decode(changed, PolicyVersion), changed)
        await control.redis.hset(announcements_key(policy), record_digest(changed), "committed|1")  # malformed
        with pytest.raises(NotAnnounced):
            await trust.check(CODEC.decode(changed, PolicyVersion), changed)

        await send_registered(3, commit=False)  # aborted: never read, even though registered
        two = await send_registered(2)
        await control.release_lease(policy, lease)  # the learner stops between its commit and the confirmation
        with pytest.raises(NeverCommitted):
            await trust.check(CODEC.decode(two, PolicyVersion), two)
        with pytest.raises(LeaseLost):
            await control.confirm_announcement(policy, record_digest(two), 2, lease)
        with pytest.raises(LeaseLost):  # a fenced-out learner registers nothing
            await control.register_announcement(policy, record_digest(two), 2, lease)
    finally:
        await producer.stop()
        await control.close()
    committed = [CODEC.decode(r.value, PolicyVersion).version for r in await raw_records(rl_config, topic,
                                                                                         "read_committed")]
    assert committed == [1, 2]
