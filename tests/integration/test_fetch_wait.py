"""An idle consumer does not poll the broker in a loop (rlstream/transport/fetch_wait.py), and a record that arrives
while it waits still reaches it at once.

The control turns the wait off: the embedded broker answers every empty fetch at once, so the same consumer then
sends hundreds of fetches a second (measured on an idle machine: about 3,000 and a whole CPU core)."""
from __future__ import annotations

import asyncio
import time

from aiokafka import TopicPartition
from aiokafka.consumer import fetcher

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.transport import fetch_wait
from rlstream.transport.kafka import make_consumer, make_producer


async def fetches_while_idle(cfg: RlstreamConfig, topic: str, seconds: float) -> int:
    """Fetch requests one assigned, idle consumer sends in ``seconds``, counted around the fetcher's request method."""
    consumer = make_consumer(cfg.kafka, group_id=None)  # installs the wait at cfg.kafka.empty_fetch_wait_ms
    counted = fetcher.Fetcher._proc_fetch_request
    calls = 0

    async def counting(self, *args):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return await counted(self, *args)

    fetcher.Fetcher._proc_fetch_request = counting  # type: ignore[method-assign]
    try:
        await consumer.start()
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.seek_to_end(TopicPartition(topic, 0))
        await consumer.getmany(timeout_ms=200)  # position known, fetching under way
        calls = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=100)
        return calls
    finally:
        fetcher.Fetcher._proc_fetch_request = counted  # type: ignore[method-assign]
        await consumer.stop()


async def delivery_latency_s(cfg: RlstreamConfig, topic: str) -> float:
    """Seconds from sending one record to an idle, waiting consumer having it."""
    consumer = make_consumer(cfg.kafka, group_id=None)
    producer = make_producer(cfg.kafka)
    await consumer.start()
    await producer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.getmany(timeout_ms=300)  # idle: only empty fetches, each held by the wait
        sent = time.monotonic()
        await producer.send_and_wait(topic, b"late", partition=0)
        while True:
            batch = await consumer.getmany(timeout_ms=1000)
            if any(r.value == b"late" for records in batch.values() for r in records):
                return time.monotonic() - sent
            assert time.monotonic() - sent < 10, "the record never reached the waiting consumer"
    finally:
        await producer.stop()
        await consumer.stop()


def test_an_idle_consumer_waits_between_empty_fetches_and_still_gets_new_records_at_once(
        rl_config: RlstreamConfig, created_topics: TopicNames) -> None:
    topic = created_topics.rewards
    waiting = rl_config.model_copy(update={"kafka": rl_config.kafka.model_copy(update={"empty_fetch_wait_ms": 20.0})})
    spinning = rl_config.model_copy(update={"kafka": rl_config.kafka.model_copy(update={"empty_fetch_wait_ms": 0.0})})
    try:
        with_wait = asyncio.run(fetches_while_idle(waiting, topic, 2.0))
        without_wait = asyncio.run(fetches_while_idle(spinning, topic, 2.0))  # the control: the broker never waits
    finally:
        fetch_wait.install(rl_config.kafka.empty_fetch_wait_ms)
    assert with_wait <= 2.0 / 0.020 * 1.2, f"{with_wait} fetches in 2 s with a 20 ms wait"
    assert without_wait > 5 * with_wait, (f"control: without the wait the idle consumer sent {without_wait} fetches "
                                          f"in 2 s, with it {with_wait}; the broker seems to hold empty fetches")
    latency = asyncio.run(delivery_latency_s(waiting, topic))
    assert latency < 0.5, f"a record took {latency:.3f} s to reach a waiting consumer"
