"""streams/deadlines.py: a tick pops what is due from a per-partition heap; the result is the whole-table walk's."""
from __future__ import annotations

import random
from typing import Any

import pytest

from rlstream.schemas.codec import AvroCodec
from rlstream.streams.assembly import AssemblyRules, GroupAssembler, Outcome, SourceRef
from rlstream.streams.baseline import is_baseline
from rlstream.streams.deadlines import DueIndex
from tests.support.factories import make_reward, make_trajectory

pytestmark = pytest.mark.unit

CODEC = AvroCodec()
T, R = "p.trajectories", "p.rewards"
RULES = AssemblyRules(group_timeout_s=10.0, min_group_size=2, closed_retention_s=30.0, single_timeout_s=50.0)


class Twin:
    """The same records and ticks through an assembler with the index and one that walks its table."""

    def __init__(self) -> None:
        self.index = DueIndex()
        self.indexed: dict[str, Any] = {}
        self.walked: dict[str, Any] = {}
        self.payloads: tuple[dict[SourceRef, bytes], dict[SourceRef, bytes]] = ({}, {})  # a group takes its own
        self.sent: dict[int, list[Any]] = {}  # example -> trajectories sent
        self.offset = 0

    def assemblers(self) -> tuple[GroupAssembler, GroupAssembler]:
        return (GroupAssembler(self.indexed, self.payloads[0], CODEC, RULES, self.index),
                GroupAssembler(self.walked, self.payloads[1], CODEC, RULES))

    def record(self, example: int, size: int, index: int, rewarded: bool, partition: int, now: float) -> None:
        self.offset += 1
        t = make_trajectory(example_id=f"ex-{example}", group_size=size, generation_index=index,
                            reward=float(index) if rewarded else None)
        self.sent.setdefault(example, []).append(t)
        raw, src = CODEC.encode(t), SourceRef(T, partition, self.offset)
        outcomes = [a.on_trajectory(t, raw, t.example_id.encode(), src, now, now) for a in self.assemblers()]
        assert summary(outcomes[0]) == summary(outcomes[1])

    def reward(self, example: int, pick: int, partition: int, now: float) -> None:
        """A reward for one of the example's trajectories (before any: for one not sent yet, held as early)."""
        self.offset += 1
        sent = self.sent.get(example) or [make_trajectory(example_id=f"ex-{example}")]
        ev = make_reward(sent[pick % len(sent)], 0.25 * (pick % 4))
        t = sent[pick % len(sent)]
        raw, src = CODEC.encode(ev), SourceRef(R, partition, self.offset)
        outcomes = [a.on_reward(ev, raw, t.example_id.encode(), src, now, now) for a in self.assemblers()]
        assert summary(outcomes[0]) == summary(outcomes[1])

    def tick(self, partition: int, now: float) -> list[str]:
        indexed, walked = self.assemblers()
        due_indexed, due_walked = indexed.due(partition, now), walked.due(partition, now)
        assert sorted(g for g, _ in due_indexed) == sorted(g for g, _ in due_walked)
        outcomes = indexed.time_out(due_indexed, now), walked.time_out(due_walked, now)
        assert summary(outcomes[0]) == summary(outcomes[1])
        assert self.indexed == self.walked
        return sorted(g for g, _ in due_indexed)


def summary(out: Outcome) -> tuple[Any, ...]:
    return (sorted(out.counts.items()), sorted(f.group.group_id for f in out.finished),
            sorted((r.reason, r.source.offset) for r in out.rejects))


@pytest.mark.parametrize("seed", range(12))
def test_ticks_find_what_the_whole_table_walk_finds(seed: int) -> None:
    """Random records, rewards and ticks over two partitions, with groups that complete, time out, expire, close and
    are forgotten, and the index dropped now and then (as a rebalance drops it): the same groups are due at every
    tick and the tables stay equal."""
    rng = random.Random(seed)
    twin, now, found = Twin(), 0.0, 0
    for _ in range(400):
        now += rng.choice([0.0, 0.5, 1.0, 3.0])
        example = rng.randrange(40)
        size = 1 if example % 7 == 0 else 2 + example % 3
        partition = example % 2
        roll = rng.random()
        if roll < 0.55:
            twin.record(example, size, rng.randrange(size), rng.random() < 0.6, partition, now)
        elif roll < 0.75:
            twin.reward(example, rng.randrange(8), partition, now)
        elif roll < 0.97:
            found += len(twin.tick(rng.randrange(2), now))
        else:
            twin.index.invalidate(rng.choice([None, 0, 1]))
    for later in (1000.0, 2000.0):  # open groups time out and close, then every closed group is forgotten
        for partition in (0, 1):
            found += len(twin.tick(partition, now + later))
    assert found > 20  # timeouts, expiries and forgotten closed groups all happened
    assert twin.indexed and all(is_baseline(data) for data in twin.indexed.values())  # only the baselines stay


def test_a_tick_costs_what_is_due_not_what_is_stored() -> None:
    """100,000 closed groups: after the heap is built, a tick pops only what is due."""
    groups = {f"g{i}": {"g": f"g{i}", "p": i % 4, "closed": True, "closed_at": float(i % 1000), "ids": ["a"]}
              for i in range(100_000)}
    index = DueIndex()
    assembler = GroupAssembler(groups, {}, CODEC, RULES, index)
    assert assembler.due(0, 29.0) == [] and index.size(0) == 25_000  # built once, nothing due yet
    due = assembler.due(0, 30.5)  # closed_at 0 on partition 0: the 100 multiples of 1,000
    assert sorted(g for g, _ in due) == sorted(f"g{i}" for i in range(0, 100_000, 1000))
    assert all(state is None for _, state in due)
    assert index.size(0) == 25_000 - 100


def test_without_invalidation_a_table_changed_underneath_is_missed() -> None:
    """Negative control: a state written into the table without the assembler (as a changelog recovery writes it)
    is not in a heap built before it; :meth:`DueIndex.invalidate`, called on every rebalance and recovery, makes the
    next tick read the table again."""
    groups: dict[str, Any] = {}
    index = DueIndex()
    assembler = GroupAssembler(groups, {}, CODEC, RULES, index)
    assert assembler.due(0, 0.0) == []  # heap of partition 0 built (empty)
    groups["recovered"] = {"g": "recovered", "p": 0, "closed": True, "closed_at": 0.0, "ids": []}
    assert assembler.due(0, 100.0) == []  # missed
    index.invalidate()
    assert assembler.due(0, 100.0) == [("recovered", None)]
