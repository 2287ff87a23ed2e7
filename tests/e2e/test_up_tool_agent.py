"""`rlstream up --model smollm2 --task tool-agent --traffic production`, the data path only (the learning curve is
the benchmark run of docs/tool-agent.md): simulated users run the OpenAI Agents SDK agent through the capture
gateway on SmolLM2-135M-Instruct in vLLM (tool calling on, hermes parser); a `lookup` tool call comes back parsed,
the SDK runs the tool, and the session (call, tool result, answer) is one multi-turn trajectory; its late feedback
scores it against the task's keyed baseline; the learner trains LoRA versions on them and vLLM loads one.

The broker and Redis come from the test session, so the topics can be read after the run.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlstream.ops.infra import LocalStack
from rlstream.ops.tool_task import TOOL_NAME, lookup_value
from rlstream.schemas.models import TrajectoryEvent, TrajectoryGroup
from rlstream.schemas.topics import TopicNames
from rlstream.transport.control import ControlPlane

#: an upper bound: the run stops once version 1 has been scored on the held-out prompts (a LoRA step of SmolLM2 on
#: two multi-turn episodes takes a minute or more on a loaded 2-core machine)
DURATION_S = 420


async def every_record(cfg: Any, topic: str, model: type) -> list[Any]:
    """Every record written to ``topic`` (read_uncommitted: `up` may stop the streams worker mid-transaction)."""
    from rlstream.schemas.codec import AvroCodec
    from rlstream.transport.kafka import make_consumer
    from rlstream.transport.topic_reader import read_to_end

    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_uncommitted")
    await consumer.start()
    try:
        return [AvroCodec().decode(r.value, model) async for r in read_to_end(consumer, topic)]
    finally:
        await consumer.stop()


def tool_exchange(event: TrajectoryEvent) -> tuple[dict[str, Any], str] | None:
    """(the first lookup call's arguments, the tool message that follows it) of a trajectory, if it has one: after
    the question (the last user message; the worked exchanges before it are part of the prompt)."""
    messages = event.messages
    question = max((i for i, m in enumerate(messages) if m.role == "user"), default=0)
    for i, message in enumerate(messages[:-1]):
        if i <= question:
            continue
        calls = [c for c in (message.tool_calls or []) if c.name == TOOL_NAME]
        if message.role == "assistant" and calls and messages[i + 1].role == "tool":
            try:
                return json.loads(calls[0].arguments), str(messages[i + 1].content)
            except ValueError:
                continue
    return None


@pytest.fixture(scope="module")
def smollm2_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runs/models directory holding the converted SmolLM2 (converted once for the module)."""
    from rlstream.ops.toy import smollm2_model_dir

    models = tmp_path_factory.mktemp("models")
    smollm2_model_dir(models / "smollm2")
    return models


@pytest.mark.timeout(DURATION_S + 900)
def test_tool_agent_sessions_through_the_gateway_are_trained_as_multi_turn_trajectories(
        local_stack: LocalStack, own_redis_url: str, tmp_path: Path, unique: str, smollm2_models: Path) -> None:
    from rlstream.schemas.config import load_config

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "models").symlink_to(smollm2_models)
    prefix = f"tool{unique}."
    env = {**os.environ, "RLSTREAM_KAFKA_BOOTSTRAP": local_stack.bootstrap, "RLSTREAM_REDIS_URL": own_redis_url}
    cmd = [sys.executable, "-m", "rlstream.cli", "up", "--model", "smollm2", "--task", "tool-agent",
           "--traffic", "production", "--duration", str(DURATION_S), "--until-version", "1", "--no-live", "--no-gate",
           "--feedback-min-s", "1", "--feedback-max-s", "5", "--heldout", "2", "--runs-dir", str(runs),
           "-o", "learner.groups_per_step", "2", "-o", "topics.prefix", prefix,
           "-o", "streams.app_id", f"streams-{unique}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DURATION_S + 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary_line = next(line for line in proc.stdout.splitlines() if line.startswith("summary:"))
    summary = json.loads(Path(summary_line.split(":", 1)[1].strip()).read_text())
    brief = {k: v for k, v in summary.items() if k != "heldout"}
    logs = Path(summary["logs"])
    users = {k: int(v) for k, v in summary["users"].items()}
    assert users["users_conversations"] > 0 and users["users_errors"] == 0, (logs / "users.log").read_text()[-3000:]

    cfg = load_config(None, [("kafka.bootstrap_servers", local_stack.bootstrap), ("topics.prefix", prefix)])
    names = TopicNames(prefix)
    trajectories = asyncio.run(every_record(cfg, names.trajectories, TrajectoryEvent))
    # a tool call captured through the Agents SDK and the gateway, and the tool's own result in the messages
    exchanges = [(e, x) for e in trajectories if (x := tool_exchange(e)) is not None]
    assert exchanges, [[(m.role, m.content, m.tool_calls) for m in e.messages] for e in trajectories[:3]]
    for event, (arguments, result) in exchanges:
        assert result == lookup_value(str(arguments.get("entity", "")), str(arguments.get("attribute", ""))), \
            (arguments, result)
        assert event.metadata.get("session_id") and len(event.turns) >= 2  # the call and the answer: one session
        assert all(t.prompt_token_ids and t.completion_token_ids for t in event.turns)

    # scored against the task's keyed baseline, and multi-turn ones among them
    groups = asyncio.run(every_record(cfg, names.groups, TrajectoryGroup))
    assert groups and all(len(g.trajectories) == 1 and g.baseline is not None for g in groups), len(groups)
    assert {g.baseline.key for g in groups} == {"toy|tool-agent"}, {g.baseline.key for g in groups}
    multi_turn = [g for g in groups if len(g.trajectories[0].turns) >= 2
                  and any(m.role == "tool" for m in g.trajectories[0].messages)]
    assert multi_turn, brief

    async def latest_version() -> int:
        control = ControlPlane(own_redis_url)
        try:
            return await control.latest_version("toy")
        finally:
            await control.close()

    assert asyncio.run(latest_version()) >= 1, brief  # the learner trained a LoRA version on them
    loads = [json.loads(line) for line in (logs / "inference-sync.log").read_text().splitlines()
             if '"version loaded"' in line]
    assert any(int(event["version"]) >= 1 for event in loads), brief  # and vLLM loaded it
    # the held-out view reports the task's own figures per version
    assert summary["heldout"] and {"success", "tool_call_parsed", "answer_words"} <= set(
        summary["heldout"][0]["components"]), summary["heldout"]
    assert set(summary["task_baselines"]) and all(0 <= v <= 0.5 for v in summary["task_baselines"].values()), brief
