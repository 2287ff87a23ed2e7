"""SIGKILL the learner between checkpoints, restart it: it resumes at the checkpointed step and every group is
trained exactly once (shown through the offsets and the lineage of the published versions)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlstream.learner.checkpoint import CheckpointStore
from rlstream.transport.control import ControlPlane
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import PolicyVersion
from rlstream.schemas.topics import TopicNames
from tests.support.learner_helpers import produce_groups, random_group, read_topic, tiny_model

N_GROUPS, PER_STEP, TOTAL_STEPS = 12, 2, 6


def _learner_cmd(cfg: RlstreamConfig, model: Path, *extra: str) -> list[str]:
    overrides = {
        "kafka.bootstrap_servers": cfg.kafka.bootstrap_servers, "redis.url": cfg.redis.url,
        "topics.prefix": cfg.topics.prefix, "topics.partitions": "4", "run_id": cfg.run_id, "policy": cfg.policy,
        "learner.output_dir": str(cfg.learner.output_dir), "learner.model": str(model),
        "learner.lora.enabled": "false", "learner.learning_rate": "1e-3", "learner.groups_per_step": str(PER_STEP),
        "learner.checkpoint_every": "2", "learner.publish_every": "2", "learner.total_steps": str(TOTAL_STEPS),
        "learner.device": "cpu", "learner.lease_ttl_s": "5",
    }
    args = [sys.executable, "-c", "from rlstream.cli.app import app; app()", "--log-format", "json", "learner", "run"]
    for k, v in overrides.items():
        args += ["-o", k, v]
    return args + list(extra)


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=Path(__file__).parents[2])


def _events(stderr_and_out: str) -> list[dict]:
    out = []
    for line in stderr_and_out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def test_sigkill_between_checkpoints_then_resume_trains_each_group_once(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path) -> None:
    model = tiny_model(tmp_path)
    placed = asyncio.run(produce_groups(rl_config, [random_group(rl_config.policy, rl_config.run_id, i)
                                                    for i in range(N_GROUPS)]))
    expected = {(p, o) for p, o in placed}

    first = _run(_learner_cmd(rl_config, model, "--kill-after-step", "3"))
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    store = CheckpointStore(Path(rl_config.learner.output_dir) / "checkpoints")
    assert [p.name for p in store.list()] == ["step-000000002"]  # step 3 was never checkpointed
    # a partial/corrupt newer checkpoint left on disk must be detected and skipped
    bogus = store.path_for(4)
    bogus.mkdir()
    (bogus / "state.json").write_text('{"step": 4}')
    (bogus / "weights.safetensors").write_bytes(b"garbage")

    second = _run(_learner_cmd(rl_config, model))
    assert second.returncode == 0, second.stderr[-3000:]
    events = _events(second.stdout + second.stderr)
    resumed = [e for e in events if e.get("event") == "resumed from checkpoint"]
    assert resumed and resumed[0]["step"] == 2, events[:20]
    assert any(e.get("event") == "checkpoint invalid, trying the previous one" for e in events)
    steps = [e["step"] for e in events if e.get("event") == "learner step"]
    assert steps == [3, 4, 5, 6]
    # the default learner.num_iterations (3): each learner step logs the optimizer steps it applied
    assert [e["optimizer_steps"] for e in events if e.get("event") == "learner step"] == [3, 3, 3, 3]
    assert [e["num_iterations"] for e in events if e.get("event") == "learner started"] == [3]

    # lineage: the base weights (version 0, announced once, by the first run) and three trained versions whose
    # trained_on ranges cover every group offset exactly once
    versions = asyncio.run(read_topic(rl_config, created_topics.policy_versions, PolicyVersion, expect=4))
    assert [v.version for v in versions] == [0, 1, 2, 3]
    assert [v.learner_step for v in versions] == [0, 2, 4, 6]
    assert (versions[0].group_count, versions[0].trained_on) == (0, [])
    assert sum(v.group_count for v in versions) == N_GROUPS
    trained: list[tuple[int, int]] = []
    for v in versions:
        for r in v.trained_on:
            assert r.topic == created_topics.groups
            trained.extend((r.partition, o) for o in range(r.first, r.last + 1))
    assert len(trained) == len(set(trained)) == N_GROUPS
    assert set(trained) == expected

    state = json.loads((store.list()[0] / "state.json").read_text())
    assert state["step"] == TOTAL_STEPS and state["groups_trained"] == N_GROUPS
    per_partition_next = {}
    for p, o in expected:
        per_partition_next[p] = max(per_partition_next.get(p, 0), o + 1)
    assert {int(k): v for k, v in state["offsets"].items()} == per_partition_next

    async def latest() -> int:
        control = ControlPlane(rl_config.redis.url)
        try:
            return await control.latest_version(rl_config.policy)
        finally:
            await control.close()

    assert asyncio.run(latest()) == 3
