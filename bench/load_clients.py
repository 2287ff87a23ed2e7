"""Concurrent HTTP clients in a process of their own, for bench/gateway_throughput.py: C clients (aiohttp on uvloop,
one keep-alive connection each) post the same chat completion until N calls are answered, and print one JSON object
with every call's latency (s), the wall time of the load and the non-200 answers (counted by status and body). Run apart from what they measure,
the clients' work is not added to its event loop (on a shared machine they still compete for the cores).

Closed loop (the default): each client sends its next call when the last one is answered, so the calls/s is what the
server sustains at C calls in flight. With ``--rate R`` the C clients share a schedule of R calls per second instead
(open loop) and a call's latency counts from its scheduled time, so a server that falls behind is charged the wait.

    .venv/bin/python bench/load_clients.py URL --concurrency 16 --requests 2000 [--rate 500] [--header 'name: value']
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time

import aiohttp

BODY = {"model": "toy", "messages": [{"role": "user", "content": "Repeat the letter c."}], "max_tokens": 8,
        "temperature": 1.0}


async def run(url: str, concurrency: int, requests: int, warmup: int, headers: dict[str, str],
              rate: float | None) -> dict[str, object]:
    """Warm up with ``warmup`` calls, then time ``requests`` calls (see the module docstring)."""
    payload = json.dumps(BODY).encode()
    headers = {"content-type": "application/json", **headers}
    latencies: list[float] = []
    errors: dict[str, int] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        async def call(since: float | None = None) -> None:
            started = time.perf_counter() if since is None else since
            async with http.post(url, data=payload, headers=headers) as response:
                await response.read()
                if response.status != 200:
                    reason = f"{response.status} {(await response.text())[:200]}"
                    errors[reason] = errors.get(reason, 0) + 1
            latencies.append(time.perf_counter() - started)

        async def closed_loop(calls: "itertools.count[int]", total: int) -> None:
            while next(calls) < total:
                await call()

        counter = itertools.count()
        await asyncio.gather(*(closed_loop(counter, warmup) for _ in range(concurrency)))
        latencies.clear()
        started = time.perf_counter()
        if rate is None:
            counter = itertools.count()
            await asyncio.gather(*(closed_loop(counter, requests) for _ in range(concurrency)))
        else:
            schedule = itertools.count()

            async def open_loop() -> None:
                while (index := next(schedule)) < requests:
                    due = started + index / rate
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    await call(since=due)

            await asyncio.gather(*(open_loop() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"latencies": latencies, "elapsed_s": elapsed, "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the chat completions URL")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rate", type=float, default=None, help="calls per second offered by all clients together")
    parser.add_argument("--header", action="append", default=[], help="'name: value', repeatable")
    args = parser.parse_args()
    headers = {name.strip(): value.strip() for name, value in (h.split(":", 1) for h in args.header)}
    work = run(args.url, args.concurrency, args.requests, args.warmup, headers, args.rate)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(work)
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(work)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
