"""Slow clients against the gateway served by uvicorn (real sockets): a request trickled a byte at a time, in its
body or in its headers, is cut off within the read timeout, and the gateway keeps serving. The control with a long
timeout shows the same clients holding their connections."""
from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from rlstream.gateway.app import Gateway
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.server import serving
from tests.unit.test_gateway_sessions import USER, FakePublisher, fake_upstream

BODY_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100000\r\n\r\n{")
HEADER_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"


class Trickler:
    """One connection that sends ``head`` and then a few bytes every ``period_s`` until the server closes it."""

    def __init__(self, head: bytes, drip: bytes) -> None:
        self.head, self.drip = head, drip
        self.answer = b""
        self.closed_after: float | None = None

    async def run(self, host: str, port: int, period_s: float, give_up_s: float) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        started = time.monotonic()
        writer.write(self.head)

        async def drip() -> None:
            while True:
                await asyncio.sleep(period_s)
                writer.write(self.drip)
                await writer.drain()

        dripping = asyncio.create_task(drip())
        try:
            while True:
                chunk = await asyncio.wait_for(reader.read(65536), give_up_s - (time.monotonic() - started))
                if not chunk:
                    self.closed_after = time.monotonic() - started
                    return
                self.answer += chunk
        except ConnectionError:  # the server closed it while we were writing
            self.closed_after = time.monotonic() - started
        except asyncio.TimeoutError:  # still open when the test gave up
            pass
        finally:
            dripping.cancel()
            await asyncio.gather(dripping, return_exceptions=True)
            writer.close()


@pytest.mark.parametrize("timeout_s,clients", [(1.0, 100), (30.0, 10)], ids=["bounded", "long-timeout-control"])
async def test_slow_clients_are_cut_off_within_the_read_timeout(timeout_s: float, clients: int) -> None:
    config = GatewaySettings(session_stitching="gateway",
                             port=0, body_read_timeout_s=timeout_s, header_read_timeout_s=timeout_s)
    gateway = Gateway(config, FakePublisher(), client=httpx.AsyncClient(transport=httpx.MockTransport(fake_upstream)))
    give_up_s = 4.0
    async with serving(gateway) as url:
        host, port = url.removeprefix("http://").split(":")
        bodies = [Trickler(BODY_HEAD, b" ") for _ in range(clients)]
        headers = [Trickler(HEADER_HEAD, b"X-Drip: a\r\n") for _ in range(clients)]
        runs = [t.run(host, int(port), 0.2, give_up_s) for t in bodies + headers]
        await asyncio.gather(*runs)
        async with httpx.AsyncClient(timeout=10) as http:  # the gateway still serves
            r = await http.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [USER]})
            assert r.status_code == 200
    if timeout_s >= give_up_s:  # the control: every slow client still holds its connection
        assert all(t.closed_after is None for t in bodies + headers)
        return
    slack = 1.5  # the 2-core machine's scheduling
    assert all(t.closed_after is not None and t.closed_after < timeout_s + slack for t in bodies + headers), \
        sorted((t.closed_after or give_up_s) for t in bodies + headers)[-5:]
    assert all(t.answer.startswith(b"HTTP/1.1 408") for t in bodies), bodies[0].answer[:200]
    assert all(t.answer == b"" for t in headers)  # closed before any request existed
    assert gateway.limit_stats.rejected["body_timeout"] == clients


async def test_oversized_headers_are_refused_at_the_connection() -> None:
    """An 8 MB session-id header: the connection is answered 400 and closed after about max_header_bytes, long
    before the header timeout (uvicorn's httptools protocol alone buffers the whole line until it ends)."""
    config = GatewaySettings(session_stitching="gateway", port=0, header_read_timeout_s=30)
    gateway = Gateway(config, FakePublisher(), client=httpx.AsyncClient(transport=httpx.MockTransport(fake_upstream)))
    async with serving(gateway) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        started = time.monotonic()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Session-Id: ")
        sent, answer, reset = 0, b"", False
        try:
            while sent < 8 << 20:
                writer.write(b"s" * 65536)
                await writer.drain()
                sent += 65536
            answer = await asyncio.wait_for(reader.read(), 10)
        except ConnectionError:  # closed while we were still writing: the 400 may be lost to the reset
            reset = True
            with contextlib.suppress(ConnectionError):
                answer = await asyncio.wait_for(reader.read(), 5)
        elapsed = time.monotonic() - started
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400") or (reset and not answer), answer[:200]
        assert elapsed < 10, f"cut off after {elapsed:.1f} s: by the timeout, not the size"
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [USER]})
            assert r.status_code == 200
    assert gateway.sessions.open == {}
