"""The progress gate in isolation: markers, resync seeks, skips of applied records, seeks back over holes."""
from __future__ import annotations

import asyncio
from typing import Any

from faust.types import TP

from rlstream.streams.exactly_once import progress
from rlstream.streams.exactly_once.progress import Admission, ProgressGate, progress_key
from rlstream.transport.aborted_index import GapProof, GapVerdict


class RecordingConsumer:
    """Just the consumer surface the gate touches: assignment, committed offsets, seeks."""

    def __init__(self, assigned: set[TP], committed: dict[TP, int | None] | None = None) -> None:
        self.assigned = assigned
        self._committed_offset: dict[TP, int | None] = dict(committed or {})
        self.seeks: list[tuple[TP, int]] = []

    def assignment(self) -> set[TP]:
        return self.assigned

    async def seek_wait(self, partitions: dict[TP, int]) -> None:
        self.seeks.extend(partitions.items())

    async def earliest_offsets(self, *tps: TP) -> dict[TP, int]:
        return {tp: 0 for tp in tps}


T0, T1, R0 = TP("traj", 0), TP("traj", 1), TP("rew", 0)


HIDDEN = GapProof(GapVerdict.HIDDEN, None, "transaction markers and aborted records only")
VISIBLE = GapProof(GapVerdict.VISIBLE, 5, "a record outside any transaction")
UNPROVEN = GapProof(GapVerdict.UNPROVEN, 5, "offsets no longer in the log (deleted by retention?)")


class ScriptedProbe:
    """A probe answering from a script (None: no answer from the broker); records what it was asked."""

    def __init__(self, *answers: GapProof | None) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[TP, int, int]] = []

    async def __call__(self, tp: TP, start: int, stop: int) -> GapProof | None:
        self.asked.append((tp, start, stop))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def records_missing() -> ScriptedProbe:
    """The broker holds a visible record in the hole: a hole is records not delivered yet."""
    return ScriptedProbe(VISIBLE)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_resync_seeks_to_marker_plus_one_or_committed_offset() -> None:
    table = {progress_key("traj", 0): 41}
    consumer = RecordingConsumer({T0, T1, R0, TP("changelog", 0)}, committed={T1: 7, R0: None})
    gate = ProgressGate(table, consumer, {"traj", "rew"}, records_missing())
    seeks = run(gate.resync())
    assert seeks == {T0: 42, T1: 7, R0: 0}
    assert not gate.resync_needed
    gate.invalidate()
    assert gate.resync_needed


def test_applied_records_are_skipped_and_the_next_one_admitted() -> None:
    table: dict[str, int] = {}
    consumer = RecordingConsumer({T0}, committed={T0: 10})
    gate = ProgressGate(table, consumer, {"traj"}, records_missing())
    run(gate.resync())
    assert run(gate.admit("traj", 0, 9)) is Admission.APPLIED  # below the committed offset
    assert run(gate.admit("traj", 0, 10)) is Admission.PROCESS
    gate.applied("traj", 0, 10)
    assert table[progress_key("traj", 0)] == 10
    assert run(gate.admit("traj", 0, 10)) is Admission.APPLIED  # a replay after a seek
    assert run(gate.admit("traj", 0, 11)) is Admission.PROCESS


def test_a_hole_seeks_back_and_defers_until_the_missing_record_comes() -> None:
    table = {progress_key("traj", 0): 4}
    consumer = RecordingConsumer({T0})
    gate = ProgressGate(table, consumer, {"traj"}, records_missing())
    consumer.seeks.clear()
    assert run(gate.admit("traj", 0, 9)) is Admission.LATER
    assert consumer.seeks == [(T0, 5)]
    assert run(gate.admit("traj", 0, 10)) is Admission.LATER  # more stale records: no second seek
    assert consumer.seeks == [(T0, 5)]
    assert run(gate.admit("traj", 0, 5)) is Admission.PROCESS
    gate.applied("traj", 0, 5)
    run(gate.maintain())
    assert consumer.seeks == [(T0, 5)]  # the missing record came: nothing to repeat


def test_a_hole_with_records_in_it_is_never_accepted_on_a_timer(monkeypatch: Any) -> None:
    table = {progress_key("traj", 0): 4}
    consumer = RecordingConsumer({T0})
    probe = records_missing()
    gate = ProgressGate(table, consumer, {"traj"}, probe)
    monkeypatch.setattr(progress, "SEEK_BACK_RETRY_S", 0.0)
    monkeypatch.setattr(progress, "PROBE_RETRY_S", 0.0)
    for _ in range(20):  # far longer than any fixed patience: the records are there, so they must come
        assert run(gate.admit("traj", 0, 9)) is Admission.LATER
        run(gate.maintain())
    assert len(consumer.seeks) == 21 and set(consumer.seeks) == {(T0, 5)}
    assert len(probe.asked) == 20 and set(probe.asked) == {(T0, 5, 9)}
    assert run(gate.admit("traj", 0, 5)) is Admission.PROCESS  # the missing record, at last


def test_offsets_proven_to_hold_only_markers_and_aborted_records_are_passed_at_once() -> None:
    table = {progress_key("traj", 0): 4}
    consumer = RecordingConsumer({T0})
    gate = ProgressGate(table, consumer, {"traj"}, ScriptedProbe(HIDDEN))  # 5..8: transaction markers / aborted
    assert run(gate.admit("traj", 0, 9)) is Admission.PROCESS
    assert consumer.seeks == []


def test_a_gap_that_cannot_be_proven_hidden_stops_the_partition_loudly(monkeypatch: Any) -> None:
    table = {progress_key("traj", 0): 4}
    consumer = RecordingConsumer({T0})
    stops: list[tuple[TP, int, int, GapProof]] = []
    gate = ProgressGate(table, consumer, {"traj"}, ScriptedProbe(UNPROVEN),
                        on_unproven_gap=lambda *args: stops.append(args))
    monkeypatch.setattr(progress, "PROBE_RETRY_S", 0.0)
    for _ in range(5):  # however often the record comes, it never passes the gap
        assert run(gate.admit("traj", 0, 9)) is Admission.LATER
    assert stops == [(T0, 5, 9, UNPROVEN)] * 5
    assert table == {progress_key("traj", 0): 4}


def test_an_unanswered_probe_defers_the_record_and_is_asked_again_later(monkeypatch: Any) -> None:
    table = {progress_key("traj", 0): 4}
    consumer = RecordingConsumer({T0})
    probe = ScriptedProbe(None, HIDDEN)
    gate = ProgressGate(table, consumer, {"traj"}, probe)
    assert run(gate.admit("traj", 0, 9)) is Admission.LATER  # no answer: never a guess
    assert run(gate.admit("traj", 0, 9)) is Admission.LATER  # not asked again right away
    assert len(probe.asked) == 1
    monkeypatch.setattr(progress, "PROBE_RETRY_S", 0.0)
    assert run(gate.admit("traj", 0, 9)) is Admission.PROCESS
    assert len(probe.asked) == 2


class FaustLikeConsumer(RecordingConsumer):
    """Also keeps Faust's read offsets: Faust drops fetched records below them."""

    def __init__(self, assigned: set[TP], committed: dict[TP, int | None] | None = None) -> None:
        super().__init__(assigned, committed)
        self._read_offset: dict[TP, int | None] = {}


def test_seeks_move_fausts_read_offset_back_so_deferred_records_come_again() -> None:
    table = {progress_key("traj", 0): 41}
    consumer = FaustLikeConsumer({T0, T1}, committed={T1: 0})
    consumer._read_offset.update({T0: 57, T1: 12})  # records handed to the stream (and deferred) before the resync
    gate = ProgressGate(table, consumer, {"traj"}, records_missing())
    run(gate.resync())
    assert consumer._read_offset == {T0: 42, T1: None}  # None: what faust's Consumer.seek stores for offset 0
    consumer._read_offset[T0] = 60
    assert run(gate.admit("traj", 0, 60)) is Admission.LATER
    assert consumer.seeks[-1] == (T0, 42) and consumer._read_offset[T0] == 42
