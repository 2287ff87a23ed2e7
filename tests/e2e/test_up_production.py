"""`rlstream up --traffic production`: the capture gateway in front of vLLM, simulated users (OpenAI client plain
and streamed, LangChain's ChatOpenAI, some two-turn sessions), feedback 1-10 s later for 70 % of the
conversations and never for the others; streams scores each single response against the task's baseline; the
learner trains on them and vLLM loads the versions; the promotion gate decides which version serves, and the
summary carries its decisions and the feedback-to-serving latency. Afterwards the console, on the run's own topics and
Redis, shows a promoted row for every version the gate promoted, in Debian's chromium.

The broker and Redis come from the test session, so the topics can be read after the run.
"""
from __future__ import annotations

import asyncio
import json
import re
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlstream.ops.infra import LocalStack
from rlstream.schemas.models import TrajectoryGroup
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane
from tests.support.browser import chromium_page, keep_screenshot, served_console

DURATION_S = 120


async def every_group(cfg: Any, topic: str) -> list[TrajectoryGroup]:
    """Every group written (read_uncommitted): `up` stops the streams worker, which may leave its last transaction
    open until the broker times it out, and a read_committed reader sees nothing past that transaction's start
    in the meantime. What is asserted holds of every written group, committed or not."""
    from rlstream.schemas.codec import AvroCodec
    from rlstream.transport.kafka import make_consumer
    from rlstream.transport.topic_reader import read_to_end

    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_uncommitted")
    await consumer.start()
    try:
        return [AvroCodec().decode(r.value, TrajectoryGroup) async for r in read_to_end(consumer, topic)]
    finally:
        await consumer.stop()


def test_up_with_production_traffic_trains_on_single_responses(local_stack: LocalStack, own_redis_url: str,
                                                               tmp_path: Path,
                                                               unique: str) -> None:
    from playwright.sync_api import expect

    from rlstream.schemas.config import load_config

    prefix = f"prod{unique}."
    env = {**os.environ, "RLSTREAM_KAFKA_BOOTSTRAP": local_stack.bootstrap, "RLSTREAM_REDIS_URL": own_redis_url}
    cmd = [sys.executable, "-m", "rlstream.cli", "up", "--traffic", "production", "--duration", str(DURATION_S),
           "--no-live", "--feedback-min-s", "1", "--feedback-max-s", "10", "--heldout", "8",
           "--runs-dir", str(tmp_path / "runs"), "-o", "topics.prefix", prefix,
           "-o", "streams.app_id", f"streams-{unique}",  # its own table changelogs and consumer group
           # the canary (on by default with production traffic) needs more feedback per arm than this short run
           # gives; its test is tested in tests/integration/test_gate_canary.py
           "-o", "gate.canary_share", "0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DURATION_S + 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stopped = {event["service"]: event.get("exit_code") for event in (
        json.loads(line) for line in (proc.stdout + proc.stderr).splitlines()
        if line.startswith("{") and '"event": "stopped"' in line)}
    # the exit codes of the multi-threaded learner and streams worker are collected (`up` logged null for them before)
    assert isinstance(stopped.get("learner"), int) and isinstance(stopped.get("streams"), int), stopped
    summary_line = next(line for line in proc.stdout.splitlines() if line.startswith("summary:"))
    summary = json.loads(Path(summary_line.split(":", 1)[1].strip()).read_text())
    logs = Path(summary["logs"])

    users = {k: int(v) for k, v in summary["users"].items()}
    # up made a client key, printed it, and the gateway requires it (the users' calls below all carried it)
    key = re.search(r"Authorization: Bearer (rls-[A-Za-z0-9_-]{40,})", proc.stdout)
    assert key is not None, proc.stdout[-3000:]
    assert "clients authenticate with API keys" in (logs / "gateway.log").read_text()
    assert key.group(1) not in (logs / "gateway.log").read_text()
    users_log = (logs / "users.log").read_text()
    failures = [line for line in users_log.splitlines() if "failed" in line]
    assert users["users_requests"] > 50 and users["users_errors"] == 0, "\n".join(failures[:10]) or users_log[-3000:]
    brief = {k: v for k, v in summary.items() if k != "heldout"}  # what a failed assertion shows
    assert users["users_streamed"] > 0 and users["users_langchain"] > 0, brief  # real clients of both kinds
    assert 0 < users["users_feedback_sent"] < users["users_conversations"], brief  # ~70 % get feedback, late
    assert summary["dlq"] == 0, brief  # conversations without feedback wait (streams.reward_window_s): none rejected

    cfg = load_config(None, [("kafka.bootstrap_servers", local_stack.bootstrap), ("topics.prefix", prefix)])
    groups = asyncio.run(every_group(cfg, TopicNames(prefix).groups))
    odd = [g for g in groups if len(g.trajectories) != 1 or g.baseline is None][:3]
    assert groups and not odd, (len(groups), odd)
    assert all(g.baseline.key == "toy|toy" and g.baseline.count >= 1 for g in groups), \
        {str(g.baseline) for g in groups if g.baseline.key != "toy|toy" or g.baseline.count < 1}
    assert any(len(g.trajectories[0].turns) == 2 for g in groups), brief  # a two-turn session is one trajectory
    # the live view counted them (up to its last refresh)
    assert 0 < summary["baseline_groups"] <= len(groups), (summary["baseline_groups"], len(groups))
    untokenized = [t for g in groups for t in g.trajectories if not t.turns[0].completion_token_ids][:3]
    assert not untokenized, untokenized  # token-in, token-out

    async def latest_version() -> int:
        control = ControlPlane(own_redis_url)
        try:
            return await control.latest_version("toy")
        finally:
            await control.close()

    # the learner trained on them (Redis, not the live view's last poll)
    assert asyncio.run(latest_version()) >= 2, brief
    loads = [json.loads(line) for line in (logs / "inference-sync.log").read_text().splitlines()
             if '"version loaded"' in line]
    assert any(int(event["version"]) >= 1 for event in loads)  # and vLLM loaded a trained version

    # the promotion gate ran (on by default) and decided; trained feedback reached every replica's serving version
    promotion = summary["promotion"]
    assert promotion["gate"] is True and "gate" in stopped, brief
    assert promotion["promoted"] >= 1 and promotion["serving_version"] is not None, promotion
    assert promotion["promoted"] + promotion["rejected"] >= 1 and promotion["rolled_back"] == 0, promotion
    assert promotion["last_decision"]["reason"], promotion
    p50, p90 = promotion["feedback_to_serving_s"]["p50"], promotion["feedback_to_serving_s"]["p90"]
    assert p50 is not None and 0 < p50 <= p90 < DURATION_S, promotion

    # the console of the run (its effective config, on the same broker and Redis) shows what the gate decided
    run_cfg = load_config(Path(summary["config"]), [("kafka.bootstrap_servers", local_stack.bootstrap),
                                                    ("redis.url", own_redis_url)])
    promoted = promotion["promoted_versions"]
    assert promoted and promoted[0] == 0, promotion  # the base weights serve first
    with served_console(run_cfg, lambda state: len(state["decisions"]) >= len(promoted)) as url, \
            chromium_page(url) as page:
        for version in promoted:
            expect(page.locator(f'#versions tr[data-version="{version}"]')).to_have_attribute("data-status",
                                                                                          "promoted")
        expect(page.locator("#chart canvas")).to_have_count(1)
        keep_screenshot(page, tmp_path / "console-up.png")
