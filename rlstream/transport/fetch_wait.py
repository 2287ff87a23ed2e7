"""Consumers that do not spin on a broker which answers an empty fetch at once.

A Kafka broker holds a fetch that finds no new data for up to the consumer's ``fetch_max_wait_ms`` (500 ms by
default) and answers as soon as data arrives. noida-db, the local and test broker, answers an empty fetch at once,
whatever ``fetch_max_wait_ms`` and ``fetch_min_bytes`` say, and aiokafka's fetcher sends the next fetch to a broker
as soon as the previous one returns. Measured here: one idle aiokafka consumer sent about 3,000 fetches a second and
used 0.93 of a CPU core; an idle streams worker (Faust's consumer plus rlstream's readers) used a whole core, and
under load every process of a run competed with these loops for the machine's two cores.

:func:`install` makes a fetch that came back empty sooner than ``min_round_trip_s`` wait out the rest of that time
before the next fetch goes to that broker. Against Apache Kafka, which already held the empty fetch for
``fetch_max_wait_ms``, nothing changes; a fetch that brings records is never delayed; new data that arrives while a
consumer waits is fetched at most ``min_round_trip_s`` later. Set by ``kafka.empty_fetch_wait_ms``;
:func:`rlstream.transport.kafka.make_consumer` and the streams worker (for Faust's consumer) install it.

aiokafka is patched in two modules, both in ``rlstream/transport/`` and both checked when installed: this one
(``Fetcher._proc_fetch_request``) and ``aborted_index`` (``PartitionRecords``, and ``_proc_fetch_request`` too: each
wraps whatever the other left). An aiokafka release without the method fails at start-up with a message naming it.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import Any

from aiokafka.consumer import fetcher as _fetcher

_lock = threading.Lock()
_installed = False
_min_round_trip_s = 0.0


def min_round_trip_s() -> float:
    """The wait in force in this process (0: off)."""
    return _min_round_trip_s


def install(min_round_trip_ms: float) -> None:
    """Patch aiokafka's fetcher in this process (once); later calls only change the wait."""
    global _installed, _min_round_trip_s
    if min_round_trip_ms < 0:
        raise ValueError(f"min_round_trip_ms must be >= 0, got {min_round_trip_ms}")
    with _lock:
        _min_round_trip_s = min_round_trip_ms / 1000.0
        if _installed:
            return
        cls = getattr(_fetcher, "Fetcher", None)
        original = getattr(cls, "_proc_fetch_request", None)
        if original is None or not inspect.iscoroutinefunction(original):
            raise RuntimeError("aiokafka.consumer.fetcher.Fetcher._proc_fetch_request is missing or not a coroutine "
                               "function: this aiokafka release is not supported by rlstream's empty-fetch wait "
                               "(rlstream/transport/fetch_wait.py); set kafka.empty_fetch_wait_ms to 0 to run without")
        _installed = True

    async def _proc_fetch_request(self: Any, assignment: Any, node_id: int, request: Any) -> bool:
        started = time.monotonic()
        has_new_data = await original(self, assignment, node_id, request)
        if not has_new_data and _min_round_trip_s > 0:
            rest = _min_round_trip_s - (time.monotonic() - started)
            if rest > 0:
                try:
                    await asyncio.sleep(rest)  # the broker did not hold the fetch: hold it here
                except asyncio.CancelledError:
                    # as aiokafka's own fetch task does: closing the consumer cancels it and awaits it
                    return False
        return bool(has_new_data)

    cls._proc_fetch_request = _proc_fetch_request  # type: ignore[union-attr]
