"""The broker facts the exactly-once streams worker relies on, on the real broker.

* The progress gate's probe: it reads a gap from the log and proves it holds only transaction markers and
  aborted records (go on), or finds a committed record in it ("records not delivered yet": seek back), or
  cannot prove either (offsets the log does not hold: the partition stops), without a timer.
* The recovery's settle wait: it returns only once the open transaction on a changelog is decided, however
  long that takes, and says meanwhile what it waits for.
"""
from __future__ import annotations

import asyncio

from faust.types import TP

from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from rlstream.streams.exactly_once.progress import GapProbe
from rlstream.streams.exactly_once.state_reset import SettledTransactions
from rlstream.transport.aborted_index import GapProof, GapVerdict
from rlstream.transport.kafka import create_topics, make_consumer, make_producer

PARTITION = 1


async def write_with_markers(cfg: RlstreamConfig, topic: str) -> dict[str, int]:
    """committed a, b | aborted c | committed d, then a plain record e; returns each record's offset."""
    producer = make_producer(cfg.kafka, transactional_id=f"{cfg.run_id}-probe")
    await producer.start()
    offsets: dict[str, int] = {}
    try:
        for names, commit in ((("a", "b"), True), (("c",), False), (("d",), True)):
            await producer.begin_transaction()
            for name in names:
                offsets[name] = (await producer.send_and_wait(topic, name.encode(), partition=PARTITION)).offset
            if commit:
                await producer.commit_transaction()
            else:
                await producer.abort_transaction()
    finally:
        await producer.stop()
    plain = make_producer(cfg.kafka)
    await plain.start()
    try:
        offsets["e"] = (await plain.send_and_wait(topic, b"e", partition=PARTITION)).offset
    finally:
        await plain.stop()
    return offsets


def probe_gaps(cfg: RlstreamConfig, topic: str, gaps: list[tuple[int, int]]) -> list[GapProof | None]:
    """The gate's probe on each [start, stop) of ``gaps``."""
    async def go() -> list[GapProof | None]:
        probe = GapProbe(lambda: make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed"),
                         timeout_s=10)
        try:
            return [await probe(TP(topic, PARTITION), start, stop) for start, stop in gaps]
        finally:
            await probe.close()
    return asyncio.run(go())


def test_the_probe_proves_markers_and_aborted_records_and_finds_committed_ones(rl_config: RlstreamConfig) -> None:
    asyncio.run(create_topics(rl_config.kafka, rl_config.topics))
    topic = TopicNames.from_config(rl_config.topics).trajectories
    at = asyncio.run(write_with_markers(rl_config, topic))
    assert at["b"] - at["a"] == 1 and at["c"] > at["b"] + 1 and at["d"] > at["c"] + 1 and at["e"] > at["d"] + 1

    gap_after_b = at["b"] + 1  # b's commit marker, then c (aborted) and its abort marker
    proofs = probe_gaps(rl_config, topic, [(gap_after_b, at["d"]), (at["d"] + 1, at["e"]), (at["a"], at["d"]),
                                           (gap_after_b, at["e"]), (at["c"], at["c"] + 1)])
    assert [p.verdict if p else None for p in proofs] == [GapVerdict.HIDDEN, GapVerdict.HIDDEN, GapVerdict.VISIBLE,
                                                          GapVerdict.VISIBLE, GapVerdict.HIDDEN]
    assert proofs[2] is not None and proofs[2].offset == at["a"]
    assert proofs[3] is not None and proofs[3].offset == at["d"]  # a committed record: records not delivered yet


def test_offsets_the_log_does_not_hold_are_unproven(rl_config: RlstreamConfig) -> None:
    asyncio.run(create_topics(rl_config.kafka, rl_config.topics))
    topic = TopicNames.from_config(rl_config.topics).rewards  # empty: nothing below offset 3 can be accounted for
    proof = probe_gaps(rl_config, topic, [(0, 3)])[0]
    assert proof is not None and proof.verdict is GapVerdict.UNPROVEN and proof.offset == 0


def test_the_settle_wait_lasts_until_the_open_transaction_is_decided(rl_config: RlstreamConfig) -> None:
    asyncio.run(create_topics(rl_config.kafka, rl_config.topics))
    topic = TopicNames.from_config(rl_config.topics).groups

    async def go() -> tuple[bool, float]:
        producer = make_producer(rl_config.kafka, transactional_id=f"{rl_config.run_id}-settle")
        await producer.start()
        settled = SettledTransactions(lambda iso: make_consumer(rl_config.kafka, group_id=None, isolation_level=iso),
                                      report_every_s=0.5)
        try:
            await producer.begin_transaction()
            await producer.send_and_wait(topic, b"open", partition=PARTITION)
            waiting = asyncio.create_task(settled.wait({TP(topic, PARTITION), TP(topic, 0)}))
            await asyncio.sleep(3.0)  # six report periods: reporting is not giving up
            still_waiting = not waiting.done()
            await producer.commit_transaction()
            loop = asyncio.get_running_loop()
            decided_at = loop.time()
            await asyncio.wait_for(waiting, timeout=20)
            return still_waiting, loop.time() - decided_at
        finally:
            await settled.close()
            await producer.stop()

    still_waiting, after_decision_s = asyncio.run(go())
    assert still_waiting  # an open transaction holds the recovery back
    assert after_decision_s < 5  # and its commit releases it at once
