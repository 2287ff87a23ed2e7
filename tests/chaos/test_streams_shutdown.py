"""SIGTERM stops a streams worker process within 10 s whatever the broker is doing, and loses no applied work.

Each test runs its own broker (noida-db on a private port and data directory), so that it can be killed, frozen
(SIGSTOP: connections stay open and nothing answers) or restarted without disturbing the session's broker.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from rlstream.ops.infra import ServiceProcess, start_kafka
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from tests.support.streams_helpers import (Worker, assert_groups_match, interleaved_stream, publish, read_groups,
                                   wait_for_count)

STOP_WITHIN_S = 10.0


class Broker:
    """A private noida-db that a test may kill, freeze and start again (same port, same data)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.service: ServiceProcess = start_kafka(root)
        self.port = int(self.service.address.rsplit(":", 1)[1])
        self.frozen = False

    def kill(self) -> None:
        assert self.service.pid is not None
        os.kill(self.service.pid, signal.SIGKILL)
        self.service.stop(timeout_s=5)  # reaps it

    def freeze(self) -> None:
        assert self.service.pid is not None
        os.kill(self.service.pid, signal.SIGSTOP)
        self.frozen = True

    def restart(self) -> None:
        self.service = start_kafka(self.root, port=self.port)

    def stop(self) -> None:
        if self.frozen and self.service.pid is not None:
            os.kill(self.service.pid, signal.SIGCONT)
        self.service.stop(timeout_s=10)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "broker")
    yield b
    b.stop()


@pytest.fixture
def cfg(rl_config: RlstreamConfig, broker: Broker) -> RlstreamConfig:
    """The test's config, on the private broker."""
    kafka = rl_config.kafka.model_copy(update={"bootstrap_servers": broker.service.address})
    return rl_config.model_copy(update={"kafka": kafka})


def sigterm_and_time(worker: Worker, limit_s: float = 30.0) -> tuple[float, int | None]:
    """SIGTERM the worker; seconds until it exited (``limit_s`` when it did not) and its exit code."""
    assert worker.proc is not None
    start = time.monotonic()
    os.kill(worker.proc.pid, signal.SIGTERM)
    try:
        code: int | None = worker.proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        code = None
    return time.monotonic() - start, code


def start_and_feed(cfg: RlstreamConfig, tmp_path: Path, names: TopicNames
                   ) -> tuple[Worker, dict[str, dict[str, float]]]:
    """A worker that has emitted some groups and holds open ones (a transaction may be open). Its broker watch is
    off: these tests are about a worker that is still there when the broker goes away (Apache Kafka's setting)."""
    worker = Worker(cfg, "w1", tmp_path, **{"streams.exit_on_broker_loss": False}).start()
    records, expected = interleaved_stream(cfg, n_examples=8, group_size=3, seed=3, late_fraction=0.5)
    asyncio.run(publish(cfg, records))
    asyncio.run(wait_for_count(cfg, names.groups, len(expected), timeout_s=45))
    # a group left open, so that the worker holds state and its partition's transaction has work in it
    half, _ = interleaved_stream(cfg, n_examples=1, group_size=3, seed=4, late_fraction=1.0, prefix="open")
    asyncio.run(publish(cfg, [r for r in half if r[0] == names.trajectories]))
    time.sleep(1.5)
    return worker, expected


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_sigterm_stops_the_worker_within_10s_when_the_broker_is_gone(cfg: RlstreamConfig, broker: Broker,
                                                                     tmp_path: Path, fault: str) -> None:
    asyncio.run(prepare_topics(cfg))
    names = TopicNames.from_config(cfg.topics)
    worker, expected = start_and_feed(cfg, tmp_path, names)
    try:
        broker.kill() if fault == "killed" else broker.freeze()
        time.sleep(2)  # the worker's clients notice (or not) that the broker is gone
        assert worker.alive(), worker.log_tail()
        took, code = sigterm_and_time(worker)
        print(f"broker {fault}: worker stopped {took:.1f} s after SIGTERM, exit code {code}")
        assert code is not None and took < STOP_WITHIN_S, f"{fault}: exit after {took:.1f} s, code {code}\n" \
                                                          f"{worker.log_tail()}"
        if fault == "killed":
            # exactly-once state survived the forced stop: with the broker back, a new worker emits every group
            # once (the committed ones are not emitted again) and none is lost
            broker.restart()
            more, expected_more = interleaved_stream(cfg, n_examples=4, group_size=3, seed=5, prefix="after")
            restarted = Worker(cfg, "w1", tmp_path).start()
            try:
                asyncio.run(publish(cfg, more))
                groups = asyncio.run(read_groups(cfg, names.groups, expect=len(expected) + len(expected_more),
                                                 timeout_s=40, quiet_s=2))
                assert restarted.alive(), restarted.log_tail()
                assert_groups_match(groups, {**expected, **expected_more})
            finally:
                restarted.stop()
    finally:
        worker.stop()


def test_sigterm_mid_stream_with_a_live_broker_keeps_committed_work(cfg: RlstreamConfig, tmp_path: Path) -> None:
    """The control: the same stop with the broker up is clean (exit code 0), and after a restart every group
    comes out exactly once: none emitted before the stop is emitted again, none is lost."""
    asyncio.run(prepare_topics(cfg))
    names = TopicNames.from_config(cfg.topics)
    worker = Worker(cfg, "w1", tmp_path).start()
    records, expected = interleaved_stream(cfg, n_examples=150, group_size=3, seed=7, late_fraction=0.3)
    restarted = None
    try:
        asyncio.run(publish(cfg, records))
        before = asyncio.run(wait_for_count(cfg, names.groups, 10, timeout_s=45))
        took, code = sigterm_and_time(worker)
        print(f"broker up: worker stopped {took:.1f} s after SIGTERM, exit code {code}")
        assert code == 0 and took < STOP_WITHIN_S, f"exit after {took:.1f} s, code {code}\n{worker.log_tail()}"
        emitted = asyncio.run(read_groups(cfg, names.groups, timeout_s=10, quiet_s=1))
        assert before <= len(emitted) < len(expected), "the stop came after the stream was done"
        restarted = Worker(cfg, "w1", tmp_path).start()
        groups = asyncio.run(read_groups(cfg, names.groups, expect=len(expected), timeout_s=60, quiet_s=2))
        assert restarted.alive(), restarted.log_tail()
        assert_groups_match(groups, expected)  # each once: the ones emitted before the stop were not emitted again
    finally:
        worker.stop()
        if restarted:
            restarted.stop()
