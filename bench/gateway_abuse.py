"""Keyed chat latency while the feedback paths are attacked without a credential: the p99 of authenticated chat
completions idle, then while 1,000 half-sent unauthenticated bodies and a stream of 16 MiB nested-array bodies hit
the feedback paths (the idle p99 is of the calls before and after the attack, which alternate with it on a shared
machine). Prints one JSON line: both p99s, their ratio, the chats' error counts (503, other 5xx, other),
what the attackers got, and what /ready and /health answered during the attack. Goal: ratio <= 2, no 5xx.

    .venv/bin/python bench/gateway_abuse.py [--requests 300] [--half-sent 1000] [--attack-s 20]

The gateway runs as deployed (uvicorn with its guarded httptools protocol), in its own process, with a keys file,
in front of bench/canned_upstream.py (answers at once); its captures go to a publisher that discards them (no
broker: the attack is on the HTTP door, not on Kafka). The attackers and the keyed clients share this process.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from gateway_overhead import BODY, KEY_HEADERS, KEYS_FILE, MODEL, CannedUpstream, pct  # noqa: E402
from rlstream.ops.children import spawn  # noqa: E402
from rlstream.ops.ports import free_port  # noqa: E402
from rlstream.ops.processes import stop_pid  # noqa: E402

FEEDBACK_PATHS = ("/v1/feedback", "/api/public/scores", "/feedback", "/v1/logs")
NESTED_BYTES = 16 << 20


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def serve_gateway(port: int, upstream: str, keys_file: str) -> None:
    """The gateway process: the real app and HTTP stack, captures discarded."""
    from pydantic import SecretStr

    from rlstream.gateway.app import Gateway
    from rlstream.gateway.auth import AccessConfig
    from rlstream.gateway.config import GatewaySettings
    from rlstream.gateway.server import serving

    class Discard:
        trajectories_topic, rewards_topic = "t", "r"

        async def submit(self, topic: str, key: str, event: Any) -> "asyncio.Future[Any]":
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

    settings = GatewaySettings(port=port, upstreams=[upstream], upstream_url=upstream, session_stitching="gateway",
                               served_model=MODEL, policy=MODEL, route_versions=False)
    gateway = Gateway(settings, Discard(), access=AccessConfig(api_keys_file=Path(keys_file),
                                                               feedback_secret=SecretStr("s" * 32)))
    async with serving(gateway):
        await asyncio.Event().wait()


async def half_sent(host: str, port: int, path: str, held: list[asyncio.StreamWriter], got: Counter[str]) -> None:
    """One unauthenticated feedback request whose body never finishes: held open, its answer counted."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        got[f"connect_{type(exc).__name__}"] += 1
        return
    held.append(writer)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: 4096\r\n"
                     "\r\n".encode() + b'{"reward": 1, "trajectory_id": "')
        await writer.drain()
        line = await reader.readline()
        got[line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "closed"] += 1
    except (OSError, IndexError) as exc:
        got[type(exc).__name__] += 1


async def nested_stream(host: str, port: int, stop: asyncio.Event, got: Counter[str]) -> None:
    """16 MiB bodies of nested empty arrays, one after the other, to the feedback paths without a credential."""
    body = b"[" * (NESTED_BYTES // 2) + b"]" * (NESTED_BYTES // 2)
    index = 0
    while not stop.is_set():
        path = FEEDBACK_PATHS[index % len(FEEDBACK_PATHS)]
        index += 1
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            got[f"connect_{type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)
            continue
        try:
            writer.write(f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode())
            await writer.drain()
            try:  # a gateway that answers from the headers does so before the body is sent
                line = await asyncio.wait_for(reader.readline(), 1.0)
            except asyncio.TimeoutError:
                writer.write(body)
                with contextlib.suppress(OSError):
                    await asyncio.wait_for(writer.drain(), 5)
                line = await asyncio.wait_for(reader.readline(), 30)
            got[line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "closed"] += 1
        except (OSError, asyncio.TimeoutError, IndexError) as exc:
            got[type(exc).__name__] += 1
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def keyed_chats(http: httpx.AsyncClient, base: str, n: int, concurrency: int,
                      errors: Counter[str]) -> list[float]:
    latencies: list[float] = []
    left = iter(range(n))

    async def worker() -> None:
        for _ in left:
            started = time.perf_counter()
            try:
                r = await http.post(base + "/v1/chat/completions", json=BODY, headers=KEY_HEADERS)
            except httpx.HTTPError as exc:
                errors[type(exc).__name__] += 1
                continue
            latencies.append(time.perf_counter() - started)
            if r.status_code == 503:
                errors["503"] += 1
            elif r.status_code >= 500:
                errors["5xx"] += 1
            elif r.status_code != 200:
                errors[str(r.status_code)] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def probe(http: httpx.AsyncClient, base: str, path: str, stop: asyncio.Event, got: Counter[str]) -> None:
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            got[str((await http.get(base + path)).status_code)] += 1
        await asyncio.sleep(0.25)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="rlstream-bench-abuse-"))
    keys_file = root / "keys.json"
    keys_file.write_text(json.dumps(KEYS_FILE))
    keys_file.chmod(0o600)
    upstream = CannedUpstream(root)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(root / "gateway.log", "ab") as log:
        gateway = spawn([sys.executable, __file__, "--serve-gateway", str(port), upstream.url, str(keys_file)],
                        stdout=log, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=args.concurrency)) as http:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(base + "/health")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"the gateway did not start: see {root / 'gateway.log'}")
            await keyed_chats(http, base, 50, args.concurrency, Counter())  # warm-up
            idle_errors: Counter[str] = Counter()
            idle = await keyed_chats(http, base, args.requests, args.concurrency, idle_errors)

            stop = asyncio.Event()
            held: list[asyncio.StreamWriter] = []
            half: Counter[str] = Counter()
            nested: Counter[str] = Counter()
            ready: Counter[str] = Counter()
            health: Counter[str] = Counter()
            async with httpx.AsyncClient(timeout=10) as probes:
                background = [asyncio.create_task(nested_stream("127.0.0.1", port, stop, nested)),
                              asyncio.create_task(probe(probes, base, "/ready", stop, ready)),
                              asyncio.create_task(probe(probes, base, "/health", stop, health))]
                openers = [asyncio.create_task(half_sent("127.0.0.1", port, FEEDBACK_PATHS[i % 4], held, half))
                           for i in range(args.half_sent)]
                await asyncio.sleep(2.0)  # the half-sent bodies are open before the keyed clients start
                attack_errors: Counter[str] = Counter()
                attacked: list[float] = []
                deadline = time.monotonic() + args.attack_s
                while time.monotonic() < deadline or len(attacked) < args.requests:
                    attacked += await keyed_chats(http, base, args.requests, args.concurrency, attack_errors)
                stop.set()
                for writer in held:
                    writer.close()
                for task in openers:
                    task.cancel()
                await asyncio.gather(*background, *openers, return_exceptions=True)
            await asyncio.sleep(2.0)
            idle += await keyed_chats(http, base, args.requests, args.concurrency, idle_errors)  # idle again
    finally:
        stop_pid(gateway.pid, timeout_s=10)
        upstream.stop()
    idle_p99, attack_p99 = pct(idle, 0.99) * 1000, pct(attacked, 0.99) * 1000
    chat_5xx = attack_errors["503"] + attack_errors["5xx"] + idle_errors["503"] + idle_errors["5xx"]
    return {"bench": "gateway_abuse", "idle_p99_ms": round(idle_p99, 2), "attack_p99_ms": round(attack_p99, 2),
            "ratio": round(attack_p99 / idle_p99, 2), "chat_requests": {"idle": len(idle), "attack": len(attacked)},
            "chat_errors": {"idle": dict(idle_errors), "attack": dict(attack_errors)}, "chat_5xx": chat_5xx,
            "half_sent": dict(half), "nested_16mib": dict(nested), "ready": dict(ready), "health": dict(health),
            "concurrency": args.concurrency, "loadavg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="keyed chat completions per phase")
    parser.add_argument("--concurrency", type=int, default=4, help="keyed clients at once")
    parser.add_argument("--half-sent", type=int, default=1000, help="half-sent unauthenticated bodies held open")
    parser.add_argument("--attack-s", type=float, default=20.0, help="shortest attack phase")
    parser.add_argument("--serve-gateway", nargs=3, metavar=("PORT", "UPSTREAM", "KEYS_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    raise_fd_limit()
    if args.serve_gateway:
        from rlstream.gateway.server import run

        port, upstream, keys_file = args.serve_gateway
        run(serve_gateway(int(port), upstream, keys_file))
        return
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
