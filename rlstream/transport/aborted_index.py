"""read_committed consumers that do not drop committed records after an aborted transaction.

A fetch response lists the aborted transactions of the fetched range as (producer id, first offset), and
the consumer skips every transactional batch of such a producer id from that first offset on, until it
meets the producer's ABORT marker. Kafka lists only transactions whose ABORT marker is at or after the
fetch offset. noida-db (the local and test broker) also lists transactions that ended *before* it: a
consumer that read past an ABORT marker in one fetch and fetches on from there is told again that the
transaction is open, and then drops every later batch of that producer id (a restarted worker's producer
keeps the producer id of the one it fenced, with a new epoch), committed ones included, until the next
ABORT marker. Measured: a reader positioned while a killed worker's transaction was open never saw the
records the restarted worker committed afterwards.

:func:`install` makes aiokafka apply Kafka's rule on the client: an aborted transaction whose ABORT marker
this process has already read (a marker of that producer id at or after the transaction's first offset and
before the fetch offset) is left out of the list. A consumer that starts past an ABORT marker it never read
is not covered (the streams worker's changelog recovery and the test readers start at the log start).
:func:`rlstream.transport.kafka.make_consumer` installs it for every read_committed consumer (streams, learner,
sync worker, operator tools). rlstream patches aiokafka in two modules of ``rlstream/transport/``, this one and
``fetch_wait``; each :func:`install` checks the internals it needs and fails at start-up, naming them, when an
aiokafka release no longer has them.
"""
from __future__ import annotations

import bisect
import threading
from typing import Any

from aiokafka.consumer import fetcher as _fetcher

_lock = threading.Lock()
#: (topic, partition, producer id) -> sorted offsets of the ABORT markers read so far
_abort_markers: dict[tuple[str, int, int], list[int]] = {}
_installed = False


def _remember_abort(topic: str, partition: int, producer_id: int, offset: int) -> None:
    with _lock:
        offsets = _abort_markers.setdefault((topic, partition, producer_id), [])
        i = bisect.bisect_left(offsets, offset)
        if i == len(offsets) or offsets[i] != offset:
            offsets.insert(i, offset)


def ended_before(topic: str, partition: int, producer_id: int, first_offset: int, fetch_offset: int) -> bool:
    """Whether a transaction of ``producer_id`` that began at ``first_offset`` is known to have ended (an ABORT
    marker of that producer at or after ``first_offset``) before ``fetch_offset``."""
    with _lock:
        offsets = _abort_markers.get((topic, partition, producer_id))
        if not offsets:
            return False
        i = bisect.bisect_left(offsets, first_offset)
        return i < len(offsets) and offsets[i] < fetch_offset


def relevant_aborted(tp: Any, aborted: Any, fetch_offset: int) -> list[Any]:
    """The aborted transactions of a fetch response that can still hide records at or after ``fetch_offset``."""
    return [entry for entry in (aborted or [])
            if not ended_before(tp.topic, tp.partition, int(entry[0]), int(entry[1]), fetch_offset)]


def install() -> None:
    """Patch aiokafka's ``PartitionRecords`` in this process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    cls = getattr(_fetcher, "PartitionRecords", None)
    missing = [name for name in ("__init__", "_contains_abort_marker") if cls is None or not hasattr(cls, name)]
    if missing:
        raise RuntimeError(f"aiokafka.consumer.fetcher.PartitionRecords lacks {missing}: this aiokafka release is "
                           "not supported by rlstream's read_committed guard (rlstream/transport/aborted_index.py)")
    original_init = cls.__init__
    original_contains_abort = cls._contains_abort_marker

    def __init__(self: Any, tp: Any, records: Any, aborted_transactions: Any, fetch_offset: int,
                 *args: Any, **kwargs: Any) -> None:
        original_init(self, tp, records, relevant_aborted(tp, aborted_transactions, fetch_offset), fetch_offset,
                      *args, **kwargs)

    def _contains_abort_marker(self: Any, next_batch: Any) -> bool:
        is_abort = bool(original_contains_abort(self, next_batch))
        if is_abort and next_batch.producer_id is not None:
            _remember_abort(self._tp.topic, self._tp.partition, int(next_batch.producer_id),
                            int(next_batch.base_offset))
        return is_abort

    cls.__init__ = __init__
    cls._contains_abort_marker = _contains_abort_marker
