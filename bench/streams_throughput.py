"""Streams throughput: raw aiokafka consume rate of `trajectories` vs the Faust assembly rate of the same
events, measured in one run on one broker, printed with their ratio; then assembly latency p50/p99 at a fixed
offered load. Realistic events: 8 turns, 512 completion tokens with logprobs each.

Assembly is timed two ways: while the events are being published (publish -> every group readable: the
publisher's CPU competes with the worker and the broker on a small machine), and on a backlog, like the raw rate:
the worker stopped, the events published, the worker started again, timed from its first group of the backlog to
its last (the ratio against the raw rate uses this one). CPU time is measured too (the raw consumer's process, the
worker's process over the backlog, and the local broker's process in both): on a shared machine, where the rates move
with the other load, the CPU per trajectory of each side and their ratio move much less, and on a small machine the
broker's share of the cores bounds both rates.

    .venv/bin/python bench/streams_throughput.py --groups 400 --group-size 4 [--commit-interval 0.2]
        [--group-commit-delay 0.05] [--latency-groups 200] [--producer-linger-ms 0] [--producer-batch-bytes 16384]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
from aiokafka import TopicPartition  # noqa: E402

from rlstream.ops.infra import LocalStack  # noqa: E402
from rlstream.transport.kafka import make_consumer  # noqa: E402
from rlstream.schemas.config import RlstreamConfig, StreamsConfig, load_config  # noqa: E402
from rlstream.schemas.topics import TopicNames  # noqa: E402
from rlstream.streams.app import prepare_topics  # noqa: E402
from rlstream.streams.telemetry import percentile  # noqa: E402
from bench.workload import CODEC, StreamsWorker, make_trajectory, publish  # noqa: E402


def events(cfg: RlstreamConfig, groups: int, size: int, prefix: str) -> list[tuple[str, bytes, bytes]]:
    names = TopicNames.from_config(cfg.topics)
    out = []
    for e in range(groups):
        for g in range(size):
            t = make_trajectory(run_id=cfg.run_id, example_id=f"{prefix}{e}", group_size=size, generation_index=g,
                                policy=cfg.policy, reward=g / size, turns=8, completion_tokens=512,
                                prompt_tokens=256, seed=e * 100 + g)
            out.append((names.trajectories, t.example_id.encode(), CODEC.encode(t)))
    return out


async def read_from_beginning(consumer: Any, topic: str) -> None:
    """Assign every partition of ``topic`` to a group-less consumer and rewind it to the start."""
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or set())]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process ``pid`` has used so far (all its threads)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def raw_consume_rate(cfg: RlstreamConfig, topic: str, n: int,
                           broker_pid: int | None = None) -> tuple[float, float, float | None]:
    """Trajectories per second of a plain consumer reading ``n`` records from the start of ``topic``, the CPU
    seconds per trajectory its process used, and those the broker (``broker_pid``, when it is a local process) used."""
    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    try:
        await read_from_beginning(consumer, topic)
        seen, start, cpu_start = 0, time.perf_counter(), cpu_seconds(os.getpid())
        broker_start = cpu_seconds(broker_pid) if broker_pid else 0.0
        while seen < n:
            batch = await consumer.getmany(timeout_ms=500)
            seen += sum(len(r) for r in batch.values())
        broker = (cpu_seconds(broker_pid) - broker_start) / n if broker_pid else None
        return n / (time.perf_counter() - start), (cpu_seconds(os.getpid()) - cpu_start) / n, broker
    finally:
        await consumer.stop()


async def wait_groups(cfg: RlstreamConfig, topic: str, n: int) -> float:
    """Seconds until ``n`` groups are readable (read_committed)."""
    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed")
    await consumer.start()
    try:
        await read_from_beginning(consumer, topic)
        seen, start = 0, time.perf_counter()
        while seen < n:
            batch = await consumer.getmany(timeout_ms=200)
            seen += sum(len(r) for r in batch.values())
        return time.perf_counter() - start
    finally:
        await consumer.stop()


async def from_the_end(cfg: RlstreamConfig, topic: str) -> Any:
    """A read_committed consumer of every partition of ``topic``, positioned at its current end: no earlier record
    is read while a clock runs."""
    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed")
    await consumer.start()
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or set())]
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)  # resolved now, not at the first fetch
    return consumer


async def group_latencies(cfg: RlstreamConfig, topic: str, produced_at: dict[str, float], n: int,
                          positioned: asyncio.Event) -> list[float]:
    """The latency of each of the next ``n`` groups, from its last member's publication to the group being readable
    (read_committed); sets ``positioned`` once the reader is at the topic's end."""
    consumer = await from_the_end(cfg, topic)
    latencies: list[float] = []
    try:
        positioned.set()
        seen = 0
        while seen < n:
            batch = await consumer.getmany(timeout_ms=200)
            now = time.time()
            for records in batch.values():
                for r in records:
                    seen += 1
                    # a group's key is its example id: no decode (16 ms per 180 KiB group) delays the clock
                    example_id = r.key.decode() if r.key is not None else ""
                    if example_id in produced_at:
                        latencies.append(now - produced_at[example_id])
        return latencies
    finally:
        await consumer.stop()


async def backlog_span(cfg: RlstreamConfig, topic: str, n: int, start_worker: Callable[[], int],
                       broker_pid: int | None = None) -> tuple[float, float, float | None]:
    """Seconds from the first to the last of the ``n`` groups a worker started by ``start_worker`` (which returns its
    PID) makes readable (read_committed), and the CPU seconds the worker and the broker (``broker_pid``, when it is a
    local process) used in that time; the reader is positioned at the topic's end before the worker starts."""
    consumer = await from_the_end(cfg, topic)
    try:
        pid = start_worker()
        seen, first, cpu_first, broker_first = 0, None, 0.0, 0.0
        while seen < n:
            batch = await consumer.getmany(timeout_ms=100)
            now = time.perf_counter()
            seen += sum(len(r) for r in batch.values())
            if first is None and seen:
                first, cpu_first = now, cpu_seconds(pid)
                broker_first = cpu_seconds(broker_pid) if broker_pid else 0.0
        assert first is not None
        broker = cpu_seconds(broker_pid) - broker_first if broker_pid else None
        return time.perf_counter() - first, cpu_seconds(pid) - cpu_first, broker
    finally:
        await consumer.stop()


async def paced_publish(cfg: RlstreamConfig, records: list[tuple[str, bytes, bytes]], rate: float,
                        produced_at: dict[str, float]) -> None:
    from rlstream.transport.kafka import make_producer

    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        start = time.perf_counter()
        for i, (topic, key, value) in enumerate(records):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await producer.send_and_wait(topic, value, key=key)
            produced_at[key.decode()] = time.time()
    finally:
        await producer.stop()


def state_bytes_per_waiting(records: list[tuple[str, bytes, bytes]], group_size: int) -> float:
    """Changelog bytes (JSON, as the worker's groups table writes them) per trajectory waiting in an open group: the
    first group_size - 1 members of every group, held by the worker's own assembler over plain dicts."""
    from rlstream.streams.assembly import AssemblyRules, GroupAssembler, SourceRef
    from rlstream.streams.payloads import PayloadCache
    from rlstream.schemas.models import TrajectoryEvent

    groups: dict[str, Any] = {}
    assembler = GroupAssembler(groups, PayloadCache(1 << 30), CODEC, AssemblyRules(3600.0, 2))
    waiting = 0
    for offset, (topic, key, value) in enumerate(records):
        event = CODEC.decode(value, TrajectoryEvent)
        if event.generation_index < group_size - 1:
            assembler.on_trajectory(event.model_copy(update={"reward": None}), value, key,
                                    SourceRef(topic, 0, offset), 0.0, 0.0)
            waiting += 1
    return sum(len(json.dumps(k)) + len(json.dumps(v)) for k, v in groups.items()) / max(1, waiting)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--rate", type=float, default=None,
                    help="offered load (trajectories/s) for the latency part; default: half the measured assembly rate")
    ap.add_argument("--latency-groups", type=int, default=200, help="groups timed for the latency (p99 of 200)")
    ap.add_argument("--commit-interval", type=float, default=StreamsConfig.model_fields["commit_interval_s"].default,
                    help="streams.commit_interval_s of the worker (default: the config's)")
    ap.add_argument("--group-commit-delay", type=float,
                    default=StreamsConfig.model_fields["group_commit_delay_s"].default,
                    help="streams.group_commit_delay_s of the worker (default: the config's; 0: periodic commits only)")
    ap.add_argument("--producer-linger-ms", type=int,
                    default=StreamsConfig.model_fields["producer_linger_ms"].default,
                    help="streams.producer_linger_ms of the worker (default: the config's)")
    ap.add_argument("--producer-batch-bytes", type=int,
                    default=StreamsConfig.model_fields["producer_batch_bytes"].default,
                    help="streams.producer_batch_bytes of the worker (default: the config's)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-streams-"))
    stack = LocalStack.start(tmp / "infra")
    worker = None
    try:
        cfg = load_config(None, [("kafka.bootstrap_servers", stack.bootstrap), ("kafka.session_timeout_ms", "6000"),
                                 ("redis.url", stack.redis_url), ("topics.prefix", "bench."),
                                 ("topics.partitions", "4"), ("streams.app_id", "bench-streams"),
                                 ("streams.data_dir", str(tmp / "streams")), ("streams.min_reward_diff", "0")])
        names = TopicNames.from_config(cfg.topics)
        asyncio.run(prepare_topics(cfg))
        recs = events(cfg, args.groups, args.group_size, "ex")
        n = len(recs)
        size = sum(len(v) for *_, v in recs) / n
        asyncio.run(publish(cfg, recs))
        broker_pid = None if stack.kafka.external else stack.kafka.pid
        raw, raw_cpu, raw_broker_cpu = asyncio.run(raw_consume_rate(cfg, names.trajectories, n, broker_pid))
        # the assembler will read these from a fresh topic prefix: publish them there after the warm-up
        cfg = cfg.model_copy(update={"topics": cfg.topics.model_copy(update={"prefix": "bench2."})})
        names = TopicNames.from_config(cfg.topics)
        asyncio.run(prepare_topics(cfg))
        recs = [(names.trajectories, k, v) for _, k, v in recs]
        worker = StreamsWorker(cfg, "bench", tmp, **{"streams.commit_interval_s": args.commit_interval,
                                                     "streams.group_commit_delay_s": args.group_commit_delay,
                                                     "streams.producer_linger_ms": args.producer_linger_ms,
                                                     "streams.producer_batch_bytes": args.producer_batch_bytes}).start()
        warm = events(cfg, 1, args.group_size, "warm")
        asyncio.run(publish(cfg, warm))
        asyncio.run(wait_groups(cfg, names.groups, 1))  # worker joined, recovered and running
        t0 = time.perf_counter()
        asyncio.run(publish(cfg, recs))
        asyncio.run(wait_groups(cfg, names.groups, 1 + args.groups))
        total = time.perf_counter() - t0
        faust_rate = n / total
        print(f"events: {n} trajectories, {size / 1024:.1f} KiB each (8 turns x 512 tokens + logprobs)")
        print(f"raw aiokafka consume : {raw:10.1f} trajectories/s (a backlog)")
        print(f"faust assembly       : {faust_rate:10.1f} trajectories/s while publishing (publish -> all groups "
              f"readable, {total:.1f}s; assembly/raw {faust_rate / raw:.3f})")
        print(f"state per waiting trajectory: {state_bytes_per_waiting(recs, args.group_size):.0f} bytes of changelog "
              f"state (the record itself, {size / 1024:.1f} KiB, stays on its topic)")
        rate = args.rate or faust_rate / 2
        lat_recs = events(cfg, args.latency_groups, args.group_size, "lat")
        produced_at: dict[str, float] = {}

        async def latency_run() -> list[float]:
            positioned = asyncio.Event()
            waiter = asyncio.create_task(group_latencies(cfg, names.groups, produced_at, args.latency_groups,
                                                         positioned))
            await positioned.wait()
            await paced_publish(cfg, lat_recs, rate, produced_at)
            return await waiter

        lats = [x for x in asyncio.run(latency_run()) if x >= 0]
        print(f"latency at {rate:.0f} trajectories/s offered (commit interval {args.commit_interval} s, group commit "
              f"delay {args.group_commit_delay} s): "
              f"p50 {percentile(lats, 50) * 1000:.0f} ms, "
              f"p90 {percentile(lats, 90) * 1000:.0f} ms, p99 {percentile(lats, 99) * 1000:.0f} ms, "
              f"max {max(lats) * 1000:.0f} ms (last member published -> group readable, "
              f"read_committed, {len(lats)} groups)")

        worker.stop()
        asyncio.run(publish(cfg, events(cfg, args.groups, args.group_size, "backlog")))

        def start_worker() -> int:
            assert worker is not None
            proc = worker.start().proc
            assert proc is not None
            return proc.pid

        span, worker_cpu, broker_cpu = asyncio.run(backlog_span(cfg, names.groups, args.groups, start_worker,
                                                                broker_pid))
        assembled = (args.groups - 1) * args.group_size  # the first group's members came before the clock
        backlog_rate = assembled / span
        print(f"faust assembly       : {backlog_rate:10.1f} trajectories/s of a backlog (first -> last group "
              f"readable, {span:.1f}s)")
        print(f"CPU per trajectory   : raw consumer {raw_cpu * 1000:.2f} ms, worker over the backlog "
              f"{worker_cpu / assembled * 1000:.2f} ms (user + system, all threads; "
              f"raw/worker {raw_cpu * assembled / worker_cpu if worker_cpu else float('nan'):.3f})")
        if raw_broker_cpu is not None and broker_cpu is not None:
            print(f"broker CPU per traj. : serving the raw consumer {raw_broker_cpu * 1000:.2f} ms, during the "
                  f"assembly of the backlog {broker_cpu / assembled * 1000:.2f} ms (its fetches, the groups and "
                  "changelogs produced, the transactions, this benchmark's reader of the groups)")
        print(f"ratio raw/faust      : {raw / backlog_rate:10.1f}x (assembly/raw {backlog_rate / raw:.3f}; goal >= 0.25)")
    finally:
        if worker:
            worker.stop()
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the broker's log: gigabytes with --groups in the thousands


if __name__ == "__main__":
    main()
