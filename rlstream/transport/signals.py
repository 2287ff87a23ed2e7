"""Stopping a service's event loop on SIGINT / SIGTERM."""
from __future__ import annotations

import asyncio
import signal
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_stop_signals(callback: Callable[[], object]) -> None:
    """Call ``callback`` on SIGINT and SIGTERM, in the running loop (main thread only, as asyncio requires)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, callback)


def stop_event(duration_s: float | None = None) -> asyncio.Event:
    """An event set by SIGINT/SIGTERM (and after ``duration_s`` when given), for the running loop's service."""
    stop = asyncio.Event()
    on_stop_signals(stop.set)
    if duration_s:
        asyncio.get_running_loop().call_later(duration_s, stop.set)
    return stop


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or less when ``stop`` is set."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass
