"""The workload of the streams and codec benchmarks (the tests build on it too): realistic synthetic trajectory
events, a streams worker as a child process, and an idempotent publisher."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from rlstream.ops.children import spawn
from rlstream.ops.processes import stop_pid
from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import Message, ToolCall, TrajectoryEvent, Turn
from rlstream.transport.kafka import make_producer

ROOT = Path(__file__).resolve().parents[1]
CODEC = AvroCodec()


def make_trajectory(
    *,
    run_id: str = "run-0",
    example_id: str = "ex-0",
    group_id: str | None = None,
    group_size: int = 4,
    generation_index: int = 0,
    policy: str = "policy",
    policy_version: int = 0,
    reward: float | None = 1.0,
    turns: int = 1,
    completion_tokens: int = 8,
    prompt_tokens: int = 8,
    with_tool_call: bool = False,
    seed: int | None = None,
) -> TrajectoryEvent:
    """A well-formed trajectory: system + user, then ``turns`` assistant turns with token data."""
    rng = random.Random(seed)
    messages = [Message(role="system", content="You are terse."), Message(role="user", content=f"question {example_id}")]
    turn_records = []
    for t in range(turns):
        if with_tool_call and t == 0:
            messages.append(Message(role="assistant", content=None,
                                    tool_calls=[ToolCall(id="call_1", name="lookup", arguments='{"q": "x"}')]))
            messages.append(Message(role="tool", content="42", tool_call_id="call_1"))
        else:
            messages.append(Message(role="assistant", content=f"answer {t}"))
            if t < turns - 1:
                messages.append(Message(role="user", content="go on"))
        turn_records.append(
            Turn(
                message_index=len(messages) - (2 if with_tool_call and t == 0 else 1),
                model="policy",
                function="<workflow>",
                prompt_token_ids=[rng.randrange(1000) for _ in range(prompt_tokens)],
                completion_token_ids=[rng.randrange(1000) for _ in range(completion_tokens)],
                completion_logprobs=[-rng.random() * 3 for _ in range(completion_tokens)],
            )
        )
    return TrajectoryEvent(
        run_id=run_id,
        example_id=example_id,
        group_id=group_id or f"{run_id}:{example_id}",
        group_size=group_size,
        generation_index=generation_index,
        policy=policy,
        policy_version=policy_version,
        messages=messages,
        turns=turn_records,
        reward=reward,
        reward_components={"correct": reward} if reward is not None else {},
        metadata={"task": "test"},
        target="<workflow>",
        producer_id="synthetic",
    )


def worker_overrides(cfg: RlstreamConfig, **extra: Any) -> list[str]:
    """The -o pairs that point a worker process at the test's broker, topics and app id."""
    base = {
        "kafka.bootstrap_servers": cfg.kafka.bootstrap_servers,
        "kafka.session_timeout_ms": cfg.kafka.session_timeout_ms,
        "redis.url": cfg.redis.url,
        "topics.prefix": cfg.topics.prefix,
        "topics.partitions": cfg.topics.partitions,
        "run_id": cfg.run_id,
        "policy": cfg.policy,
        "streams.app_id": cfg.streams.app_id,
        "streams.data_dir": str(cfg.streams.data_dir),
        "streams.tick_interval_s": 0.5,
        "streams.commit_interval_s": 0.5,
        "streams.metrics_interval_s": 1.0,
    }
    base.update(extra)
    args: list[str] = []
    for k, v in base.items():
        args += ["-o", k, str(v)]
    return args


class StreamsWorker:
    """``python -m rlstream.cli streams worker`` as a child process that dies with this one, its output in
    ``log_dir/<worker_id>.log``, stopped by PID."""

    def __init__(self, cfg: RlstreamConfig, worker_id: str, log_dir: Path, loglevel: str = "WARNING",
                 **extra: Any) -> None:
        self.cmd = [sys.executable, "-m", "rlstream.cli", "streams", "worker", "--worker-id", worker_id,
                    "--log-level", loglevel, *worker_overrides(cfg, **extra)]
        self.log_path = log_dir / f"{worker_id}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "StreamsWorker":
        with open(self.log_path, "ab") as log:
            self.proc = spawn(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_pid(self.proc.pid, timeout_s=20)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of its log."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


async def publish(cfg: RlstreamConfig, records: Iterable[tuple[str, bytes | None, bytes | None]],
                  pace_every: int = 0, pace_s: float = 0.0) -> None:
    """Send (topic, key, value) records in order with an idempotent producer."""
    producer = make_producer(cfg.kafka, linger_ms=5)
    await producer.start()
    try:
        futures = []
        for i, (topic, key, value) in enumerate(records):
            futures.append(await producer.send(topic, value, key=key))
            if pace_every and (i + 1) % pace_every == 0:
                await asyncio.sleep(pace_s)
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
