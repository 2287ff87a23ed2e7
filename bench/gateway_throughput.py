"""The throughput half of bench/gateway_overhead.py (``--throughput``): how many calls per second one gateway process
sustains, and what it adds to a call's latency at a production rate, against the same calls sent straight to the
upstream in the same run.

One `rlstream gateway serve` process with API keys and capture on (the embedded broker, the spool) in front of
bench/canned_upstream.py (it answers at once, so what is measured is the gateway's own work). The clients run in
processes of their own (bench/load_clients.py: aiohttp on uvloop), never on the gateway's event loop; on a 2-core
machine they, the upstream and the broker still share the cores with the gateway, which is said with the figures.

1. closed loop at 1, 16 and 64 concurrent clients: calls/s, p50 and p99 latency, straight and through the gateway,
   alternating round by round so that a slow moment of a shared machine hits both ways;
2. open loop at ``--rate`` calls/s (default 500) from 16 clients: p50 and p99 latency each way (a call's latency
   counts from its scheduled start, so a gateway that falls behind is charged the queueing) and the p99 the gateway
   adds. In a closed loop the latency at 16 clients is 16 / (calls/s) whatever a call costs, which is why the added
   latency is measured at a fixed rate;
3. the gateway's CPU time per call (its process's user + system time over the calls it served).

With ``--compare-tree DIR`` (a checkout of another revision) a second gateway process runs that tree's rlstream in
the same rounds, for a before/after on the same machine at the same moment.

The last line printed is one JSON object: ``calls_per_s`` (gateway, per concurrency), ``direct_calls_per_s``,
``p99_added_ms`` (at 16 clients and ``--rate``), ``p50_added_ms``, ``gateway_cpu_ms_per_call`` and the capture
figures (every call acknowledged by the broker).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import psutil

from gateway_overhead import MODEL, CannedUpstream, pct
from rlstream.ops.children import spawn
from rlstream.ops.infra import LocalStack
from rlstream.ops.ports import free_port
from rlstream.ops.processes import stop_pid
from rlstream.schemas.config import load_config
from rlstream.transport.kafka import create_topics

KEY = "bench-throughput-key-" + "0" * 32
HEADERS = {"authorization": f"Bearer {KEY}"}
KEYS_FILE = {"keys": [{"key": KEY, "name": "bench", "tenant": "bench", "models": [MODEL], "tasks": ["bench"],
                       "scopes": ["inference", "feedback", "admin"]}]}
LOAD_CLIENTS = Path(__file__).with_name("load_clients.py")


def load(url: str, concurrency: int, requests: int, headers: dict[str, str] | None = None,
         rate: float | None = None) -> dict[str, Any]:
    """bench/load_clients.py in its own process: the latencies (s), wall time and errors of ``requests`` calls."""
    cmd = [sys.executable, str(LOAD_CLIENTS), f"{url}/v1/chat/completions", "--concurrency", str(concurrency),
           "--requests", str(requests)]
    if rate is not None:
        cmd += ["--rate", str(rate)]
    for name, value in (headers or {}).items():
        cmd += ["--header", f"{name}: {value}"]
    out = json.loads(subprocess.run(cmd, capture_output=True, check=True).stdout)
    if out["errors"]:
        raise RuntimeError(f"calls to {url} not answered 200: {out['errors']}")
    return out


class Cell:
    """The calls of one way at one concurrency, pooled over the rounds."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.elapsed_s = 0.0

    def add(self, out: dict[str, Any]) -> None:
        self.latencies += out["latencies"]
        self.elapsed_s += out["elapsed_s"]

    @property
    def calls_per_s(self) -> float:
        return len(self.latencies) / self.elapsed_s

    def ms(self, q: float) -> float:
        return 1000 * pct(self.latencies, q)


def start_gateway(upstream: str, bootstrap: str, root: Path, name: str = "gateway",
                  tree: Path | None = None) -> tuple[Any, str]:
    """``rlstream gateway serve`` with API keys and capture (the spool on) in its own process; with ``tree``, the
    rlstream of that source tree (another revision, for a comparison in the same run)."""
    keys_file = root / "keys.json"
    keys_file.write_text(json.dumps(KEYS_FILE))
    keys_file.chmod(0o600)
    port = free_port()
    cmd = [sys.executable, "-m", "rlstream.cli", "--log-format", "json", "gateway", "serve", "--upstream", upstream,
           "--port", str(port), "--api-keys-file", str(keys_file), "--spool-dir", str(root / f"spool-{name}"),
           "-o", "gateway.served_model", MODEL, "-o", "gateway.route_versions", "false",
           "-o", "kafka.bootstrap_servers", bootstrap, "-o", "topics.prefix", "bench.", "-o", "policy", MODEL]
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None
    with open(root / f"{name}.log", "ab") as log:
        proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited: see {root / f'{name}.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the gateway did not start")


def capture_figures(url: str) -> dict[str, Any]:
    """The gateway's capture counters once the broker acknowledged what was queued (or after 30 s)."""
    stats: dict[str, Any] = {}
    for _ in range(300):
        stats = httpx.get(f"{url}/rlstream/stats", headers=HEADERS, timeout=5).json()["capture"]
        if stats["acknowledged"] >= stats["queued"]:
            break
        time.sleep(0.1)
    return stats


def cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def run_throughput(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="rlstream-bench-gw-throughput-"))
    concurrencies = (1, 16, 64)
    ways = ("direct", "gateway", "compared") if args.compare_tree else ("direct", "gateway")
    closed = {(way, c): Cell() for way in ways for c in concurrencies}
    opened = {way: Cell() for way in ways}
    cpu = {way: 0.0 for way in ways[1:]}
    upstream = CannedUpstream(root)
    stack = LocalStack.start(root / "infra")
    gateway = compared = None
    try:
        cfg = load_config(None, [("kafka.bootstrap_servers", stack.bootstrap), ("topics.prefix", "bench.")])
        asyncio.run(create_topics(cfg.kafka, cfg.topics))
        gateway, url = start_gateway(upstream.url, stack.bootstrap, root)
        servers = {"gateway": (gateway, url)}
        if args.compare_tree:
            compared, compared_url = start_gateway(upstream.url, stack.bootstrap, root, "compared",
                                                   Path(args.compare_tree).resolve())
            servers["compared"] = (compared, compared_url)
        calls = 0
        per_round = max(1, args.requests // args.rounds)
        for _ in range(args.rounds):
            for c in concurrencies:
                closed["direct", c].add(load(upstream.url, c, per_round))
                for way, (proc, base) in servers.items():
                    before = cpu_s(proc.pid)
                    closed[way, c].add(load(base, c, per_round, HEADERS))
                    cpu[way] += cpu_s(proc.pid) - before
                calls += per_round + 50  # the timed calls and the warm-up
            opened["direct"].add(load(upstream.url, 16, per_round, rate=args.rate))
            for way, (_, base) in servers.items():
                opened[way].add(load(base, 16, per_round, HEADERS, rate=args.rate))
        stats = capture_figures(url)
    finally:
        for proc in (gateway, compared):
            if proc is not None:
                stop_pid(proc.pid, timeout_s=20)
        upstream.stop()
        stack.stop()
    print(f"\n{date.today()} {platform.machine()} {psutil.cpu_count()} cores; one gateway process (API keys, capture "
          f"to the embedded broker, spool on) in front of bench/canned_upstream.py; clients in their own processes "
          f"(bench/load_clients.py); {args.requests} calls per cell in {args.rounds} alternating rounds; ms")
    print(f"{'closed loop':<14}{'clients':>8}{'direct/s':>10}{'gw/s':>8}{'direct p50':>12}{'gw p50':>8}"
          f"{'direct p99':>12}{'gw p99':>8}{'added p99':>11}")
    for c in concurrencies:
        d, g = closed["direct", c], closed["gateway", c]
        print(f"{'':<14}{c:>8}{d.calls_per_s:>10.0f}{g.calls_per_s:>8.0f}{d.ms(0.5):>12.2f}{g.ms(0.5):>8.2f}"
              f"{d.ms(0.99):>12.2f}{g.ms(0.99):>8.2f}{g.ms(0.99) - d.ms(0.99):>11.2f}")
    d, g = opened["direct"], opened["gateway"]
    print(f"open loop, 16 clients offering {args.rate:.0f} calls/s: direct p50 {d.ms(0.5):.2f} p99 {d.ms(0.99):.2f}; "
          f"gateway p50 {g.ms(0.5):.2f} p99 {g.ms(0.99):.2f}; added p50 {g.ms(0.5) - d.ms(0.5):.2f} "
          f"p99 {g.ms(0.99) - d.ms(0.99):.2f}; served {g.calls_per_s:.0f} calls/s")
    if args.compare_tree:
        print(f"compared: the gateway of {args.compare_tree}, in the same rounds")
        for c in concurrencies:
            o = closed["compared", c]
            print(f"{'':<14}{c:>8}{'':>10}{o.calls_per_s:>8.0f}{'':>12}{o.ms(0.5):>8.2f}{'':>12}{o.ms(0.99):>8.2f}"
                  f"{o.ms(0.99) - closed['direct', c].ms(0.99):>11.2f}")
        o = opened["compared"]
        print(f"open loop at {args.rate:.0f} calls/s: p50 {o.ms(0.5):.2f} p99 {o.ms(0.99):.2f}, added p99 "
              f"{o.ms(0.99) - d.ms(0.99):.2f}; CPU per call {1000 * cpu['compared'] / calls:.3f} ms")
    cpu_ms = 1000 * cpu["gateway"] / calls
    print(f"gateway CPU per call (closed-loop cells): {cpu_ms:.3f} ms; capture: {stats}")
    print(json.dumps({
        "calls_per_s": {str(c): round(closed["gateway", c].calls_per_s, 1) for c in concurrencies},
        "direct_calls_per_s": {str(c): round(closed["direct", c].calls_per_s, 1) for c in concurrencies},
        "p99_added_ms": round(g.ms(0.99) - d.ms(0.99), 2), "p50_added_ms": round(g.ms(0.5) - d.ms(0.5), 2),
        "rate": args.rate, "open_loop_served_per_s": round(g.calls_per_s, 1),
        "p99_added_ms_closed_loop": {str(c): round(closed["gateway", c].ms(0.99) - closed["direct", c].ms(0.99), 2)
                                     for c in concurrencies},
        "gateway_cpu_ms_per_call": round(cpu_ms, 3),
        "captured": stats.get("acknowledged"), "capture_failed": stats.get("failed"),
        **({"compared_calls_per_s": {str(c): round(closed["compared", c].calls_per_s, 1) for c in concurrencies},
            "compared_cpu_ms_per_call": round(1000 * cpu["compared"] / calls, 3)} if args.compare_tree else {})}))
