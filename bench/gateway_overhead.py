"""Capture gateway overhead: the same chat completions sent straight to vLLM and through `rlstream gateway`
(capturing to the embedded broker), in one run, at 1 and 16 concurrent clients. Prints the latency p50/p99 of
non-streamed calls and the time to first token of streamed ones, both ways, and what the gateway adds.

    .venv/bin/python bench/gateway_overhead.py --requests 200 [--in-process] [--upstream canned] [--separate-core]
                                               [--no-logprobs] [--keys]
    .venv/bin/python bench/gateway_overhead.py --throughput [--requests 3000] [--rate 500] [--compare-tree DIR]
    .venv/bin/python bench/gateway_overhead.py --endpoints [--keys] --requests 200

`--throughput` (bench/gateway_throughput.py) measures one gateway process with keys and capture on in front of the
canned upstream, its clients in processes of their own: calls/s and p50/p99 at 1, 16 and 64 concurrent clients,
straight and through the gateway in the same run, the p99 added at 16 clients offering --rate calls/s, and the
gateway's CPU per call; it ends with one JSON line of those figures.

`--endpoints` times each endpoint (chat, completions, responses, messages; streamed and not) at 1 and 10 concurrent
requests, in process against bench/canned_upstream.py's app, and prints the added latency p50/p99 of each.

The baseline (straight to vLLM) and the gateway runs alternate in rounds, so that a slow moment of the shared
machine hits both. vLLM runs the tiny local model on the CPU (tests/e2e/vllm_support.py's server). The gateway runs
as deployed, its own process (`rlstream gateway serve`); `--in-process` serves it on the benchmark's own event loop
instead, where the load generator's work is added to the gateway's.

On two cores everything competes: vLLM's CPU engine binds its threads to every core, so the gateway's work slows
vLLM and the other way round. `--separate-core` gives vLLM the last core alone (as on its own device) and the
broker, the gateway and the clients the others; `--upstream canned` replaces vLLM with bench/canned_upstream.py,
which answers at once, so what is left is the gateway's own work. `--no-logprobs` runs the gateway asking vLLM for
token ids only (`-o gateway.request_logprobs false`), which saves vLLM's logprobs work. `--keys` adds a second
gateway that authenticates its clients (a keys file: tenant, allowed models and tasks), alternating with the first in
the same rounds, and prints what the key check adds; every captured response carries a signed feedback token either
way, and the cost of issuing one (and of checking a key) is timed on its own too.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from rlstream.ops.children import spawn  # noqa: E402
from rlstream.ops.infra import LocalStack  # noqa: E402
from rlstream.ops.ports import free_port  # noqa: E402
from rlstream.ops.processes import stop_pid  # noqa: E402
from rlstream.ops.toy import build_tiny_model  # noqa: E402
from rlstream.ops.vllm import start_vllm_server  # noqa: E402
from rlstream.gateway.app import Gateway, create_app  # noqa: E402
from rlstream.gateway.auth import AccessConfig, KeyStore  # noqa: E402
from rlstream.gateway.feedback_tokens import FeedbackSigner  # noqa: E402
from rlstream.gateway.config import GatewaySettings  # noqa: E402
from rlstream.gateway.filtering import upstream_request  # noqa: E402
from rlstream.gateway.server import serving  # noqa: E402
from rlstream.rollout.publisher import TrajectoryPublisher  # noqa: E402
from rlstream.schemas.config import load_config  # noqa: E402
from rlstream.schemas.topics import TopicNames  # noqa: E402
from rlstream.transport.kafka import create_topics  # noqa: E402

MODEL = "toy"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Repeat the letter c."}], "max_tokens": 8,
        "temperature": 1.0}
BENCH_KEY = "bench-client-key-" + "0" * 32
KEY_HEADERS = {"authorization": f"Bearer {BENCH_KEY}"}
KEYS_FILE = {"keys": [{"key": BENCH_KEY, "name": "bench", "tenant": "bench", "models": [MODEL],
                       "tasks": ["bench"]}]}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def timed_call(http: httpx.AsyncClient, base: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    r = await http.post(f"{base}/v1/chat/completions", json=body, headers=headers)
    r.raise_for_status()
    return time.perf_counter() - started


async def time_to_first_token(http: httpx.AsyncClient, base: str, body: dict[str, Any],
                              headers: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    first: float | None = None
    async with http.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True},
                           headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():  # read to the end: the call is complete for both ways
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("stream without content")
    return first


async def load(http: httpx.AsyncClient, base: str, body: dict[str, Any], n: int, concurrency: int,
               call: Callable[..., Awaitable[float]], headers: dict[str, str] | None = None) -> list[float]:
    queue = list(range(n))
    out: list[float] = []

    async def worker() -> None:
        while queue:
            queue.pop()
            out.append(await call(http, base, body, headers))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def measure(direct: str, gateway: str, args: argparse.Namespace, keyed: str | None = None
                  ) -> dict[tuple[str, int], dict[str, list[float]]]:
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    n, rounds = args.requests, args.rounds
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    # What the gateway sends upstream for BODY (asking for token ids, and logprobs unless --no-logprobs), sent
    # straight to vLLM as a second baseline: it tells vLLM's own work for that data from the gateway's hop.
    token_data_body = upstream_request(BODY, request_logprobs=not args.no_logprobs)
    ways: list[tuple[str, str, dict[str, Any], dict[str, str] | None]] = [
        ("direct", direct, BODY, None), ("direct+token data", direct, token_data_body, None),
        ("gateway", gateway, BODY, None)]
    if keyed is not None:
        ways.append(("gateway+keys", keyed, BODY, KEY_HEADERS))
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        for _, base, body, headers in ways:  # warm-up
            await load(http, base, body, 8, 4, timed_call, headers)
        for kind, call in (("latency", timed_call), ("ttft", time_to_first_token)):
            for concurrency in (1, 16):
                slot = results.setdefault((kind, concurrency), {way: [] for way, _, _, _ in ways})
                for _ in range(rounds):
                    for way, base, body, headers in ways:
                        slot[way] += await load(http, base, body, n // rounds, concurrency, call, headers)
    return results


async def measure_gateway_process(upstream: str, bootstrap: str, root: Path, args: argparse.Namespace
                                  ) -> tuple[dict[tuple[str, int], dict[str, list[float]]], Any]:
    """The gateway as deployed: ``rlstream gateway serve`` in its own process, capturing to the embedded broker
    (with ``--keys``, a second one that authenticates its clients)."""
    procs = []

    def start(name: str, extra: list[str]) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "rlstream.cli", "--log-format", "json", "gateway", "serve", "--upstream",
               upstream, "--port", str(port), "-o", "gateway.served_model", MODEL, "-o", "gateway.route_versions",
               "false", "--spool-dir", str(root / f"spool-{name}"), "-o", "kafka.bootstrap_servers", bootstrap, "-o",
               "topics.prefix",
               "bench.", "-o", "policy", MODEL, "-o", "gateway.request_logprobs", str(not args.no_logprobs).lower(),
               *extra]
        with open(root / f"{name}.log", "ab") as log:
            procs.append(spawn(cmd, stdout=log, stderr=subprocess.STDOUT))
        return f"http://127.0.0.1:{port}"

    url = start("gateway", [])
    keyed = None
    if args.keys:
        keys_file = root / "keys.json"
        keys_file.write_text(json.dumps(KEYS_FILE))
        keys_file.chmod(0o600)
        keyed = start("gateway-keys", ["--api-keys-file", str(keys_file)])
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            for base, proc in zip([u for u in (url, keyed) if u], procs):
                for _ in range(300):
                    if proc.poll() is not None:
                        raise RuntimeError(f"a gateway exited: see the logs in {root}")
                    try:
                        if (await http.get(f"{base}/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.1)
            results = await measure(upstream, url, args, keyed)
            for _ in range(100):  # the last calls' events may still be on their way to the broker
                stats = (await http.get(f"{url}/rlstream/stats")).json()["capture"]
                if stats["acknowledged"] >= stats["queued"]:
                    break
                await asyncio.sleep(0.1)
        return results, stats
    finally:
        for proc in procs:
            stop_pid(proc.pid, timeout_s=20)


class CannedUpstream:
    """bench/canned_upstream.py in its own process (``url``, ``stop``, as a started vLLM server)."""

    def __init__(self, root: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        with open(root / "canned-upstream.log", "ab") as log:
            self.proc = spawn([sys.executable, str(Path(__file__).with_name("canned_upstream.py")), str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
        for _ in range(300):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the canned upstream exited: see {root / 'canned-upstream.log'}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the canned upstream did not start")

    def stop(self) -> None:
        stop_pid(self.proc.pid, timeout_s=10)


def separate_vllm_core() -> set[int]:
    """Give vLLM the last core of this process's set and keep the others for everything else, as when vLLM runs on
    its own device: vLLM's CPU engine otherwise binds its OpenMP threads to every core, where the gateway's work
    slows vLLM's and the other way round. Call before starting vLLM (it inherits the affinity set here); returns
    the cores to set afterwards for the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--separate-core needs at least 2 cores")
    vllm_core = cores[-1]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(vllm_core)
    os.sched_setaffinity(0, {vllm_core})
    return set(cores[:-1])


async def main_async(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="rlstream-bench-gw-"))
    if args.upstream == "canned":
        server: Any = CannedUpstream(root)
    else:
        model_dir = build_tiny_model(root / "tiny")
        everything_else = separate_vllm_core() if args.separate_core else None
        server = start_vllm_server(model_dir, MODEL, workdir=root / "vllm")
        if everything_else is not None:
            os.sched_setaffinity(0, everything_else)  # the broker, the gateway and the load generator inherit it
    stack = LocalStack.start(root / "infra")
    try:
        cfg = load_config(None, [("kafka.bootstrap_servers", stack.bootstrap), ("topics.prefix", "bench.")])
        await create_topics(cfg.kafka, cfg.topics)
        names = TopicNames.from_config(cfg.topics)
        if args.in_process:
            publisher = TrajectoryPublisher.from_config(cfg.kafka, names.trajectories, names.rewards)
            await publisher.start()
            settings = GatewaySettings(session_stitching="gateway",
                                       port=0, upstream_url=server.url, served_model=MODEL, policy=MODEL,
                                     request_logprobs=not args.no_logprobs)
            gateway = Gateway(settings, publisher)
            async with contextlib.AsyncExitStack() as servers:
                gateway_url = await servers.enter_async_context(serving(gateway))
                keyed_url = None
                if args.keys:
                    keys_file = root / "keys.json"
                    keys_file.write_text(json.dumps(KEYS_FILE))
                    keys_file.chmod(0o600)
                    keyed_url = await servers.enter_async_context(serving(Gateway(
                        settings, publisher, access=AccessConfig(api_keys_file=keys_file))))
                results = await measure(server.url, gateway_url, args, keyed_url)
                stats: Any = vars(gateway.capture.stats)
            await publisher.close()
        else:
            results, stats = await measure_gateway_process(server.url, stack.bootstrap, root, args)
    finally:
        server.stop()
        stack.stop()
    upstream = "canned upstream (bench/canned_upstream.py)" if args.upstream == "canned" else "tiny model on vLLM-cpu"
    placement = ", vLLM on its own core" if args.separate_core and args.upstream == "vllm" else ""
    asked = "token ids only" if args.no_logprobs else "token ids and logprobs"
    print(f"\n{args.requests} requests per cell, {upstream}{placement}, broker embedded, the gateway asks for "
          f"{asked}; ms")
    print("added = gateway - direct; of it, 'vLLM token data' = direct with the gateway's token-data options - "
          "direct (vLLM's own work), 'hop' = the rest")
    print(f"{'measure':<22}{'clients':>8}{'direct p50':>12}{'gw p50':>9}{'added':>8}{'tokdata':>9}{'hop':>7}"
          f"{'direct p99':>12}{'gw p99':>9}{'added':>8}{'gw/direct p50':>15}")
    for (kind, concurrency), cell in results.items():
        d, t, g = cell["direct"], cell["direct+token data"], cell["gateway"]
        d50, t50, g50, d99, g99 = (1000 * x for x in (pct(d, 0.5), pct(t, 0.5), pct(g, 0.5), pct(d, 0.99),
                                                      pct(g, 0.99)))
        name = "latency (non-streamed)" if kind == "latency" else "time to first token"
        print(f"{name:<22}{concurrency:>8}{d50:>12.1f}{g50:>9.1f}{g50 - d50:>8.1f}{t50 - d50:>9.1f}{g50 - t50:>7.1f}"
              f"{d99:>12.1f}{g99:>9.1f}{g99 - d99:>8.1f}{g50 / d50:>15.2f}")
    if args.keys:
        print(f"keys on - keys off (gateway+keys - gateway), ms: {'measure':<22}{'clients':>8}{'p50':>8}{'p99':>8}")
        for (kind, concurrency), cell in results.items():
            g, k = cell["gateway"], cell["gateway+keys"]
            name = "latency (non-streamed)" if kind == "latency" else "time to first token"
            print(f"{'':<40}{name:<22}{concurrency:>8}{1000 * (pct(k, 0.5) - pct(g, 0.5)):>8.2f}"
                  f"{1000 * (pct(k, 0.99) - pct(g, 0.99)):>8.2f}")
        print(f"alone, per call: {auth_costs_us()}")
        print(await keys_ab_in_process(args.requests))
    print(f"capture: {stats}")
    print(f"(mean direct latency at 1 client: {1000 * statistics.mean(results[('latency', 1)]['direct']):.1f} ms)")


class _Discard:
    """A publisher that takes every event at once (the in-process A/B measures the gateway's work, not Kafka's)."""

    trajectories_topic, rewards_topic = "trajectories", "rewards"

    async def submit(self, topic: str, key: str, event: Any) -> "asyncio.Future[Any]":
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def keys_ab_in_process(requests: int) -> str:
    """The same non-streamed call to an open gateway and to a keyed one, alternating call by call, each app driven
    in process (httpx.ASGITransport) in front of bench/canned_upstream.py's app: the p50 of each and their
    difference, with the sockets, the broker and the load generator's scheduling out of the picture."""
    from canned_upstream import app as canned_app

    def gateway(access: AccessConfig | None) -> Gateway:
        upstream = httpx.AsyncClient(transport=httpx.ASGITransport(canned_app), base_url="http://upstream")
        return Gateway(GatewaySettings(session_stitching="gateway",
                                       served_model=MODEL, policy=MODEL), _Discard(), client=upstream, access=access)

    keys_file = Path(tempfile.mkdtemp(prefix="rlstream-bench-keys-")) / "keys.json"
    keys_file.write_text(json.dumps(KEYS_FILE))
    keys_file.chmod(0o600)
    ways = {"open": (gateway(None), None), "keys": (gateway(AccessConfig(api_keys_file=keys_file)), KEY_HEADERS)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    clients = {}
    for name, (gw, _) in ways.items():
        await gw.start()
        clients[name] = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gw)), base_url="http://gw")
    try:
        for index in range(requests + 50):
            for name, (_, headers) in (ways.items() if index % 2 else reversed(ways.items())):
                started = time.perf_counter()
                r = await clients[name].post("/v1/chat/completions", json=BODY, headers=headers)
                elapsed = time.perf_counter() - started
                r.raise_for_status()
                if index >= 50:  # after a warm-up
                    times[name].append(elapsed)
    finally:
        for name, (gw, _) in ways.items():
            await clients[name].aclose()
            await gw.stop()
    p_open, p_keys = pct(times["open"], 0.5) * 1000, pct(times["keys"], 0.5) * 1000
    return (f"in process, {requests} alternating calls each: p50 open {p_open:.3f} ms, keys {p_keys:.3f} ms, "
            f"keys - open {p_keys - p_open:+.3f} ms")


#: one call of each endpoint the gateway serves (path, body), as an agent sends it
ENDPOINT_CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", BODY),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "Repeat the letter c.", "max_tokens": 8,
                                        "temperature": 1.0}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "Repeat the letter c.", "max_output_tokens": 8,
                                    "temperature": 1.0}),
    "messages": ("/v1/messages", {"model": MODEL, "max_tokens": 8, "temperature": 1.0,
                                  "messages": [{"role": "user", "content": "Repeat the letter c."}]}),
}


async def endpoints_in_process(requests: int, keys: bool) -> str:
    """The added latency of each endpoint (chat, completions, responses, messages; non-streamed and streamed, read
    to the end) at 1 and 10 concurrent requests: the same call straight to bench/canned_upstream.py's app and
    through a gateway in front of it (with ``keys``, one that authenticates its clients), alternating round by
    round, each app driven in process (httpx.ASGITransport): p50 and p99 of gateway - direct, in ms."""
    from canned_upstream import app as canned_app

    access = None
    headers = None
    if keys:
        keys_file = Path(tempfile.mkdtemp(prefix="rlstream-bench-keys-")) / "keys.json"
        keys_file.write_text(json.dumps(KEYS_FILE))
        keys_file.chmod(0o600)
        access, headers = AccessConfig(api_keys_file=keys_file), KEY_HEADERS
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(canned_app), base_url="http://upstream")
    gw = Gateway(GatewaySettings(session_stitching="gateway", served_model=MODEL, policy=MODEL), _Discard(),
                 client=upstream, access=access)
    await gw.start()
    direct = httpx.AsyncClient(transport=httpx.ASGITransport(canned_app), base_url="http://upstream")
    through = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gw)), base_url="http://gw")

    async def call(client: httpx.AsyncClient, path: str, body: dict[str, Any], sent: dict[str, str] | None) -> float:
        started = time.perf_counter()
        r = await client.post(path, json=body, headers=sent)
        r.raise_for_status()
        await r.aread()
        return time.perf_counter() - started

    rows = [f"in process, keys {'on' if keys else 'off'}, {requests} calls per cell; added = gateway - direct, ms",
            f"{'endpoint':<13}{'streamed':>9}{'clients':>8}{'direct p50':>11}{'added p50':>10}{'added p99':>10}"]
    try:
        for name, (path, body) in ENDPOINT_CALLS.items():
            for stream in (False, True):
                sent = {**body, "stream": stream}
                for concurrency in (1, 10):
                    times: dict[str, list[float]] = {"direct": [], "gateway": []}
                    for index in range(max(1, requests // concurrency) + 5):
                        for way, client, h in (("direct", direct, None), ("gateway", through, headers)):
                            got = await asyncio.gather(*(call(client, path, sent, h) for _ in range(concurrency)))
                            if index >= 5:  # after a warm-up
                                times[way] += got
                    d, g = times["direct"], times["gateway"]
                    rows.append(f"{name:<13}{str(stream).lower():>9}{concurrency:>8}{1000 * pct(d, 0.5):>11.3f}"
                                f"{1000 * (pct(g, 0.5) - pct(d, 0.5)):>10.3f}"
                                f"{1000 * (pct(g, 0.99) - pct(d, 0.99)):>10.3f}")
    finally:
        await direct.aclose()
        await through.aclose()
        await gw.stop()
    return "\n".join(rows)


def auth_costs_us(calls: int = 20_000) -> str:
    """What checking a key and issuing a feedback token cost on their own (µs per call, this machine)."""
    keys = KeyStore([BENCH_KEY])
    signer = FeedbackSigner(b"s" * 32, ttl_s=86_400)
    started = time.perf_counter()
    for _ in range(calls):
        keys.authenticate(BENCH_KEY)
    check = (time.perf_counter() - started) / calls * 1e6
    started = time.perf_counter()
    for index in range(calls):
        signer.issue("bench", "trajectory", f"{index:032x}")
    issue = (time.perf_counter() - started) / calls * 1e6
    token = signer.issue("bench", "trajectory", "0" * 32)
    started = time.perf_counter()
    for _ in range(calls):
        signer.verify(token)
    verify = (time.perf_counter() - started) / calls * 1e6
    return f"key check {check:.1f} us, feedback token issue {issue:.1f} us, verify {verify:.1f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="requests per cell (way x clients x measure)")
    parser.add_argument("--rounds", type=int, default=4, help="alternations of direct and gateway per cell")
    parser.add_argument("--in-process", action="store_true", help="serve the gateway on the benchmark's own loop")
    parser.add_argument("--upstream", choices=("vllm", "canned"), default="vllm",
                        help="vllm: the tiny model on vLLM-cpu; canned: bench/canned_upstream.py, which answers at "
                             "once (the gateway's own work, without vLLM's time or CPU)")
    parser.add_argument("--separate-core", action="store_true",
                        help="vLLM alone on the last core, the broker, the gateway and the clients on the others")
    parser.add_argument("--no-logprobs", action="store_true",
                        help="the gateway asks the upstream for token ids only (-o gateway.request_logprobs false)")
    parser.add_argument("--keys", action="store_true",
                        help="also a gateway that authenticates its clients with an API key, in the same rounds")
    parser.add_argument("--gateways", type=int, default=0,
                        help="with --upstreams: the fleet run of bench/gateway_fleet.py (N gateways behind a "
                             "round-robin balancer over M canned upstreams, against one gateway; and the time from a "
                             "session's end to its trajectory with stitching in the stream app and in the gateway)")
    parser.add_argument("--upstreams", type=int, default=1, help="canned upstreams of the fleet run")
    parser.add_argument("--sessions", type=int, default=50, help="sessions timed end -> trajectory (fleet run)")
    parser.add_argument("--endpoints", action="store_true",
                        help="only the added latency per endpoint (chat, completions, responses, messages), in "
                             "process in front of the canned upstream (with --keys: a gateway that checks keys)")
    parser.add_argument("--throughput", action="store_true",
                        help="calls/s at 1, 16 and 64 clients and the p99 added at --rate (bench/gateway_throughput.py)")
    parser.add_argument("--rate", type=float, default=500.0, help="calls/s offered by 16 clients (--throughput)")
    parser.add_argument("--compare-tree", default=None,
                        help="--throughput: also a gateway from this source tree (another revision), same rounds")
    parser.add_argument("--keys-in-process-only", action="store_true",
                        help="only the in-process A/B of an open and a keyed gateway (no broker, no processes)")
    args = parser.parse_args()
    if args.throughput:
        from gateway_throughput import run_throughput

        run_throughput(args)
        return
    if args.gateways:
        from gateway_fleet import run_fleet

        asyncio.run(run_fleet(args))
        return
    if args.endpoints:
        print(asyncio.run(endpoints_in_process(args.requests, args.keys)))
        return
    if args.keys_in_process_only:
        print(asyncio.run(keys_ab_in_process(args.requests)))
        print(f"alone, per call: {auth_costs_us()}")
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
