"""The gateway's bounds: each is answered with its 4xx (never a 500), in-process against a canned upstream."""
from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
from structlog.testing import capture_logs

from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.limits import nests_deeper, parse_json, RequestRejected
from rlstream.gateway.spool import Spool, SpoolRecord
from rlstream.schemas.models import TrajectoryEvent
from tests.unit.test_gateway_sessions import USER, FakePublisher, fake_upstream

CHAT = {"model": "m", "messages": [USER]}


async def gateway_client(config: GatewaySettings, upstream: Any = fake_upstream,
                         publisher: Any = None) -> tuple[Gateway, httpx.AsyncClient]:
    transport = httpx.MockTransport(upstream)
    gateway = Gateway(config, publisher or FakePublisher(), client=httpx.AsyncClient(transport=transport))
    await gateway.start()
    return gateway, httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw")


def error_of(r: httpx.Response) -> str:
    return str(r.json()["error"]["message"])


async def test_body_size_is_413_whether_declared_or_streamed() -> None:
    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway", max_body_bytes=4096))
    try:
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
        r = await c.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and "4096" in error_of(r)

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 1000
        r = await c.post("/v1/chat/completions", content=chunks())
        assert r.status_code == 413 and r.headers["connection"] == "close"
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200  # the gateway still serves
        assert gateway.limit_stats.rejected["body_too_large"] == 2
    finally:
        await c.aclose()
        await gateway.stop()


@pytest.mark.parametrize("path,headers,status", [
    ("/s/" + "a" * 300 + "/v1/chat/completions", {}, 400),            # session id too long
    ("/s/bad%01id/v1/chat/completions", {}, 400),                       # a control character in the path
    ("/s/bad%0d%0aSet-Cookie:x/v1/chat/completions", {}, 400),          # header injection
    ("/v1/chat/completions", {"X-Session-Id": "sp ace"}, 400),
    ("/v1/chat/completions", {"X-Session-Id": "é".encode("latin-1")}, 400),
    ("/v1/chat/completions", {"X-Rlstream-Task": "t" * 300}, 400),
    ("/v1/chat/completions", {"X-Filler": "y" * 70_000}, 431),          # headers over max_header_bytes
    ("/v1/chat/completions", {"Content-Length": "-5"}, 400),
])
async def test_ids_and_headers_are_bounded(path: str, headers: dict[str, Any], status: int) -> None:
    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway"))
    try:
        body = json.dumps(CHAT).encode()
        r = await c.post(path, content=body, headers=headers)
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == status
    finally:
        await c.aclose()
        await gateway.stop()
    assert gateway.sessions.open == {}


async def test_end_session_checks_the_id() -> None:
    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway"))
    try:
        assert (await c.post("/v1/sessions/x%00y/end")).status_code == 400
        assert (await c.post("/v1/sessions/fine-id/end")).status_code == 404
    finally:
        await c.aclose()
        await gateway.stop()


@pytest.mark.parametrize("body", [
    b'{"model": "m", "messages": [], "temperature": NaN}',
    b'{"model": "m", "messages": [], "temperature": Infinity}',
    b'{"model": "m", "messages": [], "temperature": -Infinity}',
    b'{"model": "m", "messages": [], "temperature": 1e400}',
    b'{"model": "m", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"model": "m", "messages": [' + b'{"a":' * 100 + b"1" + b"}" * 100 + b"]}",
    b"\xff\xfe not utf-8",
])
async def test_json_depth_and_non_finite_numbers_are_400(body: bytes) -> None:
    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway"))
    try:
        for route in ("/v1/chat/completions", "/v1/responses", "/v1/feedback"):
            r = await c.post(route, content=body)
            assert r.status_code == 400, (route, r.text)
    finally:
        await c.aclose()
        await gateway.stop()


def test_json_depth_counts_nesting() -> None:
    assert not nests_deeper(b"1", 0) and not nests_deeper(b"[]", 1) and nests_deeper(b"[]", 0)
    nested = b'{"a": [{"b": []}]}'
    assert not nests_deeper(nested, 4) and nests_deeper(nested, 3)
    assert not nests_deeper(b'["[[[", "\\\\", "\\"[[{", []]', 2)  # brackets in strings (escapes too) do not nest
    assert parse_json(b'{"a": [1, 2.5e3]}', 2) == {"a": [1, 2500.0]}
    with pytest.raises(RequestRejected):
        parse_json(b"[[[1]]]", 2)


async def test_n_is_bounded_and_one_request_cannot_flush_the_feedback_index() -> None:
    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway",
                                                      max_choices=8, remembered_trajectories=100))
    try:
        first = await c.post("/v1/chat/completions", json=CHAT)
        tid = first.headers["x-rlstream-trajectory-id"]
        for n in (110_000, 9, 0, -1, 2.5, "4", True):
            r = await c.post("/v1/chat/completions", json={**CHAT, "n": n, "stream": True})
            assert r.status_code == 400, (n, r.text)
        assert (await c.post("/v1/feedback", json={"trajectory_id": tid, "reward": 1.0})).status_code == 202
    finally:
        await c.aclose()
        await gateway.stop()


async def test_concurrency_limit_is_503_with_retry_after() -> None:
    release = asyncio.Event()

    async def slow_upstream(request: httpx.Request) -> httpx.Response:
        await release.wait()
        return fake_upstream(request)

    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway",
                                                      max_concurrent_requests=2), upstream=slow_upstream)
    try:
        held = [asyncio.create_task(c.post("/v1/chat/completions", json=CHAT)) for _ in range(2)]
        while gateway.limit_stats.in_flight < 2:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert (await c.get("/health")).status_code == 200  # probes are not counted
        release.set()
        assert [t.status_code for t in await asyncio.gather(*held)] == [200, 200]
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert gateway.limit_stats.in_flight == 0
    finally:
        await c.aclose()
        await gateway.stop()


@pytest.mark.parametrize("answer", [
    [1, 2, 3], {"choices": "nope"}, {"choices": [1]}, {"choices": [{"message": "text"}]},
    {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}] * 9},
    {"prompt_token_ids": "abc", "choices": [{"message": {"role": "assistant", "content": "ok"}, "token_ids": [1]}]},
])
async def test_malformed_upstream_answers_are_502_or_passed_without_token_data(answer: Any) -> None:
    def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway", max_choices=8), upstream=upstream)
    try:
        r = await c.post("/v1/chat/completions", json=CHAT)
        if isinstance(answer, dict) and answer.get("prompt_token_ids") == "abc":
            assert r.status_code == 200  # readable, its token data is not: captured without it
        else:
            assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error", r.text
        r = await c.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert r.status_code in (200, 502)
    finally:
        await c.aclose()
        await gateway.stop()


async def test_a_502_never_shows_the_upstreams_credentials() -> None:
    secret = "s3cret-Passw0rd"

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot reach {request.url}", request=request)

    config = GatewaySettings(session_stitching="gateway",
                             upstream_url=f"http://alice:{secret}@upstream.internal:8000", upstream_api_key="key-9f8e7d")
    with capture_logs() as logs:
        gateway, c = await gateway_client(config, upstream=down)
        try:
            for route, method in (("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
                                  ("/v1/responses", "POST")):
                r = await c.request(method, route, json=CHAT if route.endswith("completions") else
                                    {"model": "m", "input": "hi"})
                assert r.status_code == 502, r.text
                assert secret not in r.text and "alice" not in r.text and "upstream.internal" not in r.text
        finally:
            await c.aclose()
            await gateway.stop()
    logged = json.dumps(logs, default=str)
    assert "upstream unreachable" in logged and secret not in logged and "key-9f8e7d" not in logged
    assert "key-9f8e7d" not in config.model_dump_json() and secret not in config.model_dump_json()


async def test_open_sessions_are_capped_and_long_sessions_split() -> None:
    publisher = FakePublisher()
    gateway, c = await gateway_client(GatewaySettings(session_stitching="gateway",
                                                      max_open_sessions=3, max_session_turns=2, session_idle_s=600),
                                      publisher=publisher)
    try:
        for index in range(5):
            assert (await c.post(f"/s/s{index}/v1/chat/completions", json=CHAT)).status_code == 200
        assert sorted(gateway.sessions.open) == ["s2", "s3", "s4"] and gateway.sessions.evicted == 2
        await asyncio.sleep(0.05)  # the capture sender hands them on
        published = {e.metadata["session_id"] for _, e in publisher.sent if isinstance(e, TrajectoryEvent)}
        assert published == {"s0", "s1"}  # the least recently active, closed and published at once
        tids = []
        for turn in (1, 2, 3):  # s4 holds one call; each call continues the conversation; two turns per trajectory
            messages = [USER] + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}] * turn
            r = await c.post("/s/s4/v1/chat/completions", json={"model": "m", "messages": messages})
            tids.append(r.headers["x-rlstream-trajectory-id"])
        assert tids[0] != tids[1] == tids[2] and gateway.sessions.splits_long == 1 and gateway.sessions.splits == 0
        stats = (await c.get("/rlstream/stats")).json()
        assert stats["sessions_evicted"] == 2 and stats["session_splits_long"] >= 1
    finally:
        await c.aclose()
        await gateway.stop()


def test_spool_directory_0700_and_files_0600(tmp_path: Path) -> None:
    old = os.umask(0)  # permissions must not depend on the umask
    try:
        directory = tmp_path / "spool"
        directory.mkdir(mode=0o777)
        spool = Spool.open(directory, 1 << 20, 4096)
        spool.append([SpoolRecord("t", b"k", b"v" * 100)] * 50)
        spool.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = list(directory.iterdir())
    assert any(p.suffix == ".seg" for p in files)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), \
        {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}


async def test_bounds_are_counted_in_prometheus() -> None:
    from rlstream.transport.metrics import MetricsPublisher, stop_prometheus

    metrics = MetricsPublisher(None, None, "metrics", source="gateway", run_id="r",  # type: ignore[arg-type]
                               prometheus_port=0)  # the gateway's figures go to Prometheus only
    assert metrics.prometheus is not None
    gateway = Gateway(GatewaySettings(session_stitching="gateway",
                                      max_open_sessions=1, session_idle_s=0.2), FakePublisher(),
                      client=httpx.AsyncClient(transport=httpx.MockTransport(fake_upstream)), metrics=metrics)
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            for index in range(3):
                await c.post(f"/s/m{index}/v1/chat/completions", json=CHAT)
            assert (await c.post("/v1/chat/completions", json={**CHAT, "n": 100_000})).status_code == 400
        await asyncio.sleep(0.3)  # a sweep of the sessions emits the running totals
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{metrics.prometheus.port}/metrics")).text
    finally:
        await gateway.stop()
        stop_prometheus(metrics.prometheus)
    labels = '{run_id="r",source="gateway"}'
    assert f"rlstream_gateway_sessions_evicted_total{labels} 2.0" in text, text[-2000:]
    assert 'rlstream_gateway_requests_rejected_total{reason="bad_n",run_id="r",source="gateway"} 1.0' in text
    assert f"rlstream_gateway_sessions_split_long_total{labels} 0.0" in text
