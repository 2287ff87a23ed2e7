"""Poison pills: every kind of bad record on ``trajectories`` and ``rewards`` reaches ``dlq`` with its own reason
within seconds, while valid groups on the same partition keep coming out and the worker keeps running."""
from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from aiokafka import TopicPartition

from rlstream.schemas.codec import AvroCodec
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.models import DeadLetter, Message, RewardEvent
from rlstream.schemas.topics import TopicNames
from rlstream.streams import validation as v
from rlstream.streams.app import prepare_topics
from rlstream.transport.deadletter import truncations
from rlstream.transport.kafka import make_consumer, make_producer
from tests.support.factories import make_reward, make_trajectory
from tests.support.streams_helpers import CODEC, Worker, assert_groups_match, interleaved_stream, read_groups

PARTITION = 0  # every record of this test: pills must not hold up the valid records behind them
DEADLINE_S = 5.0  # a pill's dead letter is readable this soon after it was sent
OVERSIZED = 1_040_000  # over kafka.max_message_bytes (1,000,000), under the broker's limit (1 MiB)


@dataclass
class Pill:
    name: str
    topic: str
    key: bytes | None
    value: bytes | None
    reason: str
    offset: int = -1


def trajectory_of_size(cfg: RlstreamConfig, size: int, example_id: str, **fields: object) -> bytes:
    """A well-formed TrajectoryEvent whose encoding is exactly ``size`` bytes (``fields`` set on it)."""
    big = AvroCodec(max_bytes=4 * size)
    t = make_trajectory(run_id=cfg.run_id, example_id=example_id, group_size=2, policy=cfg.policy)
    t = t.model_copy(update=fields)

    def encoded(pad: int) -> bytes:
        messages = [*t.messages[:-1], Message(role="assistant", content="x" * pad)]
        return big.encode(t.model_copy(update={"messages": messages}))

    pad = size - len(encoded(0))
    for _ in range(3):  # the length prefix of the content grows with it
        pad += size - len(encoded(pad))
    data = encoded(pad)
    assert len(data) == size
    return data


def pills(cfg: RlstreamConfig, names: TopicNames) -> list[Pill]:
    T, R = names.trajectories, names.rewards
    good = make_trajectory(run_id=cfg.run_id, example_id="pill", group_size=3, policy=cfg.policy)
    enc = CODEC.encode(good)
    return [
        Pill("oversized", T, b"pill", trajectory_of_size(cfg, OVERSIZED, "pill"), v.TOO_LARGE),
        # each member fits, their group record would not: both members go to the dlq when the group completes
        # (waiting members cost the state only their offsets, whatever their size: streams/payloads.py)
        *(Pill(f"group too large, member {i}", T, b"big", trajectory_of_size(
            cfg, 600_000, "big", group_id="big-group", generation_index=i, reward=float(i)), v.GROUP_TOO_LARGE)
          for i in range(2)),
        Pill("garbage", T, b"pill", b"\xff\xfe not avro \x00\x01" * 20, v.CORRUPT_PAYLOAD),
        Pill("truncated avro", T, b"pill", enc[:-25], v.CORRUPT_PAYLOAD),
        Pill("unknown fingerprint", T, b"pill", b"\xc3\x01" + b"\x5a" * 8 + enc[10:], v.UNKNOWN_SCHEMA),
        Pill("unknown schema id", R, b"pill", b"\x00\x00\x00\x30\x39" + enc[10:], v.UNKNOWN_SCHEMA),
        Pill("wrong event type", T, b"pill", CODEC.encode(make_reward(good, 1.0)), v.WRONG_EVENT_TYPE),
        Pill("nan reward", T, b"pill", CODEC.encode(good.model_copy(update={"reward": math.nan})),
             v.NON_FINITE_REWARD),
        Pill("inf reward", R, b"pill", CODEC.encode(RewardEvent(
            trajectory_id=good.trajectory_id, group_id=good.group_id, example_id="pill", reward=-math.inf)),
             v.NON_FINITE_REWARD),
        Pill("key mismatch", T, b"not-the-example", enc, v.KEY_MISMATCH),
        Pill("reward key mismatch", R, b"not-the-example", CODEC.encode(make_reward(good, 0.5)), v.KEY_MISMATCH),
        Pill("huge key", T, b"k" * 500_000, enc, v.KEY_MISMATCH),
        Pill("empty value", T, b"pill", b"", v.EMPTY_VALUE),
        Pill("tombstone", R, b"pill", None, v.EMPTY_VALUE),
    ]


async def publish_to_partition(cfg: RlstreamConfig, records: list[tuple[str, bytes | None, bytes | None]]) -> list[int]:
    """Send the records in order to partition 0 of their topics; returns their offsets."""
    producer = make_producer(cfg.kafka, linger_ms=5)
    await producer.start()
    try:
        futures = [await producer.send(topic, value, key=key, partition=PARTITION) for topic, key, value in records]
        return [md.offset for md in await asyncio.gather(*futures)]
    finally:
        await producer.stop()


async def watch_dlq(cfg: RlstreamConfig, topic: str, want: set[tuple[str, int]], timeout_s: float
                    ) -> dict[tuple[str, int], tuple[float, DeadLetter]]:
    """Read ``dlq`` (read_committed) until a letter for every wanted (source topic, offset) arrived; returns
    each with the monotonic time it was first seen."""
    consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed")
    await consumer.start()
    seen: dict[tuple[str, int], tuple[float, DeadLetter]] = {}
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or set())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        while not want <= set(seen) and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=100)).values():
                for r in records:
                    d = CODEC.decode(r.value, DeadLetter)
                    seen.setdefault((d.source_topic, d.source_offset), (time.monotonic(), d))
        return seen
    finally:
        await consumer.stop()


def test_every_poison_pill_is_dead_lettered_within_seconds_while_its_partition_flows(
        rl_config: RlstreamConfig, tmp_path: Path) -> None:
    asyncio.run(prepare_topics(rl_config))
    names = TopicNames.from_config(rl_config.topics)
    worker = Worker(rl_config, "w1", tmp_path).start()
    try:
        # warm-up: once a first group is out, the worker is up (start-up time is not what is measured)
        warm, warm_expected = interleaved_stream(rl_config, n_examples=1, group_size=2, seed=1, prefix="warm")
        asyncio.run(publish_to_partition(rl_config, warm))
        assert len(asyncio.run(read_groups(rl_config, names.groups, expect=1, timeout_s=45, quiet_s=0.2))) == 1, \
            worker.log_tail()

        good, expected = interleaved_stream(rl_config, n_examples=4, group_size=3, seed=5, prefix="ok")
        bad = pills(rl_config, names)
        mixed: list[tuple[str, bytes | None, bytes | None] | Pill] = list(good)
        rng = random.Random(4)
        for pill in bad:
            mixed.insert(rng.randrange(1, len(mixed)), pill)
        # the oversized pill again, last: nothing valid comes behind it to push its partition's commit along
        bad.append(Pill("oversized, last", bad[0].topic, bad[0].key, bad[0].value, bad[0].reason))
        mixed.append(bad[-1])

        sent_at = time.monotonic()
        offsets = asyncio.run(publish_to_partition(
            rl_config, [(m.topic, m.key, m.value) if isinstance(m, Pill) else m for m in mixed]))
        for m, offset in zip(mixed, offsets):
            if isinstance(m, Pill):
                m.offset = offset

        letters = asyncio.run(watch_dlq(rl_config, names.dlq, {(p.topic, p.offset) for p in bad}, timeout_s=15))
        missing = [p.name for p in bad if (p.topic, p.offset) not in letters]
        assert not missing, f"no dead letter for {missing}\n{worker.log_tail()}"
        late = {p.name: round(letters[(p.topic, p.offset)][0] - sent_at, 2) for p in bad
                if letters[(p.topic, p.offset)][0] - sent_at > DEADLINE_S}
        assert not late, f"dead letters later than {DEADLINE_S} s after sending: {late}"
        for p in bad:
            d = letters[(p.topic, p.offset)][1]
            assert (p.name, d.error_type) == (p.name, p.reason), d.error_message
            assert d.source_partition == PARTITION and d.error_message and d.service == "streams:w1"
        assert len(letters) == len(bad), "a valid record was dead-lettered"

        # the value at the size limit comes cut, with the original's size and sha256; the huge key likewise
        for name in ("oversized", "oversized, last"):
            p = next(p for p in bad if p.name == name)
            d = letters[(p.topic, p.offset)][1]
            assert p.value is not None and d.value is not None and p.value.startswith(d.value)
            note = truncations(d.error_message)["value"]
            assert (note.original_size, note.sha256) == (OVERSIZED, hashlib.sha256(p.value).hexdigest())
        huge = next(p for p in bad if p.name == "huge key")
        d = letters[(huge.topic, huge.offset)][1]
        assert d.value == huge.value and huge.key is not None and d.key is not None and huge.key.startswith(d.key)
        assert truncations(d.error_message)["key"].original_size == 500_000
        fine = next(p for p in bad if p.name == "garbage")
        assert letters[(fine.topic, fine.offset)][1].value == fine.value  # a small record is carried whole

        groups = asyncio.run(read_groups(rl_config, names.groups, expect=1 + len(expected), timeout_s=15, quiet_s=1))
        assert_groups_match(groups, {**warm_expected, **expected})
        assert worker.alive(), worker.log_tail()
    finally:
        worker.stop()
