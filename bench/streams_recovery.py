"""Streams recovery time: how long a restarted worker takes from start to processing when its `groups` changelog
holds N records (default 1,000,000), next to two baselines measured in the same run: the same restart with an
almost empty changelog, and a bare aiokafka read (read_committed) of the same N changelog records.

    .venv/bin/python bench/streams_recovery.py --records 1000000

The records are what a busy worker leaves behind: closed groups (id, partition, close time, four member ids),
each group written `--updates` times (a group's state changes with each member and reward before it closes), so
the table recovers N / updates groups. "Start to processing" is from the worker process's spawn to its log line
"source partitions sought to their progress markers" (after table recovery and the resync of its inputs).
Goal (streams issue): under 60 s for 1,000,000 records.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokafka import AIOKafkaProducer, TopicPartition  # noqa: E402

from rlstream.ops.infra import LocalStack  # noqa: E402
from rlstream.schemas.config import RlstreamConfig, load_config  # noqa: E402
from rlstream.streams.app import prepare_topics  # noqa: E402
from rlstream.streams.assembly import ClosedGroup  # noqa: E402
from rlstream.transport.kafka import client_options, make_consumer  # noqa: E402
from bench.workload import StreamsWorker  # noqa: E402

PROCESSING_BEGAN = "sought to their progress markers"


def changelog_topic(cfg: RlstreamConfig) -> str:
    """Faust's name for the `groups` table's changelog topic."""
    return f"{cfg.streams.app_id}-groups-changelog"


async def fill_changelog(cfg: RlstreamConfig, records: int, updates: int) -> float:
    """Write ``records`` closed-group states (``updates`` per group) to the changelog; returns the seconds taken."""
    topic, partitions = changelog_topic(cfg), cfg.topics.partitions
    producer = AIOKafkaProducer(**client_options(cfg.kafka), linger_ms=20, max_batch_size=1 << 20,
                                compression_type=None, acks=1)
    await producer.start()
    started = time.perf_counter()
    try:
        now = time.time()
        pending = []
        for i in range(records):
            group = i // updates
            partition = group % partitions
            state = ClosedGroup(group_id=f"bench-g{group}", partition=partition, closed_at=now,
                                member_ids=[f"bench-g{group}-t{m}" for m in range(4)])
            pending.append(await producer.send(topic, json.dumps(state.to_json()).encode(),
                                               key=json.dumps(state.group_id).encode(), partition=partition))
            if len(pending) >= 20_000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return time.perf_counter() - started


async def raw_read_seconds(cfg: RlstreamConfig, records: int) -> float:
    """Seconds for a group-less read_committed consumer to read ``records`` records of the changelog."""
    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed")
    await consumer.start()
    try:
        topic = changelog_topic(cfg)
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or set())]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        started, seen = time.perf_counter(), 0
        while seen < records:
            batch = await consumer.getmany(timeout_ms=1000, max_records=50_000)
            seen += sum(len(rs) for rs in batch.values())
        return time.perf_counter() - started
    finally:
        await consumer.stop()


def start_to_processing(cfg: RlstreamConfig, log_dir: Path, timeout_s: float) -> float:
    """Seconds from spawning worker "bench" to its first resync (it then stops)."""
    worker = StreamsWorker(cfg, "bench", log_dir)
    before = worker.log_path.read_text(errors="replace").count(PROCESSING_BEGAN) if worker.log_path.exists() else 0
    started = time.perf_counter()
    worker.start()
    try:
        while worker.log_path.read_text(errors="replace").count(PROCESSING_BEGAN) <= before:
            if not worker.alive() or time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"the worker did not begin processing:\n{worker.log_tail()}")
            time.sleep(0.05)
        return time.perf_counter() - started
    finally:
        worker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000, help="changelog records to recover")
    ap.add_argument("--updates", type=int, default=4, help="changelog records per group")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up on a worker start after this long")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    stack = LocalStack.start(tmp / "infra")
    try:
        cfg = load_config(None, [("kafka.bootstrap_servers", stack.bootstrap), ("topics.prefix", "bench."),
                                 ("topics.partitions", "4"), ("streams.app_id", "bench-recovery"),
                                 ("streams.data_dir", str(tmp / "streams")),
                                 ("streams.closed_retention_s", "86400")])
        asyncio.run(prepare_topics(cfg))
        first = start_to_processing(cfg, tmp, args.timeout)  # creates the changelog topics; nothing to recover
        empty = start_to_processing(cfg, tmp, args.timeout)  # baseline: a restart with an (almost) empty changelog
        fill_s = asyncio.run(fill_changelog(cfg, args.records, args.updates))
        raw_s = asyncio.run(raw_read_seconds(cfg, args.records))
        full = start_to_processing(cfg, tmp, args.timeout)
    finally:
        stack.stop()
    print(f"\nchangelog: {args.records:,} records ({args.records // args.updates:,} groups), written in {fill_s:.1f} s")
    print(f"first start (creates topics)          : {first:7.1f} s")
    print(f"restart, empty changelog (baseline)   : {empty:7.1f} s")
    print(f"restart, {args.records:,} changelog records : {full:7.1f} s  (goal < 60 s)")
    print(f"  of it, above the empty restart      : {full - empty:7.1f} s  "
          f"({args.records / max(full - empty, 1e-9):,.0f} records/s)")
    print(f"bare read_committed read of the same  : {raw_s:7.1f} s  ({args.records / raw_s:,.0f} records/s)")
    print(f"recovery / bare read                  : {(full - empty) / raw_s:7.1f}x")


if __name__ == "__main__":
    main()
