"""The learning proof: `rlstream up` on the toy task, with its defaults, visibly learns the instruction (under a reward
where any constant answer earns at most 0.2) by policy version 60
(about three minutes on an idle 2-core machine; the run stops on the version, not on the clock, so that a loaded CI
machine trains as much before the verdict, with --duration only as a cap).

(The data flow of `rlstream up` from an installed wheel is tests/e2e/test_wheel_install.py.)
The broker and Redis come from the test session (RLSTREAM_KAFKA_BOOTSTRAP / RLSTREAM_REDIS_URL), so
that the test can look at the topics and the control plane after the run; everything else (streams
worker, learner, vLLM server, sync worker, rollout runner) is started by `rlstream up` itself.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from rlstream.ops.infra import LocalStack
from rlstream.ops.status import topic_end_offsets
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import KafkaConfig
from rlstream.schemas.models import PolicyVersion
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from rlstream.transport.topic_reader import open_reader, read_to_end

UNTIL_VERSION = 60
DURATION_CAP_S = 600
MIN_VERSIONS = 5


async def _published_versions(kafka: KafkaConfig, topic: str) -> list[PolicyVersion]:
    """Every version on the topic, read up to its end offsets (no waiting for silence)."""
    reader = await open_reader(kafka)
    try:
        return [AvroCodec().decode(record.value, PolicyVersion) async for record in read_to_end(reader, topic)]
    finally:
        await reader.stop()


async def _latest_version(redis_url: str, policy: str) -> int:
    control = ControlPlane(redis_url)
    try:
        return await control.latest_version(policy)
    finally:
        await control.close()


def test_rlstream_up_trains_and_visibly_learns(local_stack: LocalStack, own_redis_url: str, tmp_path: Path,
                                               unique: str) -> None:
    prefix = f"up{unique}."
    env = {**os.environ, "RLSTREAM_KAFKA_BOOTSTRAP": local_stack.bootstrap, "RLSTREAM_REDIS_URL": own_redis_url}
    cmd = [sys.executable, "-m", "rlstream.cli", "up", "--until-version", str(UNTIL_VERSION),
           "--duration", str(DURATION_CAP_S), "--no-live",
           "--runs-dir", str(tmp_path / "runs"), "-o", "topics.prefix", prefix,
           "-o", "streams.app_id", f"streams-{unique}"]  # its own table changelogs and consumer group
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DURATION_CAP_S + 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary_line = next(line for line in proc.stdout.splitlines() if line.startswith("summary:"))
    summary = json.loads(Path(summary_line.split(":", 1)[1].strip()).read_text())
    assert Path(summary["plot"]).stat().st_size > 10_000

    # versions published and loaded by vLLM
    names = TopicNames(prefix)
    kafka = KafkaConfig(bootstrap_servers=local_stack.bootstrap)
    versions = asyncio.run(_published_versions(kafka, names.policy_versions))
    assert len(versions) >= MIN_VERSIONS
    assert [v.version for v in versions] == sorted(v.version for v in versions)
    latest = asyncio.run(_latest_version(own_redis_url, "toy"))
    # the pointer moves right after each announcement; a stop may fall between the two
    assert versions[-1].version - 1 <= latest <= versions[-1].version
    loaded = {int(v) for v in summary["loaded"].values()}
    assert loaded and max(loaded) >= MIN_VERSIONS
    scored = [h["version"] for h in summary["heldout"]]
    assert scored[0] == 0 and len(scored) >= MIN_VERSIONS  # vLLM served every scored version

    # groups flowed through every topic of the data path
    ends = asyncio.run(topic_end_offsets(kafka, names))
    assert all(ends[topic] > 0 for topic in ("trajectories", "groups", "policy-versions", "metrics")), ends
    assert ends["trajectories"] >= ends["groups"] * 2

    # held-out reward at least doubled and gained >= 0.3 on the 0-1 scale by the requested version
    first, last = summary["heldout_first"], summary["heldout_last"]
    assert scored[-1] >= UNTIL_VERSION, f"the {DURATION_CAP_S} s cap came first: {summary['heldout']}"
    assert last >= 2 * first and last - first >= 0.3, summary["heldout"]
    # ... under a reward that no constant answer can earn: the curve is the instruction learned, not the format
    constant = summary["best_constant_answer"]
    assert constant is not None and constant["reward_mean"] <= 0.2, constant
    assert last >= constant["reward_mean"] + 0.3, (constant, summary["heldout"])
