"""The gateway under hostile requests (docs/gateway-bounds.md): each attack against its guard, with its negative control
(the same attack where the guard does not apply, or the path that was always safe). In-process, canned upstream."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import httpx
import pytest
import yaml
from pydantic import SecretStr, ValidationError

import rlstream.gateway.limits as limits
from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.auth import DEFAULT_TENANT, AccessConfig, KeysFileExposed, KeyStore
from rlstream.gateway.config import GatewaySettings
from rlstream.rollout.streaming import StreamAccumulator
from rlstream.schemas.config import GatewayConfig, KafkaConfig, RlstreamConfig
from rlstream.schemas.models import RewardEvent, TrajectoryEvent
from tests.unit.test_gateway_sessions import (USER, FakePublisher, fake_upstream, responses_upstream,
                                              streamed_choices_upstream)

KEY = "acme-key-0123456789abcdef"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = {"model": "m", "messages": [USER]}

pytestmark = pytest.mark.unit


def write_keys(path: Path, mode: int = 0o600) -> Path:
    path.write_text(json.dumps({"keys": [{"key": KEY, "tenant": "acme"}]}))
    path.chmod(mode)
    return path


def chat_or_responses(request: httpx.Request) -> httpx.Response:
    return (responses_upstream if request.url.path.endswith("/responses") else fake_upstream)(request)


async def keyed(tmp_path: Path, upstream: Callable[[httpx.Request], httpx.Response] = chat_or_responses,
                **settings: Any) -> tuple[Gateway, httpx.AsyncClient, FakePublisher]:
    publisher = FakePublisher()
    gateway = Gateway(GatewaySettings(session_stitching="gateway", policy="m", served_model="m", **settings),
                      publisher, client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)),
                      access=AccessConfig(api_keys_file=write_keys(tmp_path / "keys.json"),
                                          feedback_secret=SecretStr("s" * 32)))
    await gateway.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw", timeout=30)
    return gateway, client, publisher


async def close(gateway: Gateway, client: httpx.AsyncClient) -> None:
    await client.aclose()
    await gateway.stop()


async def half_sent(release: asyncio.Event) -> AsyncIterator[bytes]:
    """A body whose end arrives only once ``release`` is set (a client trickling a half-sent request)."""
    yield b'{"reward": 1, '
    await release.wait()
    yield b'"trajectory_id": "t"}'


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_unauthenticated_bodies_never_take_the_slots_of_keyed_requests_and_ready_tells(tmp_path: Path) -> None:
    gateway, c, _ = await keyed(tmp_path, max_concurrent_requests=2, token_concurrent_requests=2)
    stats, release = gateway.limit_stats, asyncio.Event()
    try:
        held = [asyncio.create_task(c.post("/v1/feedback", content=half_sent(release))) for _ in range(3)]
        await until(lambda: stats.token_in_flight == 2 and stats.rejected.get("overloaded_token") == 1)
        assert stats.in_flight == 0
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
        assert (await c.get("/ready")).status_code == 200
        # negative control: the same half-sent bodies with a key in their headers hold the keyed slots
        held += [asyncio.create_task(c.post("/v1/feedback", content=half_sent(release), headers=AUTH))
                 for _ in range(2)]
        await until(lambda: stats.in_flight == 2)
        saturated = await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert saturated.status_code == 503 and saturated.headers["retry-after"] == "1"
        assert (await c.get("/ready")).status_code == 503 and (await c.get("/health")).status_code == 200
        release.set()
        statuses = sorted(r.status_code for r in await asyncio.gather(*held))
        assert statuses == [401, 401, 404, 404, 503]  # no token: 401; keyed, unknown trajectory: 404
        assert (await c.get("/ready")).status_code == 200
    finally:
        release.set()
        await close(gateway, c)


async def test_unauthenticated_feedback_bodies_are_capped_before_they_are_read(tmp_path: Path) -> None:
    gateway, c, _ = await keyed(tmp_path, token_body_max_bytes=4096)
    padded = json.dumps({"reward": 1, "trajectory_id": "t", "pad": "x" * 10_000}).encode()
    nested = b"[" * (8 << 20) + b"]" * (8 << 20)  # 16 MiB of nested arrays
    try:
        for path in ("/v1/feedback", "/api/public/scores", "/feedback", "/v1/logs"):
            r = await c.post(path, content=padded, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.headers["connection"] == "close", (path, r.text)
        assert (await c.post("/v1/feedback", content=nested)).status_code == 413

        async def trickle() -> AsyncIterator[bytes]:  # no Content-Length: cut off as it passes the cap
            for _ in range(10):
                yield b" " * 1000
        assert (await c.post("/v1/feedback", content=trickle())).status_code == 413
        # negative control: with a key in the headers the same body is read and judged (an unknown field: 422)
        assert (await c.post("/v1/feedback", content=padded, headers=AUTH)).status_code == 422
    finally:
        await close(gateway, c)


async def test_json_depth_is_refused_from_the_bytes_before_any_parse(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[int] = []
    loads = limits.orjson.loads

    def spy(raw: bytes) -> Any:
        parsed.append(len(raw))
        return loads(raw)
    monkeypatch.setattr(limits.orjson, "loads", spy)
    gateway, c, _ = await keyed(tmp_path, max_json_depth=8)
    try:
        deep = b'{"reward": 1, "components": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
        r = await c.post("/v1/feedback", content=deep, headers=AUTH)
        assert r.status_code == 400 and "nests deeper than 8" in r.text and parsed == []
        # negative control: at the limit the body is parsed (and judged on its fields)
        at_limit = b'{"reward": 1, "trajectory_id": "t", "x": ' + b"[" * 7 + b"]" * 7 + b"}"
        assert (await c.post("/v1/feedback", content=at_limit, headers=AUTH)).status_code == 422 and len(parsed) == 1
    finally:
        await close(gateway, c)


async def test_streamed_choices_each_go_to_their_own_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    add = StreamAccumulator.add

    def counted(self: StreamAccumulator, chunk: dict[str, Any]) -> None:
        calls[0] += 1
        add(self, chunk)
    monkeypatch.setattr(StreamAccumulator, "add", counted)

    async def stream(n: int) -> tuple[int, list[TrajectoryEvent]]:
        gateway, c, publisher = await keyed(tmp_path, upstream=streamed_choices_upstream)
        calls[0] = 0
        try:
            r = await c.post("/v1/chat/completions", headers=AUTH,
                             json={**CHAT, "n": n, "stream": True, "max_tokens": 2})
            assert r.status_code == 200
        finally:
            await close(gateway, c)
        return calls[0], [e for _, e in publisher.sent if isinstance(e, TrajectoryEvent)]

    small, _ = await stream(16)
    large, trajs = await stream(64)
    assert large < 4.5 * small  # linear in the choices' chunks: 4x the choices, 4x the work
    by_index = {t.generation_index: t for t in trajs}
    assert [by_index[i].messages[-1].content for i in (0, 63)] == ["a0b0", "a63b63"]
    assert by_index[63].turns[0].completion_token_ids == [640, 641] and by_index[0].turns[0].prompt_token_ids == [1, 2]
    # negative control: every chunk offered to every choice's accumulator is quadratic (16x for 4x the choices)
    chunks = [{"choices": [{"index": i, "delta": {"content": "x"}}]} for i in range(64)]
    calls[0] = 0
    for chunk in chunks:
        for acc in [StreamAccumulator(None, choice_index=i) for i in range(64)]:
            acc.add(chunk)
    assert calls[0] == 64 * 64


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true, '
                             b'"user": "\\udfff"}'),
    ("/v1/responses", b'{"model": "m", "input": "\\ud800"}'),
    ("/v1/feedback", b'{"reward": 1, "trajectory_id": "\\ud800"}'),
], ids=["chat-content", "chat-user-streamed", "responses-input", "feedback"])
async def test_lone_surrogates_are_400_and_pairs_are_fine(tmp_path: Path, route: str, body: bytes) -> None:
    gateway, c, _ = await keyed(tmp_path)
    try:
        r = await c.post(route, content=body, headers=AUTH)
        assert r.status_code == 400 and "surrogate" in r.text, r.text
        # negative control: a valid pair (an emoji) in the same place is not refused
        paired = await c.post(route, content=body.replace(b"\\ud800", b"\\ud83d\\ude00").replace(
            b"\\udfff", b"\\ud83d\\ude00"), headers=AUTH)
        assert paired.status_code != 400 and paired.status_code < 500, paired.text
    finally:
        await close(gateway, c)


async def test_max_messages(tmp_path: Path) -> None:
    gateway, c, _ = await keyed(tmp_path, max_messages=4)
    try:
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER] * 5}, headers=AUTH)
        assert r.status_code == 400 and "max_messages" in r.text
        r = await c.post("/v1/responses", json={"model": "m", "input": [USER] * 5}, headers=AUTH)
        assert r.status_code == 400 and "max_messages" in r.text
        assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER] * 4},
                             headers=AUTH)).status_code == 200
    finally:
        await close(gateway, c)


async def test_every_endpoint_refuses_a_malformed_body_in_its_own_api_shape_and_counts_it(tmp_path: Path) -> None:
    gateway, c, publisher = await keyed(tmp_path, max_messages=4, max_choices=4)
    refused = {  # route -> bodies the endpoint must refuse with 400 before anything reaches the upstream
        "/v1/chat/completions": [[], {"model": "m"}, {"model": "m", "messages": "hi"},
                                 {"model": "m", "messages": [USER] * 5}, {"model": "m", "messages": [USER], "n": 5},
                                 {"model": "m", "messages": [USER], "temperature": "hot"}],
        "/v1/completions": [[], {"model": "m"}, {"model": "m", "prompt": "hi", "n": 0}],
        "/v1/responses": [[], {"model": "m", "input": [USER] * 5}],
        "/v1/messages": [[], {"model": "m", "max_tokens": 8}, {"model": "m", "max_tokens": 8, "messages": [USER] * 5},
                         {"model": "m", "max_tokens": 8, "messages": [USER], "temperature": -1}],
    }
    try:
        for route, bodies in refused.items():
            for body in bodies:
                r = await c.post(route, json=body, headers=AUTH)
                assert r.status_code == 400, (route, body, r.text)
                error = r.json()
                if route == "/v1/messages":  # Anthropic's error shape
                    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
                else:  # OpenAI's
                    assert error["error"]["code"] == 400 and error["error"]["message"], error
        assert sum(gateway.limit_stats.rejected.values()) == sum(len(b) for b in refused.values())
        assert gateway.limit_stats.rejected["bad_request"] == 8 and gateway.limit_stats.rejected["too_many_messages"] == 3
        assert publisher.sent == []  # nothing captured
        # control: a well-formed body of each kind goes through
        assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": [USER] * 4, "n": 4},
                             headers=AUTH)).status_code == 200
    finally:
        await close(gateway, c)


async def test_body_and_session_bounds_stay_below_what_kafka_takes(tmp_path: Path) -> None:
    settings = GatewaySettings.resolve(RlstreamConfig(kafka=KafkaConfig(max_message_bytes=1_000_000)))
    assert settings.max_body_bytes == settings.max_session_bytes == 500_000
    for key in ("max_body_bytes", "max_session_bytes"):
        with pytest.raises(ValueError, match="kafka.max_message_bytes"):
            GatewaySettings.resolve(RlstreamConfig(gateway=GatewayConfig(**{key: 2_000_000})))
    gateway, c, publisher = await keyed(tmp_path, max_body_bytes=settings.max_body_bytes)
    try:
        huge = {"model": "m", "messages": [{"role": "user", "content": "x" * 2_000_000}]}
        r = await c.post("/v1/chat/completions", json=huge, headers=AUTH)
        assert r.status_code == 413 and not publisher.sent  # refused at the door, never "answered and dropped"
        # negative control: a call under the bound is answered and captured
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
        await until(lambda: any(isinstance(e, TrajectoryEvent) for _, e in publisher.sent))
    finally:
        await close(gateway, c)


async def test_blank_feedback_id_is_422_at_the_door(tmp_path: Path) -> None:
    gateway, c, publisher = await keyed(tmp_path)
    try:
        tid = (await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)).headers["x-rlstream-trajectory-id"]
        r = await c.post("/v1/feedback", json={"reward": 1, "trajectory_id": tid, "feedback_id": "   "}, headers=AUTH)
        assert r.status_code == 422 and "feedback_id" in r.text
        assert not [e for _, e in publisher.sent if isinstance(e, RewardEvent)]
        ok = await c.post("/v1/feedback", json={"reward": 1, "trajectory_id": tid, "feedback_id": "fb-1"}, headers=AUTH)
        assert ok.status_code == 202  # negative control: a usable id
    finally:
        await close(gateway, c)


def test_an_exposed_keys_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(KeysFileExposed, match="chmod 600"):
        KeyStore(keys_file=write_keys(tmp_path / "keys.json", 0o644))
    with pytest.raises(KeysFileExposed):
        KeyStore(keys_file=write_keys(tmp_path / "keys.json", 0o640))
    assert KeyStore(keys_file=write_keys(tmp_path / "keys.json")).authenticate(KEY) is not None  # control: 0600


@pytest.mark.parametrize("damage", ["missing", "invalid"])
def test_a_missing_or_invalid_keys_file_stops_the_start(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "keys.json"
    if damage == "invalid":
        path.write_text("keys: [ {key: ")
        path.chmod(0o600)
    with pytest.raises((FileNotFoundError, yaml.YAMLError)):  # the start stops: no gateway without its keys
        KeyStore(["inline-operator-key-0123"], keys_file=path)
    assert KeyStore(keys_file=write_keys(path)).authenticate(KEY) is not None  # control: the file fixed


@pytest.mark.parametrize("damage", ["missing", "invalid", "exposed"])
def test_a_keys_file_that_goes_bad_refuses_its_keys(tmp_path: Path, damage: str) -> None:
    path = write_keys(tmp_path / "keys.json")
    store = KeyStore(["inline-operator-key-0123"], keys_file=path)
    assert store.authenticate(KEY) is not None  # control: the file's key works until the file goes bad
    if damage == "missing":
        path.unlink()
    elif damage == "invalid":
        path.write_text("keys: [ {key: ")
    else:
        path.chmod(0o644)
    store.maybe_reload(now=1e9)
    assert store.authenticate(KEY) is None and store.reload_errors == 1
    assert store.authenticate("inline-operator-key-0123") is not None  # the operator's own keys are not the file's
    write_keys(path)
    store.maybe_reload(now=2e9)
    assert store.authenticate(KEY) is not None


def test_a_keys_file_entry_without_a_tenant_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": KEY}]}))
    path.chmod(0o600)
    with pytest.raises(ValidationError, match=r"keys\.0\.tenant"):  # at start: the start stops
        KeyStore(["inline-operator-key-0123"], keys_file=path)
    store = KeyStore(["inline-operator-key-0123"], keys_file=write_keys(path))
    acme = store.authenticate(KEY)
    assert acme is not None and acme.tenant == "acme"  # control: the same key with its tenant
    path.write_text(json.dumps({"keys": [{"key": KEY}]}))  # an edit drops the tenant: the file fails closed
    store.maybe_reload(now=1e9)
    assert store.authenticate(KEY) is None and store.reload_errors == 1
    operator = store.authenticate("inline-operator-key-0123")
    assert operator is not None and operator.tenant == DEFAULT_TENANT  # the operator's tenant stays its own


async def test_token_holders_are_rate_limited(tmp_path: Path) -> None:
    gateway, c, _ = await keyed(tmp_path, token_rpm=2)
    try:
        r = await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        token = {"x-rlstream-feedback-token": r.headers["x-rlstream-feedback-token"]}
        statuses = [(await c.post("/v1/feedback", json={"reward": 1}, headers=token)).status_code for _ in range(3)]
        assert statuses == [202, 202, 429]
        body_token = {"reward": 1, "feedback_token": token["x-rlstream-feedback-token"]}
        assert (await c.post("/v1/feedback", json=body_token)).status_code == 429  # in the body too
        # negative control: the key itself (in the headers) is not held to the token holders' rate
        tid = r.headers["x-rlstream-trajectory-id"]
        assert [(await c.post("/v1/feedback", json={"reward": 1, "trajectory_id": tid}, headers=AUTH)).status_code
                for _ in range(3)] == [202, 202, 202]
    finally:
        await close(gateway, c)


def otlp(count: int, response_id: str) -> dict[str, Any]:
    records = [{"eventName": "gen_ai.evaluation.result", "attributes": [
        {"key": "gen_ai.response.id", "value": {"stringValue": response_id}},
        {"key": "gen_ai.evaluation.name", "value": {"stringValue": f"e{i}"}},
        {"key": "gen_ai.evaluation.score.value", "value": {"doubleValue": 0.5}}]} for i in range(count)]
    return {"resourceLogs": [{"scopeLogs": [{"logRecords": records}]}]}


async def test_otlp_rewards_per_request_are_capped(tmp_path: Path) -> None:
    gateway, c, publisher = await keyed(tmp_path, max_rewards_per_request=3)
    try:
        # the trajectory id names the call (this upstream's answers carry no response id)
        response_id = (await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)).headers["x-rlstream-trajectory-id"]
        r = await c.post("/v1/logs", json=otlp(4, response_id), headers=AUTH)
        assert r.status_code == 413 and "max_rewards_per_request" in r.text
        assert not [e for _, e in publisher.sent if isinstance(e, RewardEvent)]
        assert (await c.post("/v1/logs", json=otlp(3, response_id), headers=AUTH)).status_code == 200  # control
    finally:
        await close(gateway, c)


@pytest.mark.parametrize("temperature", [1e-3, 1e6, -1.0, "hot"])
async def test_a_temperature_the_learner_may_not_train_on_is_400(tmp_path: Path, temperature: object) -> None:
    gateway, c, publisher = await keyed(tmp_path)
    try:
        for path, body in (("/v1/chat/completions", {"model": "m", "messages": [USER]}),
                           ("/v1/responses", {"model": "m", "input": [USER]})):
            r = await c.post(path, json={**body, "temperature": temperature}, headers=AUTH)
            assert r.status_code == 400 and "temperature" in r.text, (path, r.text)
        assert not publisher.sent
        # controls: in streams.temperature_range, greedy (below vLLM's 1e-5, 0 included) and absent are answered
        for ok in (0.7, 0.0, 1e-38, None):
            body = {"model": "m", "messages": [USER], **({} if ok is None else {"temperature": ok})}
            assert (await c.post("/v1/chat/completions", json=body, headers=AUTH)).status_code == 200, ok
    finally:
        await close(gateway, c)
