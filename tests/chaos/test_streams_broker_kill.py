"""The broker SIGKILLed while the streams worker has transactions open, then restarted on the same port and data:
under read_committed every group comes out exactly once.

The worker leaves as soon as its broker stops listening (streams.exit_on_broker_loss): the embedded broker keeps no
transaction state across a SIGKILL, and a transaction the worker resumed on the restarted broker would hold its
partitions' last stable offsets back for good (tests/integration/test_broker_transaction_restart.py). It is then
restarted, as compose's `restart: unless-stopped` or any supervisor would, and resumes from the committed state:
what the interrupted transaction wrote is never visible (the restarted broker aborts it), what it had applied is
applied again once. The broker is killed once it has saved the published half (tests/support/broker_saves.py): noida-db loses
what it acknowledged after its last save, Apache Kafka does not."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

from rlstream.ops.infra import start_kafka
from rlstream.ops.ports import free_port
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from tests.support.broker_saves import wait_for_broker_save
from tests.support.streams_helpers import (Worker, assert_groups_match, interleaved_stream, publish, read_groups,
                                   wait_for_count)


def test_broker_sigkill_mid_transaction_loses_and_duplicates_nothing(rl_config: RlstreamConfig,
                                                                    tmp_path: Path) -> None:
    data_dir, port = tmp_path / "broker", free_port()
    broker = start_kafka(data_dir, port)
    cfg = rl_config.model_copy(deep=True)
    cfg.kafka.bootstrap_servers = f"127.0.0.1:{port}"
    asyncio.run(prepare_topics(cfg))
    names = TopicNames.from_config(cfg.topics)
    records, expected = interleaved_stream(cfg, n_examples=200, group_size=4, seed=31, late_fraction=0.3)
    half = len(records) // 2
    worker = Worker(cfg, "w1", tmp_path).start()
    restarts: list[float] = []
    stopping = threading.Event()

    def supervise() -> None:  # restart the worker whenever it has stopped (a process supervisor's job)
        while not stopping.wait(0.5):
            if not worker.alive():
                restarts.append(time.monotonic())
                worker.start()

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    try:
        asyncio.run(publish(cfg, records[:half], pace_every=40, pace_s=0.2))
        asyncio.run(wait_for_count(cfg, names.groups, 20, timeout_s=90))
        # the published half on disk first: this broker loses what it acknowledged after its last save (the worker's
        # own writes of the last second may still go; the restarted worker redoes them from the saved state)
        wait_for_broker_save(data_dir)
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGKILL)  # no flush, no clean close: transactions in flight
        time.sleep(3)
        broker = start_kafka(data_dir, port)  # same port, same data
        broker_back = time.monotonic()
        asyncio.run(publish(cfg, records[half:], pace_every=40, pace_s=0.2))
        groups = asyncio.run(read_groups(cfg, names.groups, expect=len(expected), timeout_s=180, quiet_s=5))
        try:
            assert_groups_match(groups, expected)
        except AssertionError as failure:
            raise AssertionError(f"{failure}\n{len(restarts)} restarts; worker log:\n{worker.log_tail(80)}") from None
        # while the broker is down each restart fails at once (as many as fit in its downtime); once it is back, at
        # most the one restart that comes up: another would be a crash with the broker up
        restarts_after = [t for t in restarts if t > broker_back]
        assert restarts and len(restarts_after) <= 1, \
            f"{len(restarts)} restarts, {len(restarts_after)} with the broker up\n{worker.log_tail(40)}"
        log_text = worker.log_path.read_text(errors="replace")
        assert "its broker went away while transactions may be open" in log_text, "the watch did not end the worker"
    finally:
        stopping.set()
        supervisor.join(5)
        worker.stop()
        broker.stop()
