"""A paused learner (SIGSTOP) loses its lease; a second learner takes over and publishes; when the first one
wakes (SIGCONT) and trains again, it publishes nothing: the lease check refuses it (and Kafka's transactional
fencing would refuse its announcement). The Redis pointer never moves back."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlstream.schemas.config import RlstreamConfig, dump_config
from rlstream.schemas.models import PolicyVersion
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from tests.support.learner_helpers import produce_groups, random_group, read_whole_topic, tiny_model

LEASE_TTL_S = 3.0


def config(base: RlstreamConfig, model: Path, out: Path, steps: int) -> RlstreamConfig:
    learner = base.learner.model_copy(update={
        "model": str(model), "lora": base.learner.lora.model_copy(update={"enabled": True}), "device": "cpu",
        "groups_per_step": 1, "total_steps": steps, "publish_every": 1, "checkpoint_every": 1,
        "lease_ttl_s": LEASE_TTL_S, "output_dir": out})
    return base.model_copy(update={"learner": learner})


def start(cfg: RlstreamConfig, tmp_path: Path, name: str) -> subprocess.Popen[str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(dump_config(cfg))
    log = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "rlstream.cli", "--log-format", "json", "learner", "run", "-c",
                             str(path), "--holder", name], stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


async def latest(cfg: RlstreamConfig) -> int:
    control = ControlPlane(cfg.redis.url)
    try:
        return await control.latest_version(cfg.policy)
    finally:
        await control.close()


def wait_version(cfg: RlstreamConfig, version: int, proc: subprocess.Popen[str], log: Path,
                 timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while asyncio.run(latest(cfg)) < version:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"version {version} not published in time"
        time.sleep(0.3)


def test_a_woken_zombie_learner_cannot_publish(rl_config: RlstreamConfig, created_topics: TopicNames,
                                               tmp_path: Path) -> None:
    model = tiny_model(tmp_path)
    shared = tmp_path / "learner"  # both learners resume from the same checkpoints, as a restarted pod would
    zombie_cfg = config(rl_config, model, shared, steps=100)
    asyncio.run(produce_groups(rl_config, [random_group(rl_config.policy, rl_config.run_id, 0)]))

    zombie = start(zombie_cfg, tmp_path, "zombie")
    try:
        wait_version(rl_config, 1, zombie, tmp_path / "zombie.log")
        os.kill(zombie.pid, signal.SIGSTOP)
        time.sleep(LEASE_TTL_S + 2)  # the paused learner's lease expires

        successor = start(config(rl_config, model, shared, steps=2), tmp_path, "successor")
        asyncio.run(produce_groups(rl_config, [random_group(rl_config.policy, rl_config.run_id, 1)]))
        assert successor.wait(timeout=120) == 0, (tmp_path / "successor.log").read_text()[-3000:]
        assert asyncio.run(latest(rl_config)) == 2

        asyncio.run(produce_groups(rl_config, [random_group(rl_config.policy, rl_config.run_id, i)
                                               for i in (2, 3)]))
        woke = time.time()
        os.kill(zombie.pid, signal.SIGCONT)  # it wakes up, finds groups, trains...
        deadline = time.monotonic() + 30
        while zombie.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        if zombie.poll() is None:
            os.kill(zombie.pid, signal.SIGCONT)
            zombie.terminate()
            zombie.wait(timeout=30)

    versions = [v for v in asyncio.run(read_whole_topic(rl_config, created_topics.policy_versions, PolicyVersion))
                if v.policy == rl_config.policy]
    assert [v.version for v in versions] == [0, 1, 2]  # the base, the zombie's 1, the successor's 2: nothing more
    assert versions[2].fencing_token > versions[1].fencing_token  # the successor's lease is a newer one
    assert asyncio.run(latest(rl_config)) == 2  # the pointer never moved back
    # nor did it write a checkpoint over the successor's (same step numbers, shared directory)
    states = list((shared / "checkpoints").glob("step-*/state.json"))
    assert states and all(p.stat().st_mtime < woke for p in states)
    log = (tmp_path / "zombie.log").read_text()
    assert zombie.returncode == 3, log[-3000:]  # it stopped on its own, saying why, without a traceback
    assert "stopping without publishing" in log and "Traceback" not in log, log[-3000:]
