"""The gateway fleet half of bench/gateway_overhead.py (``--gateways N --upstreams M``), in one run on one machine:

1. throughput and latency of non-streamed calls at 16 concurrent clients: straight to one canned upstream, through
   one gateway in front of one upstream, and through N gateways (`rlstream gateway serve` processes) behind a
   round-robin TCP balancer, routing over M upstreams that acknowledged the version in Redis (least outstanding
   requests); the three ways alternate in rounds so that a slow moment of the shared machine hits each;
2. the time from a session's last call (its explicit end answered) to its trajectory being readable on
   ``trajectories`` (read_committed), with sessions stitched in the stream app (a `rlstream streams worker` over
   ``calls``) and, in the same run, with a gateway that holds sessions in memory
   (``-o gateway.session_stitching gateway``).

The upstreams are bench/canned_upstream.py processes (they answer at once), so what is measured is the gateways'
and the stitcher's work, not a model's.
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from rlstream.ops.children import spawn
from rlstream.ops.infra import LocalStack
from rlstream.ops.ports import free_port
from rlstream.ops.processes import stop_pid
from rlstream.schemas.config import load_config
from rlstream.schemas.models import TrajectoryEvent
from rlstream.schemas.topics import TopicNames
from rlstream.streams.app import prepare_topics
from rlstream.transport.control import ControlPlane
from rlstream.transport.kafka import make_consumer
from rlstream.transport.serving import ReplicaAck, ServingControl
from rlstream.schemas.codec import AvroCodec

MODEL = "toy"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Repeat the letter c."}], "max_tokens": 8}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


async def wait_healthy(url: str, proc: Any, what: str) -> None:
    async with httpx.AsyncClient(timeout=2) as http:
        for _ in range(400):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited")
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} did not start")


class Fleet:
    """The processes of one run (upstreams, gateways, a streams worker), stopped together."""

    def __init__(self, root: Path, stack: LocalStack) -> None:
        self.root, self.stack, self.procs = root, stack, []
        self.overrides = ["-o", "kafka.bootstrap_servers", stack.bootstrap, "-o", "topics.prefix", "bench.",
                          "-o", "policy", MODEL, "-o", "redis.url", stack.redis_url, "-o", "run_id", "bench"]

    def _spawn(self, name: str, cmd: list[str]) -> Any:
        with open(self.root / f"{name}.log", "ab") as log:
            proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    async def upstream(self, index: int) -> str:
        port = free_port()
        proc = self._spawn(f"upstream-{index}", [sys.executable, str(Path(__file__).with_name("canned_upstream.py")),
                                                 str(port)])
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, proc, f"upstream {index}")
        return url

    async def gateway(self, name: str, upstream: str, *extra: str) -> str:
        port = free_port()
        proc = self._spawn(name, [sys.executable, "-m", "rlstream.cli", "--log-format", "json", "gateway", "serve",
                                  "--upstream", upstream, "--port", str(port), "-o", "gateway.served_model", MODEL,
                                  "--spool-dir", str(self.root / f"spool-{name}"), "--gateway-id", name,
                                  *extra, *self.overrides])
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, proc, name)
        return url

    def streams_worker(self) -> None:
        self._spawn("streams", [sys.executable, "-m", "rlstream.cli", "streams", "worker", "--worker-id", "bench",
                                *self.overrides, "-o", "streams.data_dir", str(self.root / "streams"),
                                "-o", "streams.app_id", "bench-streams"])

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_pid(proc.pid, timeout_s=20)


async def throughput(http: httpx.AsyncClient, url: str, n: int, concurrency: int) -> tuple[list[float], float]:
    """(latencies, seconds for all ``n``) of ``n`` non-streamed calls, ``concurrency`` at a time."""
    left = list(range(n))
    latencies: list[float] = []

    async def client() -> None:
        while left:
            left.pop()
            started = time.perf_counter()
            answer = await http.post(f"{url}/v1/chat/completions", json=BODY)
            answer.raise_for_status()
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


class TrajectoryWatch:
    """Tails ``trajectories`` (read_committed) and notes when each session's trajectory became readable."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        cfg = load_config(None, [("kafka.bootstrap_servers", bootstrap)])
        self.consumer = make_consumer(cfg.kafka, group_id=None, isolation_level="read_committed")
        self.topic, self.codec = topic, AvroCodec()
        self.seen: dict[str, float] = {}
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from aiokafka import TopicPartition

        await self.consumer.start()
        parts = self.consumer.partitions_for_topic(self.topic) or set()
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_end(*tps)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            batch = await self.consumer.getmany(timeout_ms=50)
            now = time.perf_counter()
            for records in batch.values():
                for record in records:
                    event = self.codec.decode(record.value, TrajectoryEvent)
                    session = event.metadata.get("session_id")
                    if session:
                        self.seen.setdefault(session, now)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await self.consumer.stop()


async def stitch_latency(http: httpx.AsyncClient, url: str, watch: TrajectoryWatch, sessions: int,
                         label: str) -> list[float]:
    """Seconds from each session's end (two calls, then ``/v1/sessions/{id}/end`` answered) to its trajectory on
    the topic; sessions one after another."""
    ended: dict[str, float] = {}
    for index in range(sessions):
        session = f"{label}-{uuid.uuid4().hex[:8]}-{index}"
        history = [{"role": "user", "content": "Repeat the letter c."}]
        for _ in range(2):
            answer = await http.post(f"{url}/v1/chat/completions", headers={"x-session-id": session},
                                     json={**BODY, "messages": history})
            answer.raise_for_status()
            history += [answer.json()["choices"][0]["message"], {"role": "user", "content": "Again."}]
        (await http.post(f"{url}/v1/sessions/{session}/end")).raise_for_status()
        ended[session] = time.perf_counter()
        await asyncio.sleep(0.05)
    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline and not all(s in watch.seen for s in ended):
        await asyncio.sleep(0.1)
    missing = [s for s in ended if s not in watch.seen]
    if missing:
        print(f"{label}: {len(missing)} of {sessions} trajectories not seen within 60 s")
    return [watch.seen[s] - t for s, t in ended.items() if s in watch.seen]


async def run_fleet(args: argparse.Namespace) -> None:
    from bench.balancer import RoundRobinProxy

    import tempfile

    root = Path(tempfile.mkdtemp(prefix="rlstream-bench-fleet-"))
    stack = LocalStack.start(root / "infra")
    fleet = Fleet(root, stack)
    control = None
    try:
        cfg = load_config(None, [("kafka.bootstrap_servers", stack.bootstrap), ("topics.prefix", "bench."),
                                 ("policy", MODEL)])
        await prepare_topics(cfg.model_copy(update={"streams": cfg.streams.model_copy(
            update={"app_id": "bench-streams"})}))
        upstreams = [await fleet.upstream(i) for i in range(args.upstreams)]
        control = ControlPlane(stack.redis_url)
        serving = ServingControl(control)
        for index, url in enumerate(upstreams):  # what each replica's sync worker would acknowledge
            await serving.record_replica(MODEL, ReplicaAck(f"replica-{index}", 0, MODEL, url=url,
                                                           loaded={0: MODEL}), 3600)
        fleet.streams_worker()
        single = await fleet.gateway("gateway-single", upstreams[0], "-o", "gateway.route_versions", "false")
        # no promotion gate here: the replicas' acknowledged version 0 serves without a serving pointer
        members = [await fleet.gateway(f"gateway-{i}", upstreams[0], "-o", "gateway.serve_unpromoted", "true")
                   for i in range(args.gateways)]
        in_memory = await fleet.gateway("gateway-in-memory", upstreams[0], "-o", "gateway.route_versions",
                                        "false", "-o", "gateway.session_stitching", "gateway", "-o",
                                        "gateway.session_idle_s", "600")
        proxy = RoundRobinProxy([("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in members])
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)  # each call a new connection
        async with proxy.running(), httpx.AsyncClient(timeout=60, limits=limits) as http:
            ways = {"direct (1 upstream)": upstreams[0], "1 gateway, 1 upstream": single,
                    f"{args.gateways} gateways + balancer, {args.upstreams} upstreams": proxy.url}
            cells: dict[str, tuple[list[float], float]] = {way: ([], 0.0) for way in ways}
            for url in ways.values():
                await throughput(http, url, 16, 4)  # warm-up
            for _ in range(args.rounds):
                for way, url in ways.items():
                    latencies, took = await throughput(http, url, args.requests // args.rounds, 16)
                    cells[way] = (cells[way][0] + latencies, cells[way][1] + took)
            spread = dict(zip(members, proxy.connections))
            watch = TrajectoryWatch(stack.bootstrap, TopicNames(prefix="bench.").trajectories)
            await watch.start()
            try:
                await stitch_latency(http, single, watch, 5, "warm")  # the worker's first transactions
                streams_s = await stitch_latency(http, single, watch, args.sessions, "streams")
                memory_s = await stitch_latency(http, in_memory, watch, args.sessions, "in-gateway")
            finally:
                await watch.stop()
    finally:
        if control is not None:
            await control.close()
        fleet.stop()
        stack.stop()
    print(f"\nfleet: {args.requests} non-streamed calls per way at 16 clients, canned upstreams, ms")
    print(f"{'way':<44}{'calls/s':>9}{'p50':>8}{'p99':>8}")
    for way, (latencies, took) in cells.items():
        print(f"{way:<44}{len(latencies) / took:>9.0f}{1000 * pct(latencies, 0.5):>8.1f}"
              f"{1000 * pct(latencies, 0.99):>8.1f}")
    print(f"connections per fleet gateway: {list(spread.values())}")
    print(f"\nsession end -> trajectory readable on trajectories (read_committed), {args.sessions} sessions, ms")
    for label, values in (("stitched in the stream app (calls topic)", streams_s),
                          ("stitched in the gateway's memory", memory_s)):
        print(f"{label:<44}p50 {1000 * pct(values, 0.5):>7.1f}  p99 {1000 * pct(values, 0.99):>7.1f}  "
              f"(n={len(values)})")
