"""A learner paused in the middle of its announcement (version written, PolicyVersion record sent in its Kafka
transaction and registered in Redis, not committed) while a successor takes the lease and publishes: when it wakes,
its commit is fenced, so its record never becomes readable under read_committed and no sync worker loads it (real
vLLM, broker, Redis).

The zombie's record sits in the log *before* the successor's records: were it committed, every read_committed reader
would read it first. Negative controls: a read_uncommitted reader sees the zombie's record, and the same bytes
committed by a plain producer are read by a read_committed reader; the sync worker still refuses them (never
confirmed by a learner holding the lease: the Redis layer of the check, independent of Kafka's fence).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlstream.inference.sync import InferenceSyncWorker
from rlstream.inference.vllm_backend import VllmBackend
from rlstream.ops.vllm import VllmServer
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig, dump_config
from rlstream.schemas.models import PolicyVersion
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import create_topics, make_consumer, make_producer
from rlstream.transport.topic_reader import partitions_of, read_to_end
from rlstream.transport.trusted_versions import record_digest
from tests.e2e.vllm_support import SERVED_MODEL, tiny_model_dir, vllm_fixture, wait_until
from tests.support.learner_helpers import produce_groups, random_group

vllm = vllm_fixture()
LEASE_TTL_S = 10.0  # a lease a busy machine's learner renews in time (at 3 s a starved successor lost its own)
PAUSED_VERSION = 2


class RecordingSyncWorker(InferenceSyncWorker):
    """The real sync worker; remembers (version, fencing token) of every record it loaded."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.loaded: list[tuple[int, int]] = []

    async def sync(self, version: PolicyVersion, record: object = None) -> bool:
        ok = await super().sync(version, record)  # type: ignore[arg-type]
        if ok:
            self.loaded.append((version.version, version.fencing_token))
        return ok


def learner_config(base: RlstreamConfig, model: Path, vllm_url: str, worker_id: str, steps: int) -> RlstreamConfig:
    cfg = base.model_copy(deep=True)
    cfg.learner = cfg.learner.model_copy(update={
        "model": str(model), "lora": cfg.learner.lora.model_copy(update={"enabled": True}),
        "device": "cpu", "groups_per_step": 1, "total_steps": steps, "publish_every": 1, "checkpoint_every": 1,
        "lease_ttl_s": LEASE_TTL_S})
    cfg.inference.url = vllm_url
    cfg.inference.worker_id = worker_id
    cfg.inference.served_model = SERVED_MODEL
    return cfg


def start_learner(cfg: RlstreamConfig, tmp_path: Path, name: str, *extra: str) -> subprocess.Popen[bytes]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(dump_config(cfg))
    log = (tmp_path / f"{name}.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "rlstream.cli", "--log-format", "json", "learner", "run", "-c",
                             str(path), "--holder", name, *extra], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def stopped(pid: int) -> bool:
    """True while ``pid`` is stopped by a signal (state T in /proc)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


async def raw_versions(cfg: RlstreamConfig, topic: str, isolation_level: str) -> list[tuple[PolicyVersion, bytes]]:
    """Every PolicyVersion record of ``topic`` (decoded, with its bytes) as a reader of ``isolation_level`` sees it."""
    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level=isolation_level)
    await consumer.start()
    try:
        consumer.assign(await partitions_of(consumer, topic))
        return [(AvroCodec().decode(r.value, PolicyVersion), r.value) async for r in read_to_end(consumer, topic)]
    finally:
        await consumer.stop()


def test_a_learner_paused_mid_announcement_is_fenced_and_never_served(
    vllm: VllmServer, rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    base_dir = tiny_model_dir(tmp_path_factory)
    zombie_cfg = learner_config(rl_config, base_dir, vllm.url, "w-zombie-test", steps=100)
    successor_cfg = learner_config(rl_config, base_dir, vllm.url, "w-zombie-test", steps=PAUSED_VERSION + 1)
    topic = created_topics.policy_versions
    policy = rl_config.policy
    zombie_log, successor_log = tmp_path / "zombie.log", tmp_path / "successor.log"

    async def scenario() -> None:
        control = ControlPlane(rl_config.redis.url)
        backend = VllmBackend(vllm.url)
        stop = asyncio.Event()
        worker = RecordingSyncWorker(zombie_cfg, backend, control)
        follower = asyncio.create_task(worker.run(stop))
        zombie = successor = None
        try:
            await produce_groups(rl_config, [random_group(policy, rl_config.run_id, i) for i in range(PAUSED_VERSION)])
            zombie = start_learner(zombie_cfg, tmp_path, "zombie", "--pause-in-announcement", str(PAUSED_VERSION))
            await wait_until(lambda: _true(zombie.poll() is not None or stopped(zombie.pid)), 180,
                             "the zombie to pause in its announcement")
            assert zombie.poll() is None, zombie_log.read_text()[-3000:]
            await wait_until(lambda: _true(worker.state.version == 1), 60, "version 1 loaded")
            zombie_token = worker.loaded[-1][1]

            # the zombie's record is in the log, not committed: read_uncommitted sees it (negative control)
            pending = [v for v, _ in await raw_versions(rl_config, topic, "read_uncommitted")]
            assert [(v.version, v.fencing_token) for v in pending] == [(0, zombie_token), (1, zombie_token),
                                                                        (PAUSED_VERSION, zombie_token)]
            zombie_bytes = (await raw_versions(rl_config, topic, "read_uncommitted"))[-1][1]
            assert Path(pending[-1].uri, "manifest.json").is_file()  # its weights are written
            registered = await control.announcement(policy, record_digest(zombie_bytes))
            assert registered is not None and not registered.committed  # registered under its lease, not confirmed

            await asyncio.sleep(LEASE_TTL_S + 1)  # the paused learner's lease expires
            successor = start_learner(successor_cfg, tmp_path, "successor")
            await produce_groups(rl_config, [random_group(policy, rl_config.run_id, PAUSED_VERSION)])
            await wait_until(lambda: _true(successor.poll() is not None), 180, "the successor to finish")
            assert successor.returncode == 0, successor_log.read_text()[-3000:]
            await wait_until(lambda: _true(worker.state.version == PAUSED_VERSION + 1), 60, "the successor's last")

            os.kill(zombie.pid, signal.SIGCONT)  # it wakes up and commits its announcement
            await wait_until(lambda: _true(zombie.poll() is not None), 60, "the zombie to stop")
            await asyncio.sleep(2)  # time for the worker to read anything the zombie might have committed
        finally:
            for proc in (zombie, successor):
                if proc is not None and proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                    proc.wait(30)
            stop.set()
            await asyncio.wait_for(follower, 30)
            for name in list(worker.adapters):  # the shared server serves the base model to the other tests
                await backend.unload_lora(name)

        committed = [(v.version, v.fencing_token) for v, _ in await raw_versions(rl_config, topic, "read_committed")]
        successor_token = committed[-1][1]
        assert successor_token > zombie_token
        # the successor finished the zombie's interrupted publication (same checkpoint) under its own token
        assert committed == [(0, zombie_token), (1, zombie_token), (PAUSED_VERSION, successor_token),
                             (PAUSED_VERSION + 1, successor_token)]  # 0: the base weights, announced once
        uncommitted = [(v.version, v.fencing_token) for v, _ in await raw_versions(rl_config, topic, "read_uncommitted")]
        assert (PAUSED_VERSION, zombie_token) in uncommitted  # still in the log, before the successor's records
        assert uncommitted.index((PAUSED_VERSION, zombie_token)) < uncommitted.index((PAUSED_VERSION, successor_token))
        assert worker.loaded and all(token == successor_token for version, token in worker.loaded if version > 1)
        assert worker.state.version == PAUSED_VERSION + 1 and await control.latest_version(policy) == PAUSED_VERSION + 1
        log = zombie_log.read_text()
        assert zombie.returncode == 3, log[-3000:]
        assert "SIGSTOP in the middle of an announcement" in log and "announcing producer was fenced" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        registered = await control.announcement(policy, record_digest(zombie_bytes))
        assert registered is not None and not registered.committed  # and it never will be: the lease is gone

        # negative control: the zombie's bytes committed by a plain producer (no fence) are read under
        # read_committed; the sync worker refuses them: the announcement was never confirmed under a held lease
        control_topics = rl_config.topics.model_copy(update={"prefix": rl_config.topics.prefix + "control."})
        await create_topics(rl_config.kafka, control_topics)
        unfenced_topic = TopicNames.from_config(control_topics).policy_versions
        producer = make_producer(rl_config.kafka)
        await producer.start()
        try:
            await producer.send_and_wait(unfenced_topic, zombie_bytes, key=policy.encode())
        finally:
            await producer.stop()
        assert [raw for _, raw in await raw_versions(rl_config, unfenced_topic, "read_committed")] == [zombie_bytes]
        control_cfg = zombie_cfg.model_copy(update={"topics": control_topics})
        control_cfg.inference.worker_id = "w-zombie-control"
        witness = RecordingSyncWorker(control_cfg, backend, control)
        stop = asyncio.Event()
        following = asyncio.create_task(witness.run(stop))
        try:
            await wait_until(lambda: _true(bool(witness.refused)), 60, "the unfenced record to be refused")
            assert [version for version, _ in witness.refused] == [PAUSED_VERSION] and not witness.loaded
            assert "stopped before confirming it" in witness.refused[0][1], witness.refused
        finally:
            stop.set()
            await asyncio.wait_for(following, 30)
            await backend.close()
            await control.close()

    asyncio.run(scenario())


async def _true(value: bool) -> bool:
    return value
