"""The private attributes of faust-streaming and aiokafka that carry the exactly-once guarantee, in one list,
checked when the streams worker is built.

No public API of faust-streaming 0.15 does these things: re-seek a partition so Faust hands records again
(``Consumer._read_offset``), know the committed offset before any record (``_committed_offset``), let a record
skipped out of order stay un-acked (``_unacked_messages``), hand a record's queued changelog writes to the producer
inside its transaction (``ProducerBuffer._send_pending``), read changelogs up to the broker's last stable offsets
(``Recovery._build_highwaters``) and wipe a store before recovery (the stores' private maps). A release that renamed
one of them would not fail: it would silently lose or repeat state. :func:`check_internals` makes the worker refuse
to start instead, naming what is missing. (aiokafka's fetcher, patched for read_committed reads, checks itself in
``rlstream/transport/aborted_index.py``.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnsupportedLibraryVersion(RuntimeError):
    """faust-streaming or aiokafka lacks an internal the exactly-once streams worker relies on."""


@dataclass(frozen=True)
class Internal:
    """One private attribute: on what, its name, and what rlstream uses it for."""

    owner: str
    attribute: str
    used_for: str


CONSUMER = [
    Internal("faust Consumer", "_read_offset", "moving Faust's read position back with a seek (progress gate)"),
    Internal("faust Consumer", "_committed_offset", "the resync position of a partition without a marker"),
    Internal("faust Consumer", "_unacked_messages", "leaving a record deferred out of order un-acked"),
]
PRODUCER_BUFFER = [Internal("faust ProducerBuffer", "_send_pending", "changelog writes inside their transaction")]
PRODUCER = [Internal("faust aiokafka Producer", "_transaction_producers",
                     "committing the open transactions when a rebalance begins")]
TRANSACTIONAL_PRODUCER = Internal("aiokafka AIOKafkaProducer", "_txn_manager",
                                  "whether a transactional producer has a transaction open")
RECOVERY = [
    Internal("faust Recovery", "_build_highwaters", "recovery up to the last stable offsets"),
    Internal("faust Recovery", "active_offsets", "recovery from the start of the changelogs"),
    Internal("faust Recovery", "standby_offsets", "recovery from the start of the changelogs"),
    Internal("faust Recovery", "tp_to_table", "the bulk changelog load (which table a changelog partition fills)"),
]
STORES = {
    "memory": [Internal("faust memory Store", "data", "the state wipe before recovery"),
               Internal("faust memory Store", "_key_partition", "the state wipe before recovery")],
    "rocksdb": [Internal("faust rocksdb Store", "_db_for_partition", "the state wipe before recovery"),
                Internal("faust rocksdb Store", "_key_index", "the state wipe before recovery")],
}


def missing(obj: Any, internals: list[Internal]) -> list[Internal]:
    """The internals that ``obj`` lacks."""
    return [internal for internal in internals if not hasattr(obj, internal.attribute)]


def check_internals(app: Any, store_kind: str) -> None:
    """Raise :class:`UnsupportedLibraryVersion` naming every internal the built app lacks (call before it starts)."""
    absent = missing(app.consumer, CONSUMER) + missing(app.producer.buffer, PRODUCER_BUFFER)
    absent += missing(app.producer, PRODUCER)
    absent += missing(app.tables.recovery, RECOVERY)
    for table in app.tables.values():
        absent += missing(table.data, STORES[store_kind])
        break  # every table uses the same store class
    if absent:
        import faust

        names = "; ".join(f"{i.owner}.{i.attribute} ({i.used_for})" for i in dict.fromkeys(absent))
        raise UnsupportedLibraryVersion(
            f"faust-streaming {faust.__version__} lacks what rlstream's exactly-once streams worker relies on: "
            f"{names}. Install the faust-streaming version pinned in constraints-cpu.txt "
            "(rlstream/streams/exactly_once/internals.py lists these)")


def open_transactional_ids(producer: Any) -> list[str]:
    """The transactional ids of Faust's producer that have a transaction open, in order. aiokafka builds its
    transaction manager in the producer's constructor, so a release without it fails here, naming it, rather
    than leaving the transactions open."""
    open_ids = []
    for tid, txn_producer in sorted(producer._transaction_producers.items()):
        if not hasattr(txn_producer, TRANSACTIONAL_PRODUCER.attribute):
            raise UnsupportedLibraryVersion(f"{TRANSACTIONAL_PRODUCER.owner}.{TRANSACTIONAL_PRODUCER.attribute} is "
                                            f"missing ({TRANSACTIONAL_PRODUCER.used_for})")
        manager = txn_producer._txn_manager
        if manager is not None and manager.is_in_transaction():
            open_ids.append(tid)
    return open_ids


def forget_unacked(consumer: Any, message: Any) -> None:
    """Leave ``message`` un-acked without acking it: Faust then never commits an offset past it."""
    consumer._unacked_messages.discard(message)


async def send_queued_changelogs(buffer: Any) -> None:
    """Hand every changelog record queued in Faust's producer buffer to the producer now."""
    while not buffer.pending.empty():
        fut = buffer.pending.get_nowait()
        try:
            await buffer._send_pending(fut)
        finally:
            buffer.message_sent.set()
